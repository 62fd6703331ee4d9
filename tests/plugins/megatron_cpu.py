"""Test-only: lets megatron-core's GPTModel run forward and backward on CPU (gloo), so the
``megatron`` engine is tested on a machine without a GPU. Production code never imports this.

megatron-core calls CUDA directly in a few places it reaches on our path (the RoPE frequencies
and the causal mask are created with ``device=torch.cuda.current_device()`` / ``device="cuda"``,
``torch.cuda.synchronize`` / ``current_stream``). Importing this module (``plugins=[tests.plugins.megatron_cpu]``
in a run, or a plain import in a test script) installs, for the whole process:

- a ``TorchFunctionMode`` that turns ``device="cuda"`` (or a CUDA index) in any torch call into
  ``cpu``, ``Tensor.cuda()`` into a no-op, and reports a CPU tensor's ``Tensor.type()`` as
  ``torch.cuda.*`` (megatron-core's distributed optimizer asserts CUDA tensor types);
- stubs for ``torch.cuda.current_device``, ``synchronize`` and ``current_stream``;
- the marker the engine checks before it agrees to run on CPU
  (``rlbatch.engines.train.megatron_device.CPU_SHIM``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlbatch.engines.train import megatron_device


def _cpu(device: Any) -> Any:
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # the distributed optimizer asserts
            name = func(*args)                                          # 'torch.cuda.FloatTensor' & co.
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install() -> None:
    if megatron_device.CPU_SHIM is not None:
        return
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]  # mapped to cpu by the mode
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    CudaToCpu().__enter__()  # for the rest of the process
    megatron_device.CPU_SHIM = __name__


install()
