"""Test-only: lets megatron-core's GPTModel run forward and backward on CPU (gloo), so the
``megatron`` engine is tested on a machine without a GPU. Production code never imports this.

megatron-core calls CUDA directly in a few places it reaches on our path (the RoPE frequencies
and the causal mask are created with ``device=torch.cuda.current_device()`` / ``device="cuda"``,
``torch.cuda.synchronize`` / ``current_stream``). Importing this module (``plugins=[tests.plugins.megatron_cpu]``
in a run, or a plain import in a test script) installs, for the whole process:

- a ``TorchFunctionMode`` that turns ``device="cuda"`` (or a CUDA index) in any torch call into
  ``cpu``, ``Tensor.cuda()`` into a no-op, and reports a CPU tensor's ``Tensor.type()`` as
  ``torch.cuda.*`` (megatron-core's distributed optimizer asserts CUDA tensor types);
- stubs for ``torch.cuda.current_device``, ``synchronize``, ``current_stream``, ``Stream`` and
  ``stream`` (the Mixture-of-Experts token dispatcher copies its split sizes on a side stream),
  and those split sizes turned into numpy arrays as on a GPU;
- ``torch.distributed.all_gather`` and ``reduce_scatter`` of tensors of unequal sizes, which NCCL
  runs and gloo refuses: the token dispatcher gathers over expert tensor-parallel ranks as many
  tokens as each received (a hybrid ``(attn:...|ffn:...)`` layout with ffn t > 1 and e > 1). Here
  the gather pads every piece to the largest and cuts the padding off; the reduce-scatter is an
  all-reduce of the whole, of which each rank keeps its piece (the same sums). Patched on the
  module, not in the mode: backward() runs them too, outside the mode;
- the marker the engine checks before it agrees to run on CPU
  (``rlbatch.engines.megatron.device.CPU_SHIM``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlbatch.engines.megatron import device as megatron_device


def _cpu(device: Any) -> Any:
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _uneven(tensors: Any) -> bool:
    return isinstance(tensors, (list, tuple)) and len({tuple(t.shape) for t in tensors}) > 1


def _uneven_collectives() -> None:
    dist = torch.distributed
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def gather(out: list[torch.Tensor], x: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        if not _uneven(out):
            return all_gather(out, x, group=group, async_op=async_op)
        padded = x.new_zeros(max(t.shape[0] for t in out), *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in out]
        all_gather(parts, padded, group=group)
        for o, p in zip(out, parts, strict=True):
            o.copy_(p[: o.shape[0]])
        return None

    def scatter(out: torch.Tensor, pieces: list[torch.Tensor], op: Any = dist.ReduceOp.SUM, group: Any = None,
                async_op: bool = False) -> Any:
        if not _uneven(pieces):
            return reduce_scatter(out, pieces, op=op, group=group, async_op=async_op)
        whole = torch.cat([p.reshape(-1) for p in pieces])
        dist.all_reduce(whole, op=op, group=group)
        start = sum(p.numel() for p in pieces[: dist.get_rank(group)])
        out.copy_(whole[start : start + out.numel()].view_as(out))
        return None

    dist.all_gather, dist.reduce_scatter = gather, scatter


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
    """A CUDA stream or event on CPU, where every operation is already complete in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> _Stream:
        return self


def _splits_as_numpy() -> None:
    """The MoE token dispatcher copies its all-to-all split sizes off the GPU as numpy arrays
    (``maybe_move_tensor_to_cpu(..., as_numpy=True)``), and leaves a tensor already on the host as
    it is, which torch's ``all_to_all_single`` does not take as split sizes. On CPU every tensor is
    already there: convert it as the GPU path would."""
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def install() -> None:
    if megatron_device.CPU_SHIM is not None:
        return
    # "cpu", not an index: a device index means the accelerator, and what backward() runs (the MoE
    # all-to-all's buffers) runs outside the mode (a mode is off inside its own handler).
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]  # the MoE dispatcher's side stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    _splits_as_numpy()
    _uneven_collectives()
    CudaToCpu().__enter__()  # for the rest of the process
    megatron_device.CPU_SHIM = __name__


install()
