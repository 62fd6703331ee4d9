"""Checks shared by the inference engines' tests (hf, vllm, sglang)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
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


def sync_in_buckets(engine: Any, named: list[tuple[str, torch.Tensor]], bucket_elements: int = 8192) -> None:
    """The receiving rank's side of ``rlbatch.loop.weightsync``: ``named`` in buckets of
    ``bucket_elements`` (8192: q/k/v and weight/bias of one layer fall in different ones), each
    broadcast into one reused staging buffer and loaded as views into it."""
    from rlbatch.loop.weightsync import buckets

    spans = buckets([t.numel() for _, t in named], bucket_elements)
    assert len(spans) > 10, "a sync of one or a few buckets would not test the staging buffer's reuse"
    staging = torch.empty(max(sum(t.numel() for _, t in named[i:j]) for i, j in spans))
    for i, j in spans:
        pos, chunk = 0, []
        for name, t in named[i:j]:
            view = staging[pos : pos + t.numel()].view(t.shape)
            view.copy_(t)  # the broadcast
            chunk.append((name, view))
            pos += t.numel()
        engine.load_weights(chunk)


def run_in_a_process_of_its_own(script: str, passed: str) -> None:
    """Run the test file ``script`` as a program (its ``main``) in a fresh interpreter and check it
    printed ``passed``: vLLM's one-rank world stays until process exit (``VLLMEngine.close``), so a
    second engine cannot start in a process that built one."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=840, env=env, cwd=root)
    assert out.returncode == 0 and passed in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
