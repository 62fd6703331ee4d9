"""Checks shared by the inference engines' tests (hf, vllm, sglang)."""

from __future__ import annotations

from typing import Any

import torch

from rlbatch import algos
from rlbatch.engines.base import SamplingParams
from rlbatch.engines.batch import pack, response_logits
from rlbatch.engines.model import load_model


def assert_behaviour_logprobs_match_transformers(engine: Any, cfg: Any, tok: Any, seed: int, prompts: list[list[int]],
                                                 temperature: float) -> None:
    """``engine``'s sampled tokens and behaviour log-probs: each token's log-prob equals a transformers
    forward's of the engine's start-up weights (``seed``) at ``temperature``. Tolerance: fp32 forwards of
    a 2-layer model by two implementations are ~1e-6 apart; a wrong temperature or an off-by-one
    position is ~1e-1."""
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature, seed=3))
    assert len(gens) == len(prompts)
    assert all(len(g.logprobs) == len(g.tokens) and 0 < len(g.tokens) <= 6 for g in gens)
    model = load_model(cfg.model, tok, seed).eval()
    samples = [{"prompt": torch.tensor(p), "response": torch.tensor(g.tokens)} for p, g in zip(prompts, gens, strict=True)]
    b = pack(samples, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        expected = algos.token_logprobs(response_logits(model, b).float() / temperature, b.targets)
    got = torch.zeros_like(expected)
    for i, g in enumerate(gens):
        got[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
    assert torch.allclose(got * b.mask, expected * b.mask, atol=1e-4), (got - expected).abs().max()
