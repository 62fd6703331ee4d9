"""Which devices the ``megatron`` engine runs on.

megatron-core targets CUDA and calls it directly in places (RoPE frequencies, the causal mask,
streams), so on a machine without a GPU the engine refuses to start, unless a process-wide CPU
shim has registered itself here. The one this repository has is test-only
(``tests/plugins/megatron_cpu.py``, loaded with ``plugins=[tests.plugins.megatron_cpu]``); it
exists so the engine's numerics are tested on CPU with gloo. See docs/megatron.md.

Torch-free: validation asks it before anything starts (``rlbatch.engines.megatron.rules``), with the
config's plugins imported, so a run that would fail on its ranks is refused with the same words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU_SHIM: str | None = None
"""The module name of the CPU shim installed in this process, if any (set by the shim itself)."""


def needs_cuda(device: str) -> str | None:
    """Why the engine cannot run on ``device`` (a device type such as 'cpu', or 'cuda:0'); None
    when it can: CUDA, or any device once a CPU shim is installed."""
    if device.startswith("cuda") or CPU_SHIM is not None:
        return None
    return ("the megatron engine needs CUDA: megatron-core creates tensors on 'cuda' directly, and the ranks' "
            f"device is {device}. On a machine without a GPU use backend fsdp:dN (same model, same checkpoints), "
            "or, to exercise the engine on CPU as the tests do, add plugins=[tests.plugins.megatron_cpu] "
            "from a checkout of the repository (a test-only shim, see docs/megatron.md).")


def check_device(device: torch.device) -> None:
    """Refuse a CPU device (a ``torch.device``) unless a CPU shim is installed, saying how to run."""
    if (why := needs_cuda(str(device))) is not None:
        raise RuntimeError(why)
