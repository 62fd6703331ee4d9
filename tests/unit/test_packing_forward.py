"""Flat (packed, unpadded) inputs and chunked log-probs: the same numbers as the padded ``Full``
and the shared-prompt ``Shared`` forwards on real transformers models, and no fp32 copy of the
logits kept for the backward."""

from __future__ import annotations

import pytest
import torch

from rlbatch import algos
from rlbatch.algos.core import chunked_logprobs
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.schema import AlgoConfig
from rlbatch.engines.batch import Flat, Full, Shared, pack, response_logprobs
from rlbatch.engines.model import value_model
from rlbatch.engines.training import chunk_loss, value_outputs
from rlbatch.models.spec import spec_from_config
from rlbatch.models.tiny import build_tiny_model
from tests.unit.test_batch import make_samples

PAD = 0
CPU = torch.device("cpu")
EPS = torch.finfo(torch.float32).eps
# Ragged: prompts of 1..6 tokens, responses of 0..6 (an empty one included).
SHAPES = [(3, 4), (5, 0), (1, 6), (6, 2), (2, 1), (4, 5), (3, 3)]


def _model(arch: str) -> torch.nn.Module:
    return build_tiny_model(spec_from_config({"arch": arch, "initializer_range": 0.1}), seed=3)


def _close(a: torch.Tensor, b: torch.Tensor, ulps: float) -> None:
    """Equal to float32 rounding: within ``ulps`` units of the largest magnitude's last place (the
    two forwards run the same ops on differently shaped matmuls, a reordered sum per element)."""
    a, b = a.detach(), b.detach()
    tol = ulps * EPS * max(float(b.abs().max()), 1.0)
    assert float((a - b).abs().max()) <= tol, (float((a - b).abs().max()), tol)


def test_a_flat_row_restarts_positions_and_scores_each_response_token() -> None:
    samples = make_samples([(3, 2), (2, 0), (2, 3), (4, 1)], seed=0)
    b = pack(samples, PAD, CPU, flat=True)
    x = b.inputs
    assert isinstance(x, Flat)
    # per sample: prompt + response but its last token (4, 2, 4, 4 tokens)
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3]]
    s0, s2 = samples[0], samples[2]
    assert x.input_ids[0, :4].tolist() == s0["prompt"].tolist() + s0["response"][:1].tolist()
    assert x.input_ids[0, 6:10].tolist() == s2["prompt"].tolist() + s2["response"][:2].tolist()
    assert x.keep.tolist() == [2, 3, 7, 8, 9, 13]
    R = b.targets.shape[1]
    assert x.where.tolist() == [0, 1, 2 * R, 2 * R + 1, 2 * R + 2, 3 * R]


def test_one_model_call_per_micro_batch_even_with_nothing_to_score() -> None:
    """Every dp rank of a sharded model must make the same calls (each gathers parameters): a flat
    micro-batch is one call whatever its lengths, and one whose responses are all empty still makes
    it, with a graph for the backward."""
    model = _model("qwen2")
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    for shapes in (SHAPES, [(3, 0), (2, 0)]):
        calls.clear()
        b = pack(make_samples(shapes, seed=5), PAD, CPU, flat=True)
        logp, _, _ = response_logprobs(model, b)
        assert len(calls) == 1 and logp.shape == b.mask.shape and logp.requires_grad
        logp.sum().backward()


