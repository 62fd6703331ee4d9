# rlbatch: `make run` (set up + the default experiment) and `make test` (set up + the whole suite).
# Everything installs into .venv; the Slurm test cluster's system packages are installed by
# slurm/dev-cluster.sh (root, Debian/Ubuntu) when `make test` starts it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlbatch-installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: run test venv lint typecheck cluster-start cluster-stop clean

venv: $(STAMP)

# torch is installed first and pinned: on a machine without a GPU `pip install torch==2.13.0`
# resolves to the CPU build, and the later install sees torch satisfied and downloads no CUDA.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

run: venv
	$(PY) -m rlbatch.launch $(ARGS)

test: venv lint typecheck
	bash slurm/dev-cluster.sh start
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check rlbatch tests tools

typecheck: venv
	$(PY) -m mypy

cluster-start:
	bash slurm/dev-cluster.sh start

cluster-stop:
	bash slurm/dev-cluster.sh stop

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
