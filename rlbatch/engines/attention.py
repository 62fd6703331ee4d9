"""Attention over packed rows without a dense mask: PyTorch's variable-length flash attention.

A packed row (``rlbatch.engines.batch.Flat``) holds many samples back to back. Under sdpa,
transformers confines attention to each sample with a block-diagonal [N, N] mask, which sdpa
turns into an additive mask in every layer and which rules out its flash kernel: on one H100 a
4096-token budget halved training throughput on uniform 1024-token samples against padded rows.
``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative sequence lengths, CUDA,
bf16/fp16) takes the boundaries instead: no mask, linear memory, the flash kernel.

``prefer_varlen(model)`` switches a training engine's model to ``VARLEN``, registered with
transformers' attention interface. Calls that carry ``cu_seq_lens_q`` (``Flat.attention_kwargs``)
run varlen; every other call (padded rows with a mask, a prompt's KV cache) is sdpa as before,
with the mask sdpa would get. Where varlen is unavailable (no CUDA, no such torch API, fp32
compute) the model stays on sdpa and packed rows keep transformers' exact mask.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

VARLEN = "rlbatch_varlen"


def _kernel() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9
        return None
    kernel: Callable[..., torch.Tensor] = varlen_attn  # type: ignore[assignment]  # returns a pair only when asked
    return kernel


@functools.lru_cache(maxsize=8)
def _params(kernel: Callable[..., torch.Tensor]) -> frozenset[str]:
    """The kernel's keyword names, read once (every layer of every packed forward asks)."""
    return frozenset(inspect.signature(kernel).parameters)


def _causal_kwargs(kernel: Callable[..., torch.Tensor],
                   sliding_window: int | None) -> dict[str, tuple[int, int] | bool]:
    """Causal attention (within ``sliding_window`` tokens, when set) in the kernel's own terms:
    ``window_size=(left, right)`` in newer torch, ``is_causal`` in the first releases."""
    if "window_size" in _params(kernel):
        return {"window_size": (-1 if sliding_window is None else sliding_window - 1, 0)}
    if sliding_window is not None:
        raise NotImplementedError(f"packed rows with sliding-window attention ({sliding_window} tokens) need "
                                  f"torch's varlen_attn with window_size (torch >= 2.11); this torch is {torch.__version__}")
    return {"is_causal": True}


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [1, Hq, N, D], ``key``/``value``
    [1, Hkv, N, D] -> ([1, N, Hq, D], None). Without ``cu_seq_lens_q`` it is sdpa's."""
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(name, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    kernel = _kernel()
    assert kernel is not None and query.shape[0] == 1, "varlen attention takes one packed row (Flat)"
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} on packed rows: varlen_attn has none; "
                                  "set the model's attention_dropout to 0 or engine_args.max_tokens_per_micro_batch=0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    extra = _causal_kwargs(kernel, sliding_window)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _params(kernel):
            extra["enable_gqa"] = True
        else:  # grouped-query attention by repeating each KV head for its query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    m = int(kwargs.get("max_length_q", 0))
    out = kernel(q, k, v, cu, kwargs.get("cu_seq_lens_k", cu), m, int(kwargs.get("max_length_k", m)),
                 scale=scaling, **extra)
    return out[None], None


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed rows on ``device`` computing in ``dtype`` can run varlen attention."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _kernel() is not None


def register() -> None:
    """Make ``VARLEN`` a transformers attention implementation (idempotent). Its mask function is
    sdpa's, except that a call with no 2-D mask (a packed row, or one unpadded sequence) gets none:
    the kernel reads the boundaries, and a lone causal sequence needs no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(**kwargs: Any) -> torch.Tensor | None:  # sdpa_mask's keyword arguments
        return None if kwargs.get("attention_mask") is None else sdpa_mask(**kwargs)

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, mask)


def prefer_varlen(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Switch ``model`` (a transformers model, possibly wrapped) to varlen attention for packed rows
    when ``available``; returns whether it did. Only models on sdpa are switched (eager is kept
    where a model asked for it)."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not available(device, dtype):
        return False
    register()
    config._attn_implementation = VARLEN
    return True
