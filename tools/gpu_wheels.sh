#!/usr/bin/env bash
# Downloads, here (where pip reaches PyPI), the wheels rlbatch needs on a GPU machine whose Python
# lacks them and which has no network, into .gpu-wheels/ (git-ignored); tools/gpu_check.sh installs
# them there offline (pip --no-index --no-deps: the machine's torch is never touched).
#
#   bash tools/gpu_wheels.sh                      # ~15 MiB into .gpu-wheels/
#   PYTHON=python3.12 DEST=/path bash tools/gpu_wheels.sh
#
# For a Python 3.12 on x86-64 Linux (the lent machines' image: torch 2.11+cu130, transformers,
# numpy, safetensors, tokenizers, PyYAML, tqdm, tensorboard, matplotlib, pytest and mpi4py, but
# none of the below). What a local run imports beyond that image:
#   hydra-core, omegaconf     the config (launch composes it, every rank reads it)
#   antlr4-python3-runtime    their parser; PyPI has its source only: built here, pure Python
#   mpich                     the MPI library and mpiexec (mpi4py loads the library at run time)
#   mpi4py                    installed there only if the image's cannot load mpich's library
#   megatron-core             the megatron engine's GPU test (tests/gpu/test_gpu.py; ~2.4 MiB)
# Not needed for the check: submitit and hydra-submitit-launcher (cluster=slurm), datasets
# (data.name=file), deepspeed and vllm (imported by their engines only; vLLM's CUDA
# wheel is hundreds of MB and cannot travel, so the check's vllm steps need it installed there).
# Versions: the ones this checkout's .venv runs its tests with.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEST=${DEST:-$REPO/.gpu-wheels}
PY_VERSION=${PY_VERSION:-3.12}
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 mpich==4.3.2 mpi4py==4.1.2 megatron-core==0.19.2)
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${platform_args[@]}" -d "$DEST" "${WHEELS[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps --no-binary=:all: -w "$DEST" "${SDIST_ONLY[@]}"
ls -l "$DEST"
echo "$(du -sb "$DEST" | cut -f1) bytes in $DEST (carry it: \"carry\": [\"${DEST#"$REPO"/}\"])"
