PY ?= .venv/bin/python
PY_0523 ?= .venv-0523/bin/python

# Bytecode is cached (__pycache__, git-ignored) even where the environment
# says not to: every xdist worker re-parsed and assertion-rewrote every test
# module, and every rank process recompiled this package (collecting the
# 0.5.18 suite: 38 s without the cache, 25 s with it).
export PYTHONDONTWRITEBYTECODE =

.PHONY: install install-0518 test lint test-0518 test-0518-interpreted bench-bookkeeping simulate gpu-check

# One-time setup of both environments (CPU builds, no GPU deps): .venv with
# SGLang 0.5.18, .venv-0523 with SGLang 0.5.23 (one distribution name: two venvs).
# One line per step; pip's own output goes to build/install-0518.log and
# build/install-0523.log, named with its last lines when a step fails.
install: install-0518 install-0523
	@echo "install: done: .venv (SGLang 0.5.18) and .venv-0523 (SGLang 0.5.23); next: make test"

install-0518:
	@bash scripts/install.sh

# The test command (README and .ci/run run exactly this): the linter, then its
# three parts at once (make -j3), each part's output printed whole as it ends.
# Every test holds one of PYTEST_XDIST_WORKER_COUNT CPU slots (lock files in a
# fresh directory, tests/helpers/cpu_slots.py), so no more tests run at once
# than one part alone ran, while one part's start-up and tail are filled with
# the others' tests (one after another they took 11-13 minutes on two cores).
test: lint
	@slots=$$(mktemp -d "$${TMPDIR:-/tmp}/cp-hicache-test-slots.XXXXXX") && \
	CP_HICACHE_TEST_SLOTS=$$slots $(MAKE) --no-print-directory -k -j3 --output-sync=target \
		test-0518 test-0518-interpreted test-0523; \
	rc=$$?; rm -rf "$$slots"; exit $$rc

# ruff (pyproject.toml [tool.ruff]: pyflakes and statement errors) over the whole tree, a second or two.
lint:
	$(PY) -m ruff check .

# Each part runs on pytest-xdist, one worker per core (PYTEST_XDIST_AUTO_NUM_WORKERS
# overrides the count; PYTEST_PAR= runs in one process). loadgroup keeps the
# tests sharing a module/session fixture on one worker; work goes out in
# collection order, which tests/conftest.py starts with those and the slow tests.
PYTEST_PAR ?= -n auto --dist loadgroup --no-loadscope-reorder

test-0518:
	CP_HICACHE_TEST_PART=0 $(PY) -m pytest $(PYTEST_PAR) tests

# The copy paths again with the Triton kernels themselves (interpreter) as the
# CPU backend: kernels, the adapter's copy path, faults, no-sync. Tests marked
# same_under_interpret cannot depend on TRITON_INTERPRET in the pytest process
# (they run only subprocesses whose variable they set, set it themselves in
# every test, or launch through the launcher, which interprets CPU tensors
# whatever it says): test-0518 runs them, a second run here would repeat them unchanged.
test-0518-interpreted:
	CP_HICACHE_TEST_PART=1 TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_PAR) -m "not same_under_interpret" \
		tests/kernels tests/sglang_0518/test_sglang_cp.py \
		tests/sglang_0518/test_faults.py tests/sglang_0518/test_no_sync.py

# On a machine with one GPU (< 5 minutes); results under bench/results/gpu_check_<time>.
# Offline: installs this checkout with pip --no-deps --no-build-isolation --no-index
# (setuptools>=77, pytest, hypothesis from build/gpu-wheels when missing there).
gpu-check:
	bash bench/gpu_check.sh

# Where a package index is reachable: the small wheels to carry to a bare GPU
# machine for `make gpu-check` (build/gpu-wheels, ~4 MB).
.PHONY: gpu-wheels
gpu-wheels:
	bash scripts/gpu-wheels.sh

# The kernel suite on the GPU test machine's triton (3.6.0) with numpy 2.4 and
# no SGLang, under the interpreter; not part of `make test` (~30 s to build its
# venv from local wheels, ~65 s for the suite on 2 shared cores).
PY_TRITON36 ?= build/venv-triton36/bin/python
.PHONY: install-triton36 test-triton36
install-triton36:
	bash scripts/install-triton36.sh

test-triton36:
	[ -x $(PY_TRITON36) ] || bash scripts/install-triton36.sh
	TRITON_INTERPRET=1 $(PY_TRITON36) -m pytest tests/kernels

bench-bookkeeping:
	$(PY) bench/bench_bookkeeping.py

# 2 CP ranks as 2 processes on a gloo group, real SGLang, bit-exact checks.
simulate:
	$(PY) -m sglang_cp_hicache simulate

# One-time setup of .venv-0523: CPU torch 2.13.0 and SGLang 0.5.23 (no GPU deps).
.PHONY: install-0523
install-0523:
	@bash scripts/install-0523.sh

# Both releases' CP cache state machines under the hypothesis dev profile
# with random seeds, then random workloads through SGLang's real Scheduler
# on both releases (tests/soak/scheduler.py), SOAK_MINUTES minutes each
# (0.5.18 in .venv, 0.5.23 in .venv-0523); prints every seed and step count.
SOAK_MINUTES ?= 20
.PHONY: soak
soak:
	$(PY) -m tests.soak --release 0.5.18 --minutes $(SOAK_MINUTES) --python $(PY)
	$(PY) -m tests.soak --release 0.5.23 --minutes $(SOAK_MINUTES) --python $(PY_0523)
	$(PY) -m tests.soak --release 0.5.18 --engine scheduler --minutes $(SOAK_MINUTES) --python $(PY)
	$(PY) -m tests.soak --release 0.5.23 --engine scheduler --minutes $(SOAK_MINUTES) --python $(PY_0523)

# The SGLang 0.5.23 suite (collected only under 0.5.23).
.PHONY: test-0523
test-0523:
	CP_HICACHE_TEST_PART=2 $(PY_0523) -m pytest $(PYTEST_PAR) tests/sglang_0523