def _lp_and_grads(model: torch.nn.Module, samples: list, **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    b = pack(samples, PAD, CPU, **kw)  # type: ignore[arg-type]
    logp, _, _ = response_logprobs(model, b)
    assert b.advantages is not None
    algos.masked_mean(logp * b.advantages[:, None], b.mask).backward()
    return (logp * b.mask).detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_moe"])
def test_flat_logprobs_and_gradients_equal_the_padded_ones(arch: str) -> None:
    """Against Full and, with prompts repeating, Shared."""
    model = _model(arch)
    samples = make_samples(SHAPES * 2, seed=1, prompts=3)
    ref_lp, ref_g = _lp_and_grads(model, samples)
    shared_lp, shared_g = _lp_and_grads(model, samples, share_prompts=True)
    assert isinstance(pack(samples, PAD, CPU, share_prompts=True).inputs, Shared)
    lp, g = _lp_and_grads(model, samples, flat=True)
    _close(lp, ref_lp, 32)
    _close(lp, shared_lp, 32)
    assert len(g) == len(ref_g) == len(shared_g)
    for a, r, s in zip(g, ref_g, shared_g, strict=True):
        _close(a, r, 512)
        _close(a, s, 512)


def test_chunked_logprobs_and_entropy_equal_the_full_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(37, 301, generator=g)).requires_grad_()
    targets = torch.randint(0, 301, (37,), generator=g)
    wl, we = torch.randn(37, generator=g), torch.randn(37, generator=g)
    logp, ent = chunked_logprobs(logits, targets, entropy=True, chunk_bytes=4 * 301 * 5)  # 5 rows a chunk
    assert ent is not None
    (gc,) = torch.autograd.grad((wl * logp).sum() + (we * ent).sum(), logits)
    ref_lp, ref_ent = algos.token_logprobs(logits, targets), algos.entropy_from_logits(logits)
    (gr,) = torch.autograd.grad((wl * ref_lp).sum() + (we * ref_ent).sum(), logits)
    # Each value is a reduction over a row of V = 301 logits (logsumexp, the entropy's sum of p·x),
    # which the two paths run in different shapes: any order of summing n terms lies within
    # (n - 1)·eps·Σ|terms| of the exact sum, and the vector units of one processor or another
    # (AVX2, AVX-512) pick different orders. A chunk boundary in the wrong place moves values by O(1).
    _close(logp, ref_lp, logits.shape[-1])
    _close(ent, ref_ent, logits.shape[-1])
    _close(gc, gr, logits.shape[-1])
    lp_only, none = chunked_logprobs(logits, targets)
    assert none is None and torch.equal(lp_only, logp)


def test_policy_loss_with_an_entropy_bonus_is_the_same_flat() -> None:
    """chunk_loss: the objective reads the chunked entropy (with its gradient) instead of logits."""
    model = _model("qwen2")
    samples = make_samples(SHAPES, seed=2)
    objective = PolicyObjective(AlgoConfig(entropy_coef=0.1, kl_coef=0.0))
    out = []
    for kw in ({}, {"flat": True}):
        model.zero_grad()
        loss, stats = chunk_loss(model, pack(samples, PAD, CPU, **kw), objective)  # type: ignore[arg-type]
        loss.backward()
        out.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (l0, s0, g0), (l1, s1, g1) = out
    _close(l1, l0, 32)
    assert s0.keys() == s1.keys() and "entropy" in s1
    assert abs(s1["entropy"] - s0["entropy"]) <= 32 * EPS * max(abs(s0["entropy"]), 1.0)
    for a, r in zip(g1, g0, strict=True):
        _close(a, r, 512)


def test_value_head_outputs_are_the_same_flat() -> None:
    critic = value_model(_model("qwen2"))
    with torch.no_grad():  # a zero head (its start) would make any two paths agree
        critic.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    samples = make_samples(SHAPES, seed=3)
    full, flat = (pack(samples, PAD, CPU, flat=f) for f in (False, True))
    assert isinstance(full.inputs, Full) and isinstance(flat.inputs, Flat)
    _close(value_outputs(critic, flat) * flat.mask, (value_outputs(critic, full) * full.mask).detach(), 32)


