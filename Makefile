# `make run` and `make test` work on a fresh clone with only Python installed.
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch; it is on local disk here. Override for a GPU build, e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4
CONFIG ?= configs/gpt-tiny.toml
PY := $(VENV)/bin/python

.PHONY: run test sim bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

run: $(VENV)/.installed
	@if [ -f rrfp/train.py ]; then \
		$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m rrfp train --config $(CONFIG) && \
		$(PY) benchmarks/compare_executors.py --quick; \
	else \
		$(PY) -m rrfp sim --pp 8 --mb 32 --preset lang --seeds 20; \
	fi

sim: $(VENV)/.installed
	$(PY) -m rrfp sim --pp 8 --mb 32 --preset lang --seeds 20

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/sim_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
