"""GPU checks (marked `gpu`, skipped without CUDA): the pipeline on one GPU with the CPU reward
worker, hf and vLLM colocated (sleep and wake), each through a checkpoint and a resume; offload
and reload bandwidth against a raw pinned copy of the same bytes.

The pipeline tests launch what ``tools/gpu_check.sh`` launches (``tests/gpu/check.py``), which
runs them as its pipeline steps and its ``--cpu`` mode runs on the CPU in CI."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.gpu import check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VLLM_MISSING = check.vllm_missing()


def test_pipeline_on_one_gpu_in_bf16(run_root: Path) -> None:
    """2 steps with hf rollouts, a checkpoint after each, then a resumed third step: the state lives
    on the GPU (peak allocated > 0), colocated roles move it off and back every step."""
    check.run_pipeline("hf", "cuda", run_root)
    check.resume_pipeline("hf", "cuda", run_root)


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"needs vLLM's CUDA build: {VLLM_MISSING}")
def test_vllm_colocated_sleeps_and_wakes_around_a_checkpoint_and_resumes(run_root: Path) -> None:
    """vLLM colocated with actor_train and the reference on one GPU: it sleeps and wakes every step,
    never in a state vLLM is not in (its own warnings), through the checkpoint after step 0 and a
    resumed run."""
    check.run_pipeline("vllm", "cuda", run_root)
    check.resume_pipeline("vllm", "cuda", run_root)


def test_offload_reload_bandwidth_against_raw_pinned_copy() -> None:
    from rlbatch.engines.offload import TensorStash

    tensors = [torch.randn(64 << 20, device="cuda") for _ in range(4)]  # 4 x 256 MiB
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    stash = TensorStash("bench", lambda: tensors)
    stash.offload()
    stash.reload()  # allocate and pin the host buffers once
    torch.cuda.synchronize()
    start = time.perf_counter()
    stash.offload()
    stash.reload()
    ours = time.perf_counter() - start
    host = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for h, t in zip(host, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    for h, t in zip(host, tensors, strict=True):
        t.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    raw = time.perf_counter() - start
    print(f"offload+reload {2 * nbytes / ours / 1e9:.1f} GB/s, raw pinned copy {2 * nbytes / raw / 1e9:.1f} GB/s")
    assert ours <= 2 * raw, f"offload+reload took {ours:.3f}s for {nbytes >> 20} MiB each way; raw pinned copies {raw:.3f}s"
