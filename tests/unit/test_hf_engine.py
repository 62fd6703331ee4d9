"""The hf inference engine: a shared prompt cache (each distinct prompt run once) samples exactly
the tokens that a full prefill samples, with the same seed."""

from __future__ import annotations

import torch

from rlbatch.engines.base import SamplingParams
from rlbatch.engines.batch import left_padded
from rlbatch.engines.infer.hf import HFInferenceEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.launch.compose import compose


def test_shared_prompt_cache_samples_the_same_tokens() -> None:
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    # 6 distinct prompts of 5 and 6 tokens (left padding), 16 samples each, interleaved
    prompts = [tok.encode(f"{k}+{'1' * (k % 2)}{k}=") for k in range(6)] * 16
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=5)
    out = {}
    for share in (True, False):
        engine = HFInferenceEngine(model_cfg=cfg.model, tokenizer=tok, device=torch.device("cpu"), seed=1,
                                   engine_args={"share_prompts": share})
        assert (engine._shared_prompt_cache([prompts[0]] * 2, *left_padded([prompts[0]] * 2, tok.pad_token_id)) is None) != share
        out[share] = engine.generate(prompts, sp)
    assert out[True] == out[False]
    assert len({tuple(r) for r in out[True]}) > 20  # sampled, not one answer repeated

