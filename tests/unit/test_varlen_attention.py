"""Packed rows through ``rlbatch.engines.attention.VARLEN``: the boundaries a flat row carries reach
the attention kernel, and the outputs equal transformers' dense block-diagonal mask path.

The kernel, ``torch.nn.attention.varlen.varlen_attn``, is flash attention and runs on CUDA only; here
it is replaced by ``reference_varlen`` below, a stand-in that runs sdpa on each sample's run of the
row separately, in both of the kernel's signatures (``window_size``/``enable_gqa`` and the first
releases' ``is_causal``). What the stand-in replaces, the flash kernel itself, runs in
tests/gpu/test_gpu.py::test_packed_rows_score_as_padded_rows_on_cuda (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlbatch.engines import attention
from rlbatch.engines.batch import Flat, pack, response_logprobs
from tests.unit.test_batch import make_samples
from tests.unit.test_packing_forward import CPU, PAD, SHAPES, _close, _model


def _segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool,
              calls: list[list[int]]) -> torch.Tensor:
    assert cu.dtype == torch.int32
    calls.append(cu.tolist())
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    return torch.cat(out)


def reference_varlen(newer: bool, calls: list[list[int]]) -> Callable[..., torch.Tensor]:
    """A CPU stand-in for varlen_attn: q, k, v [N, H, D], cumulative lengths; newer: the
    ``window_size``/``enable_gqa`` signature, else ``is_causal`` (and KV heads already repeated)."""
    if newer:
        def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                   cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
            assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
            if enable_gqa:
                key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
            assert key.shape[1] == query.shape[1], "grouped-query attention without enable_gqa"
            return _segments(query, key, value, cu_seq_q, True, calls)
        return kernel

    def older(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
              cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
              is_causal: bool = False) -> torch.Tensor:
        assert is_causal and key.shape[1] == query.shape[1]
        return _segments(query, key, value, cu_seq_q, True, calls)
    return older


@pytest.fixture(params=["newer", "older"])
def kernel_calls(request: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    calls: list[list[int]] = []
    monkeypatch.setattr(attention, "_kernel", lambda: reference_varlen(request.param == "newer", calls))
    return calls


def _varlen_copy(model: Any) -> Any:
    attention.register()
    model.config._attn_implementation = attention.VARLEN
    return model


def test_a_flat_row_carries_its_samples_boundaries() -> None:
    samples = make_samples([(3, 2), (2, 0), (2, 3), (4, 1)], seed=0)
    x = pack(samples, PAD, CPU, flat=True).inputs
    assert isinstance(x, Flat)
    assert x.cu_seq_lens.tolist() == [0, 4, 6, 10, 14] and x.max_length == 4
    assert x.cu_seq_lens.dtype == torch.int32
    # A sample with no tokens in the row (no prompt, one response token) is no run of it.
    empty = make_samples([(2, 2), (0, 1), (1, 2)], seed=0)
    y = pack(empty, PAD, CPU, flat=True).inputs
    assert isinstance(y, Flat) and y.cu_seq_lens.tolist() == [0, 3, 5]


def test_varlen_log_probs_and_gradients_equal_the_masked_ones(kernel_calls: list[list[int]]) -> None:
    """GQA model (4 query heads, 2 KV heads): every layer's attention runs the kernel on the row's
    boundaries, and log-probs and gradients equal the sdpa block-diagonal mask's."""
    samples = make_samples(SHAPES * 2, seed=1, prompts=3)
    b = pack(samples, PAD, CPU, flat=True)
    assert isinstance(b.inputs, Flat)

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logp, _, _ = response_logprobs(model, b)
        (logp * b.mask).sum().backward()
        return (logp * b.mask).detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref_lp, ref_g = run(_model("qwen2"))
    model = _varlen_copy(_model("qwen2"))
    lp, g = run(model)
    assert kernel_calls == [b.inputs.cu_seq_lens.tolist()] * model.config.num_hidden_layers
    _close(lp, ref_lp, 32)
    for a, r in zip(g, ref_g, strict=True):
        _close(a, r, 512)


def test_padded_and_cached_calls_stay_sdpa(kernel_calls: list[list[int]]) -> None:
    """A VARLEN model given padded rows (a mask) or a prompt cache (Shared) never calls the kernel and
    gives sdpa's numbers."""
    samples = make_samples(SHAPES, seed=2, prompts=2)
    for share in (False, True):
        b = pack(samples, PAD, CPU, share_prompts=share)
        want, _, _ = response_logprobs(_model("qwen2"), b)
        got, _, _ = response_logprobs(_varlen_copy(_model("qwen2")), b)
        assert torch.equal(got * b.mask, want * b.mask)
    assert kernel_calls == []


def test_only_bf16_or_fp16_on_cuda_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_kernel", lambda: reference_varlen(True, []))
    model: Any = _model("qwen2")
    assert not attention.prefer_varlen(model, CPU, torch.bfloat16)
    assert not attention.prefer_varlen(model, torch.device("cuda"), torch.float32)
    assert model.config._attn_implementation == "sdpa"
    assert attention.prefer_varlen(model, torch.device("cuda"), torch.bfloat16)
    assert model.config._attn_implementation == attention.VARLEN
    monkeypatch.setattr(attention, "_kernel", lambda: None)  # a torch without varlen_attn
    assert not attention.prefer_varlen(_model("qwen2"), torch.device("cuda"), torch.bfloat16)
