"""pack/unpack: the padded batch a forward pass sees, checked against a per-sample loop."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.engines.batch import pack, unpack

PAD = 0


def reference_pack(samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    L = max(len(s["prompt"]) + len(s["response"]) for s in samples)
    ids = torch.full((len(samples), L), PAD, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(samples), L - 1))
    old = torch.zeros((len(samples), L - 1))
    for b, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        ids[b, :p], ids[b, p : p + r] = s["prompt"], s["response"]
        attn[b, : p + r] = 1
        mask[b, p - 1 : p - 1 + r] = 1
        old[b, p - 1 : p - 1 + r] = s["old_logprobs"]
    return ids, attn, mask, old


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=12), st.integers(0, 10**6))
def test_pack_matches_a_per_sample_loop(shapes: list[tuple[int, int]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    samples = [{"prompt": torch.randint(1, 50, (p,), generator=g), "response": torch.randint(1, 50, (r,), generator=g),
                "old_logprobs": -torch.rand(r, generator=g), "advantage": torch.tensor(float(k))}
               for k, (p, r) in enumerate(shapes)]
    b = pack(samples, PAD, torch.device("cpu"))
    ids, attn, mask, old = reference_pack(samples)
    assert torch.equal(b.input_ids, ids) and torch.equal(b.attention_mask, attn)
    assert torch.equal(b.mask, mask) and torch.equal(b.fields["old_logprobs"], old)
    assert "ref_logprobs" not in b.fields
    assert b.advantages is not None and b.advantages.tolist() == [float(k) for k in range(len(samples))]
    back = unpack(b.fields["old_logprobs"], b.spans)
    assert all(torch.equal(x, s["old_logprobs"]) for x, s in zip(back, samples, strict=True))


def test_a_field_only_some_samples_have_is_left_out() -> None:
    a = {"prompt": torch.tensor([1, 2]), "response": torch.tensor([3]), "old_logprobs": torch.tensor([-0.5])}
    b = {"prompt": torch.tensor([1]), "response": torch.tensor([3, 4])}
    packed = pack([a, b], PAD, torch.device("cpu"))
    assert packed.fields == {} and packed.advantages is None
    assert packed.spans == [(1, 1), (0, 2)]
