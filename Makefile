# `make run` and `make test` work on a fresh clone with only Python installed.
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch; it is on local disk here. Override for a GPU build, e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4
CONFIG ?= configs/gpt-tiny.toml
PY := $(VENV)/bin/python

TITAN_VENV ?= .venv-titan

.PHONY: run test test-cpu test-quick test-long test-titan check sim bench gpu-check stats clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,lint,oracle,hf,tensorboard]"
	touch $@

# Train the tiny GPT with ready BFW, then fixed 1F1B vs ready BFW under `lang` in emulated device time
# (rrfp bench: alternating on the same iterations, medians in a results folder).
run: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/rrfp train --nproc-per-node $(NPROC) --config $(CONFIG) \
		--set output.log_every=5
	$(PY) -m rrfp bench --workloads gpt --contenders fixed-1f1b,ready-bfw --pp 4 --n-microbatches 16 \
		--preset lang --reps 3 --unit-ms 20

sim: $(VENV)/.installed
	$(PY) -m rrfp sim --pp 8 --n-microbatches 32 --preset lang --seeds 20

# Three test processes (pytest-xdist) on 2 cores, each file's tests in one of them: many multi-rank
# tests wait on emulated device time, timeouts and their ranks, so a third keeps both cores busy
# meanwhile (on a quiet 2-core machine `make test` took 532 s with three, 582 s with two). Files are
# handed out in collection order, longest tiers first (tests/conftest.py), not xdist's
# most-tests-first, which leaves the one-test torchrun files for last.
XDIST := -n 3 --dist loadfile --no-loadscope-reorder
# pytest rewrites the asserts of every test module and of its plugins' packages (hypothesis, anyio,
# xdist) in each process, and keeps the result only where Python may write bytecode. With
# PYTHONDONTWRITEBYTECODE set, the controller and each worker rewrote them all again: the
# collection of `make test` on a fresh clone took 56 CPU-s with it set, 44 without. The caches go
# in .venv and in __pycache__ folders, which git ignores.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
test: $(VENV)/.installed
	$(PYTEST) -q $(XDIST) -m "not long"

# `make test`'s tests with each test's CPU seconds recorded (tests/harness/cpu_times.py), then
# where they went by tier, file and test (tools/test_cpu.py): CPU seconds do not depend on load.
TEST_CPU ?= .test-cpu
test-cpu: $(VENV)/.installed
	rm -rf $(TEST_CPU)
	RRFP_TEST_CPU=$(TEST_CPU) $(PYTEST) -q $(XDIST) -m "not long"; status=$$?; \
		$(PY) tools/test_cpu.py $(TEST_CPU); exit $$status

# The tests that wait out a fault (a rank killed, stopped, busy or slow) and the timeout that names
# it: minutes of waiting by design, so not in `make test`; CI runs them after it.
test-long: $(VENV)/.installed
	$(PYTEST) -q $(XDIST) -m long

# The quick tier for everyday work: the unit tests, which start no second process (tests/conftest.py
# says what the tiers are and fails a test that starts a process without its file marking it).
test-quick: $(VENV)/.installed
	$(PYTEST) -q $(XDIST) -m unit

# rrfp.titan against torchtitan's own pipelining (docs/torchtitan.md), in a venv of its own: the
# titan extra's datasets pins a huggingface-hub that the hf extra's transformers refuses. torchtitan
# imports triton, which the CPU build of torch does not bring.
$(TITAN_VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TITAN_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" triton==3.9.0
	$(TITAN_VENV)/bin/python -m pip install --quiet -e ".[test,titan]"
	touch $@

test-titan: $(TITAN_VENV)/.installed
	RRFP_TITAN_TESTS=1 $(TITAN_VENV)/bin/python -m pytest -q tests/titan

# Format, lint and type-check: ruff at line length 100, mypy strict on the pure core (pyproject.toml).
check: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The house's measures (tools/stats.py): modules per folder of rrfp/, defaults written outside
# their declaration, retired words still written; non-zero when one is off.
stats: $(VENV)/.installed
	$(PY) tools/stats.py

# The CUDA/NCCL path on a real GPU (use TORCH_SPEC=torch for a CUDA build); prints what ran and what was skipped.
gpu-check: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py

# The suite side by side (rrfp and torch executors, gpt and vlm, device time emulated): results/bench-<timestamp>/
bench: $(VENV)/.installed
	$(PY) benchmarks/sim_scale.py
	$(PY) -m rrfp bench

clean:
	rm -rf $(VENV) $(TITAN_VENV) build *.egg-info
