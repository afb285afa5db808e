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
