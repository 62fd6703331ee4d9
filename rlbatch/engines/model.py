"""Load the policy model and its tokenizer: a local HF directory, or a random-init tiny model.

Every rank builds the same random initialisation from ``cfg.seed``, so actor_train, actor_infer
and reference start identical without any transfer.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_tokenizer(model_cfg: Any) -> Any:
    if model_cfg.path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_cfg.path)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    from rlbatch.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def load_model(model_cfg: Any, tokenizer: Any, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """A transformers causal LM in ``dtype`` on the CPU (engines move it to their device).

    Random-init: the ``ModelSpec`` of ``model_cfg`` with the tokenizer's vocabulary, the same
    description the planner counts, initialised from ``seed``."""
    if model_cfg.path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype)
        for t in [*model.parameters(), *model.buffers()]:
            if not t.untyped_storage().resizable():  # memory-mapped from safetensors: own a copy,
                t.data = t.data.clone()               # so offload can free and re-grow it
        return model
    from rlbatch.models.spec import spec_from_model_config
    from rlbatch.models.tiny import build_tiny_model

    spec = spec_from_model_config(model_cfg, vocab=len(tokenizer))
    tiny_model: Any = build_tiny_model(spec, seed, tokenizer)
    return tiny_model.to(dtype)
