"""The hf inference engine: a shared prompt cache (each distinct prompt run once) samples exactly
the tokens that a full prefill samples, with the same seed; each sampled token comes with its
log-prob under the distribution it was sampled from (the behaviour policy)."""

from __future__ import annotations

import pytest
import torch

from rlbatch import algos
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.batch import left_padded, pack, response_logits
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.model import load_tokenizer


def _engine(cfg, tok, **args) -> HFInferenceEngine:  # type: ignore[no-untyped-def]
    return HFInferenceEngine(EngineContext("actor_infer", HFArgs(**args), cfg.model, cfg.algo, tok,
                                           torch.device("cpu"), seed=1))


def test_shared_prompt_cache_samples_the_same_tokens() -> None:
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    # 6 distinct prompts of 5 and 6 tokens (left padding), 16 samples each, interleaved
    prompts = [tok.encode(f"{k}+{'1' * (k % 2)}{k}=") for k in range(6)] * 16
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=5)
    out = {}
    for share in (True, False):
        engine = _engine(cfg, tok, share_prompts=share)
        assert (engine._shared_prompt_cache([prompts[0]] * 2, *left_padded([prompts[0]] * 2, tok.pad_token_id)) is None) != share
        out[share] = engine.generate(prompts, sp)
    assert [g.tokens for g in out[True]] == [g.tokens for g in out[False]]
    assert len({tuple(g.tokens) for g in out[True]}) > 20  # sampled, not one answer repeated


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_those_of_the_sampling_distribution(temperature: float) -> None:
    """The recorded log-prob of each sampled token equals log_softmax(logits / temperature) of a
    separate forward pass over prompt + response (float32: agreement to ~1e-5)."""
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    engine = _engine(cfg, tok)
    prompts = [tok.encode(f"{k}+{k}=") for k in range(4)] * 4
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature, seed=3))
    assert all(len(g.logprobs) == len(g.tokens) for g in gens)
    assert any(len(g.tokens) > 1 for g in gens)
    samples = [{"prompt": torch.tensor(p), "response": torch.tensor(g.tokens)} for p, g in zip(prompts, gens, strict=True)
               if g.tokens]
    b = pack(samples, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        expected = algos.token_logprobs(response_logits(engine.model, b).float() / temperature, b.targets)
    got = torch.zeros_like(expected)
    for i, g in enumerate(g for g in gens if g.tokens):
        got[i, : len(g.logprobs)] = torch.tensor(g.logprobs)
    assert torch.allclose(got * b.mask, expected * b.mask, atol=1e-5)
    assert (got * b.mask).abs().sum() > 0


def test_greedy_generation_is_deterministic_with_logprobs() -> None:
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    engine = _engine(cfg, tok)
    prompts = [tok.encode("1+2="), tok.encode("3+4=")]
    a = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0, seed=1))
    b = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0, seed=2))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert all(lp <= 0.0 for g in a for lp in g.logprobs)


def test_a_sampled_pad_token_is_kept_without_stop_strings() -> None:
    """Trailing <pad> is only generate()'s filler after a stop string; without stop strings a
    sampled <pad> is a real token of the response (dropping it would score "7<pad>" as "7" and
    keep the token out of training). Uniform logits make <pad> likely enough to be sampled."""
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    engine = _engine(cfg, tok)
    with torch.no_grad():
        engine.model.get_output_embeddings().weight.zero_()
    prompts = [tok.encode(f"{k % 10}+1=") for k in range(200)]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=1.0, seed=4))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert any(g.tokens[-1] == pad for g in gens)
    for g in gens:
        assert len(g.tokens) == len(g.logprobs)
        assert len(g.tokens) == 2 or g.tokens[-1] == eos, g.tokens


def test_turns_on_the_hf_engine_batch_what_is_pending_in_one_generate_per_setting() -> None:
    """``turns_of`` an engine with only ``generate``: each poll generates every request submitted
    since the last, one call per sampling setting (seeded with its first request's seed), and
    returns each under its key; greedy turns equal ``generate``'s answers."""
    from rlbatch.engines.base import BatchedTurns, TurnRequest, turns_of

    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    engine = _engine(cfg, tok)
    calls: list[tuple[int, SamplingParams]] = []
    generate = engine.generate

    def counted(prompts: list[list[int]], params: SamplingParams) -> list:  # type: ignore[type-arg]
        calls.append((len(prompts), params))
        return generate(prompts, params)

    engine.generate = counted  # type: ignore[method-assign]
    turns = turns_of(engine)
    assert isinstance(turns, BatchedTurns)
    greedy, sampled = SamplingParams(max_new_tokens=3, temperature=0.0), SamplingParams(max_new_tokens=3, seed=99)
    contexts = [tok.encode(f"{k}+{k}=") for k in range(3)]
    turns.submit([TurnRequest(10 + k, c, seed=5 + k) for k, c in enumerate(contexts)], greedy)
    turns.submit([TurnRequest(20, contexts[0], seed=42)], sampled)
    assert turns.in_flight() == 4
    got = dict(turns.poll())
    assert sorted(got) == [10, 11, 12, 20] and turns.in_flight() == 0 and turns.poll() == []
    assert [(n, p.temperature, p.seed) for n, p in calls] == [(3, 0.0, 5), (1, 1.0, 42)]
    want = generate(contexts, greedy)
    assert [got[10 + k].tokens for k in range(3)] == [g.tokens for g in want]
