"""pack/unpack and response_logits: the batch a forward pass sees, checked against a per-sample
loop, and the shared-prompt forward checked against the full one on a real transformers model."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch import algos
from rlbatch.engines.batch import (
    Full,
    Shared,
    distinct_prompts,
    left_padded,
    pack,
    prompt_positions,
    response_logits,
    unpack,
)
from rlbatch.models.spec import spec_from_config
from rlbatch.models.tiny import build_tiny_model

PAD = 0
CPU = torch.device("cpu")


def make_samples(shapes: list[tuple[int, int]], seed: int, prompts: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Samples of the given (prompt, response) lengths; with ``prompts``, sample k reuses prompt k % prompts."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(1, 18, (p,), generator=g) for p, _ in shapes]
    return [{"prompt": pool[k % prompts] if prompts else pool[k], "response": torch.randint(1, 18, (r,), generator=g),
             "old_logprobs": -torch.rand(r, generator=g), "advantage": torch.tensor(float(k))}
            for k, (_, r) in enumerate(shapes)]


def reference_full(samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    L = max(len(s["prompt"]) + len(s["response"]) for s in samples)
    R = max(len(s["response"]) for s in samples)
    ids = torch.full((len(samples), L), PAD, dtype=torch.long)
    attn = torch.zeros_like(ids)
    targets = torch.full((len(samples), R), PAD, dtype=torch.long)
    mask, old = torch.zeros((len(samples), R)), torch.zeros((len(samples), R))
    for b, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        ids[b, :p], ids[b, p : p + r] = s["prompt"], s["response"]
        attn[b, : p + r] = 1
        targets[b, :r], mask[b, :r], old[b, :r] = s["response"], 1, s["old_logprobs"]
    return ids, attn, targets, mask, old


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=12), st.integers(0, 10**6))
def test_pack_matches_a_per_sample_loop(shapes: list[tuple[int, int]], seed: int) -> None:
    samples = make_samples(shapes, seed)
    b = pack(samples, PAD, CPU)
    ids, attn, targets, mask, old = reference_full(samples)
    assert isinstance(b.inputs, Full)
    assert torch.equal(b.inputs.input_ids, ids) and torch.equal(b.inputs.attention_mask, attn)
    assert torch.equal(b.targets, targets) and torch.equal(b.mask, mask) and torch.equal(b.fields["old_logprobs"], old)
    for k, s in enumerate(samples):  # the logits at index[k, j] score response token j
        for j in range(len(s["response"])):
            assert ids[k, int(b.inputs.index[k, j]) + 1] == s["response"][j]
    assert "ref_logprobs" not in b.fields
    assert b.advantages is not None and b.advantages.tolist() == [float(k) for k in range(len(samples))]
    back = unpack(b.fields["old_logprobs"], b.lengths)
    assert all(torch.equal(x, s["old_logprobs"]) for x, s in zip(back, samples, strict=True))


def test_a_field_only_some_samples_have_is_left_out() -> None:
    a = {"prompt": torch.tensor([1, 2]), "response": torch.tensor([3]), "old_logprobs": torch.tensor([-0.5])}
    b = {"prompt": torch.tensor([1]), "response": torch.tensor([3, 4])}
    packed = pack([a, b], PAD, CPU)
    assert packed.fields == {} and packed.advantages is None
    assert packed.lengths == [1, 2]


def test_distinct_prompts_maps_every_sample_to_its_prompt() -> None:
    p = [torch.tensor(t) for t in ([1, 2], [3], [1, 2], [1, 2, 3], [3])]
    firsts, group = distinct_prompts(p)
    assert firsts == [0, 1, 3] and group.tolist() == [0, 1, 0, 2, 1]


def test_shared_inputs_hold_each_prompt_once_left_padded() -> None:
    samples = make_samples([(2, 3), (4, 1), (2, 2), (4, 0)], seed=0, prompts=2)
    b = pack(samples, PAD, CPU, share_prompts=True)
    x = b.inputs
    assert isinstance(x, Shared)
    assert x.group.tolist() == [0, 1, 0, 1]
    assert x.prefix_ids[0, :2].tolist() == [PAD, PAD] and x.prefix_ids[0, 2:].tolist() == samples[0]["prompt"].tolist()
    assert x.prefix_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    pos = prompt_positions(x.prefix_mask)
    assert pos[0, 2:].tolist() == [0, 1] and pos[1].tolist() == [0, 1, 2, 3]
    # responses but their last token, placed after each sample's own prompt
    assert x.suffix_ids[0].tolist() == samples[0]["response"][:2].tolist()
    assert x.suffix_mask.tolist() == [[1, 1], [0, 0], [1, 0], [0, 0]]
    assert x.suffix_pos.tolist() == [[2, 3], [4, 5], [2, 3], [4, 5]]


def test_distinct_prompts_are_packed_in_full_even_when_sharing_is_on() -> None:
    assert isinstance(pack(make_samples([(3, 2)] * 4, seed=1), PAD, CPU, share_prompts=True).inputs, Full)


def _logprobs_and_grads(model: torch.nn.Module, samples: list[dict[str, torch.Tensor]], share: bool
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model.zero_grad()
    b = pack(samples, PAD, CPU, share_prompts=share)
    assert isinstance(b.inputs, Shared if share else Full)
    logp = algos.token_logprobs(response_logits(model, b).float(), b.targets)
    assert b.advantages is not None
    algos.masked_mean(logp * b.advantages[:, None], b.mask).backward()
    return unpack(logp, b.lengths), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), min_size=6, max_size=16),
       st.integers(1, 3), st.integers(0, 10**6), st.sampled_from(["qwen2", "llama"]))
def test_shared_prompt_forward_equals_the_full_one(shapes: list[tuple[int, int]], prompts: int, seed: int,
                                                    arch: str) -> None:
    """Same log-probs and gradients, prompts of different lengths (left padding) and responses of
    different lengths (none at all included), for both tiny architectures."""
    model = build_tiny_model(spec_from_config({"arch": arch, "initializer_range": 0.1}), seed % 7)
    samples = make_samples(shapes, seed, prompts=prompts)
    full_lp, full_g = _logprobs_and_grads(model, samples, share=False)
    shared_lp, shared_g = _logprobs_and_grads(model, samples, share=True)
    for a, b in zip(full_lp, shared_lp, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
    assert len(full_g) == len(shared_g)
    for a, b in zip(full_g, shared_g, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_left_padded_prompts_end_in_the_last_column() -> None:
    ids, attn = left_padded([[5, 6, 7], [8], [9, 4]], PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, 9, 4]]
    assert attn.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_empty_and_one_token_responses_in_a_shared_batch() -> None:
    model = build_tiny_model(spec_from_config({}), seed=1)
    for r in (0, 1):
        samples = make_samples([(3, r)] * 4, seed=2, prompts=1)
        b = pack(samples, PAD, CPU, share_prompts=True)
        assert isinstance(b.inputs, Shared)
        assert response_logits(model, b).shape[:2] == (4, r)