class _Saved:
    """Every tensor the autograd graph keeps for the backward, counted once per storage."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def __enter__(self) -> _Saved:
        def pack_hook(t: torch.Tensor) -> torch.Tensor:
            self.tensors[t.untyped_storage().data_ptr()] = t
            return t
        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    def bytes(self, params: set[int]) -> int:
        """Bytes of the kept tensors that are not parameters (which the model holds anyway)."""
        return sum(t.untyped_storage().nbytes() for p, t in self.tensors.items() if p not in params)


def test_flat_keeps_no_fp32_logits_for_the_backward() -> None:
    """bf16 model, 32k vocabulary, entropy bonus on: the padded path keeps fp32 [tokens, vocab]
    tensors for the backward (logsumexp's input, the softmax); the flat one keeps the bf16 logits
    of the scored positions and nothing else of vocabulary size."""
    V = 32768
    spec = spec_from_config({"arch": "qwen2", "initializer_range": 0.1}, vocab=V)
    model = build_tiny_model(spec, seed=0).to(torch.bfloat16)
    samples = make_samples([(8, 24)] * 4 + [(4, 12)] * 4, seed=4)
    K = 4 * 24 + 4 * 12  # scored tokens
    objective = PolicyObjective(AlgoConfig(entropy_coef=0.1, kl_coef=0.0))
    saved = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for name, kw in (("full", {}), ("flat", {"flat": True})):
        b = pack(samples, PAD, CPU, **kw)  # type: ignore[arg-type]
        with _Saved() as s:
            loss, _ = chunk_loss(model, b, objective)
        vocab_sized = [t for t in s.tensors.values() if t.numel() >= K * V]
        saved[name] = (s.bytes(params), vocab_sized)
        loss.backward()
    full_bytes, full_big = saved["full"]
    flat_bytes, flat_big = saved["flat"]
    assert any(t.dtype == torch.float32 for t in full_big)
    assert [t.dtype for t in flat_big] == [torch.bfloat16]
    # vocabulary-sized: one bf16 [K, V]; the rest is the decoder's activations, far under K * V * 2
    assert flat_bytes < K * V * 2 * 1.5, (flat_bytes, K * V * 2)
    assert full_bytes - flat_bytes >= K * V * 4, (full_bytes, flat_bytes)


def test_reward_scores_are_the_same_flat_and_the_row_is_one_call() -> None:
    """A reward model under a token budget: whole sequences in one row per chunk, the score layer
    read at each sample's last token; the same scores as padded rows to float32 rounding."""
    from rlbatch.engines.batch import flat_sequences
    from rlbatch.engines.model import reward_model
    from rlbatch.engines.training import Split, scores

    rm = reward_model(_model("qwen2"), seed=5)
    rm.config.pad_token_id = PAD
    samples = make_samples(SHAPES, seed=4)
    samples[2]["response"][-2:] = PAD  # ends with EOS = pad: pooling reads the token before them
    x = flat_sequences(samples, PAD, CPU)
    n = [len(s["prompt"]) + len(s["response"]) for s in samples]
    read = [k - 1 - (2 if i == 2 else 0) for i, k in enumerate(n)]  # the last non-pad position
    assert x.input_ids.shape == (1, sum(n)) and x.position_ids[0, x.keep].tolist() == read
    assert x.keep.tolist() == [sum(n[:i]) + r for i, r in enumerate(read)]
    want = torch.tensor(scores(rm, samples, Split(samples=0), lambda c: pack(c, PAD, CPU)))
    calls = []
    handle = rm.register_forward_pre_hook(lambda *_: calls.append(1))
    for budget in (1, 12, 10_000):  # one sample per row, a few per row, all in one
        calls.clear()
        got = torch.tensor(scores(rm, samples, Split(max_tokens=budget, device=CPU), lambda c: pack(c, PAD, CPU),
                                  rm.score))
        _close(got, want, 32)
        want_calls = {1: len(samples), 10_000: 1}.get(budget)
        assert len(calls) == want_calls if want_calls else 1 < len(calls) < len(samples), (budget, len(calls))
    handle.remove()
    assert float(want.std()) > 0.01  # distinct scores: a wrong position would show
