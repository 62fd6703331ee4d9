"""GPU checks (marked `gpu`, skipped without CUDA): the pipeline in bf16 on one GPU, and
offload/reload bandwidth against a raw pinned copy of the same bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_pipeline_on_one_gpu_in_bf16(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["cluster.device=cuda", "steps=3", f"run_dir={run}", "roles.actor_train.device_mapping=[0]",
                  "roles.actor_train.backend=fsdp:d1", "roles.actor_infer.device_mapping=[0]", "roles.actor_infer.backend=hf:d1",
                  "roles.reference.device_mapping=[0]"], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[-1]["mem/actor_train/peak_allocated"] > 0  # the state really lived on the GPU
    assert rows[-1]["offload/bytes"] > 0 and rows[-1]["reload/bytes"] > 0


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
