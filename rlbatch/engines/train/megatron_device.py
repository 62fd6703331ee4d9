"""Which devices the ``megatron`` engine runs on.

megatron-core targets CUDA and calls it directly in places (RoPE frequencies, the causal mask,
streams), so on a machine without a GPU the engine refuses to start, unless a process-wide CPU
shim has registered itself here. The one this repository has is test-only
(``tests/plugins/megatron_cpu.py``, loaded with ``plugins=[tests.plugins.megatron_cpu]``); it
exists so the engine's numerics are tested on CPU with gloo. See docs/megatron.md.
"""

from __future__ import annotations

import torch

CPU_SHIM: str | None = None
"""The module name of the CPU shim installed in this process, if any (set by the shim itself)."""


def check_device(device: torch.device) -> None:
    """Refuse a CPU device unless a CPU shim is installed, saying how to run."""
    if device.type == "cuda" or CPU_SHIM is not None:
        return
    raise RuntimeError(
        "the megatron engine needs CUDA: megatron-core creates tensors on 'cuda' directly, and this rank's "
        f"device is {device}. On a machine without a GPU use backend fsdp:dN (same model, same checkpoints), "
        "or, to exercise the engine on CPU as the tests do, add plugins=[tests.plugins.megatron_cpu] "
        "from a checkout of the repository (a test-only shim, see docs/megatron.md)."
    )
