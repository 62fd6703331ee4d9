"""What the in-flight tests of both in-process engines check (tests/unit/test_vllm_in_flight.py,
tests/unit/test_sglang_in_flight.py): a sync landing mid-generation splits a sample's tokens by
version; the tokens before the load are the old weights'; after it, with the KV cache kept they are
not a new-weights forward's, recomputed they are; and the next generation has the new weights
throughout (no cached KV of the old ones reused)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlbatch import algos
from rlbatch.engines.base import Generation, SamplingParams
from rlbatch.engines.batch import pack, response_logits
from rlbatch.engines.model import load_model

Landing = Callable[[Any, list[list[int]], list[tuple[str, torch.Tensor]]], list[Generation]]
"""(engine, prompts, the new weights) -> the generations at version 3 with version 4 landing mid-way."""


def forward_logprobs(model: torch.nn.Module, tok: Any, prompts: list[list[int]], gens: list[Generation]) -> torch.Tensor:
    """The model's log-prob of each generated token, from a full forward of prompt + response."""
    samples = [{"prompt": torch.tensor(p), "response": torch.tensor(g.tokens)} for p, g in zip(prompts, gens, strict=True)]
    b = pack(samples, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        return algos.token_logprobs(response_logits(model, b).float(), b.targets)


def version_gap(gens: list[Generation], want: torch.Tensor, version: int) -> float:
    """The largest |engine - forward| log-prob gap over the tokens of ``version``."""
    gap = 0.0
    for i, g in enumerate(gens):
        for j, (v, lp) in enumerate(zip(g.versions, g.logprobs, strict=True)):
            if v == version:
                gap = max(gap, abs(lp - float(want[i, j])))
    return gap


def check_landing(setup: Any, land: Landing, modes: Sequence[str], seed: int) -> None:
    """``setup``: cfg, tok, engine, old (the version-3 model), new (version 4's weights). For each of
    ``modes`` (``in_flight_kv``), the engine back at version 3, a generation with version 4 landing
    mid-way (``land``); then a generation at version 4."""
    tok, engine, old, new = setup.tok, setup.engine, setup.old, setup.new
    prompts = [tok.encode(f"{k}+{k}=") for k in range(4)] * 2
    new_model = load_model(setup.cfg.model, tok, seed).eval()
    with torch.no_grad():
        for (name, p), (n2, t) in zip(new_model.named_parameters(), new, strict=True):
            assert name == n2
            p.copy_(t)
    gaps = {}
    for mode in modes:
        engine.load_weights(list(old.named_parameters()))  # back to version 3's weights, between generations
        engine.recompute_kv = mode == "recompute"
        gens = land(engine, prompts, new)
        for g in gens:
            assert len(g.versions) == len(g.tokens) and len(g.logprobs) == len(g.tokens)
            # the versions of a sample never go back: the tokens before the load, then those after
            assert g.versions == sorted(g.versions) and set(g.versions) <= {3, 4}
        mixed = [g for g in gens if set(g.versions) == {3, 4}]
        assert mixed, f"{mode}: no sample holds tokens of both versions ({[g.versions for g in gens]})"
        before = version_gap(gens, forward_logprobs(old, tok, prompts, gens), 3)
        after = version_gap(gens, forward_logprobs(new_model, tok, prompts, gens), 4)
        assert before < 1e-4, f"{mode}: tokens before the load are the old weights' (gap {before})"
        gaps[mode] = after
        print(f"{mode}: {len(mixed)} of {len(gens)} samples mixed, gaps before {before:.2e} after {after:.2e}",
              flush=True)
    # Kept: the new weights read the old weights' KV of the earlier positions, so their log-probs are
    # not a new-weights forward's. Recomputed: they are, to fp32 rounding.
    assert gaps["keep"] > 1e-2, gaps
    assert gaps["recompute"] < 1e-4, gaps
    # The engine's prefix cache held the old weights' KV while the requests ran; the next generation
    # (the same prompts) starts from a reset one, with the new weights throughout.
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=6, version=4))
    assert all(g.versions == [4] * len(g.tokens) for g in gens)
    assert version_gap(gens, forward_logprobs(new_model, tok, prompts, gens), 4) < 1e-4
