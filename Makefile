PY ?= .venv/bin/python

.PHONY: install test bench-bookkeeping simulate

# One-time setup of .venv with the CPU build of torch and SGLang 0.5.18 (no GPU deps).
install:
	bash scripts/install.sh

# The test command (README and .ci/run run exactly this).
test:
	$(PY) -m pytest tests

bench-bookkeeping:
	$(PY) bench/bench_bookkeeping.py

# 2 CP ranks as 2 processes on a gloo group, real SGLang, bit-exact checks.
simulate:
	$(PY) -m sglang_cp_hicache simulate

# One-time setup of .venv-0523: CPU torch 2.13.0 and SGLang 0.5.23 (no GPU deps).
.PHONY: install-0523
install-0523:
	bash scripts/install-0523.sh

# The CP cache state machine under the hypothesis dev profile with random
# seeds, for SOAK_MINUTES minutes; prints every seed and step count.
SOAK_MINUTES ?= 20
.PHONY: soak
soak:
	$(PY) -m tests.sglang.soak --minutes $(SOAK_MINUTES)

# The SGLang 0.5.23 suite (collected only under 0.5.23).
.PHONY: test-0523
test-0523:
	.venv-0523/bin/python -m pytest tests/sglang_0523
