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


def _with_head(lm: Any, auto_class: Any, **config: Any) -> Any:
    """``lm``'s architecture under another transformers head class (one label, no output embedding to
    tie), built without touching the caller's RNG, its body the LM's weights. The head's parameters
    (``score.*``) are the only ones left to set."""
    import copy

    cfg = copy.deepcopy(lm.config)
    cfg.num_labels, cfg.tie_word_embeddings = 1, False
    for key, value in config.items():
        setattr(cfg, key, value)
    with torch.random.fork_rng(devices=[]):
        model = auto_class.from_config(cfg, dtype=next(lm.parameters()).dtype)
    missing, unexpected = model.load_state_dict(lm.state_dict(), strict=False)
    head = {name for name, _ in model.named_parameters() if name.startswith("score.")}
    if set(missing) != head or set(unexpected) - {"lm_head.weight"}:
        raise ValueError(f"{auto_class.__name__} from {type(lm).__name__}: weights did not map (missing {missing}, "
                         f"unexpected {unexpected})")
    return model


def value_model(lm: Any) -> Any:
    """A critic from a causal LM: the same architecture with a scalar head per token
    (transformers' ``...ForTokenClassification`` with one label, no dropout), its body the LM's
    weights and its head zero, so every value starts at 0 and the first advantages are the
    rewards' own. Parameter names stay Hugging Face's (``model.*``, ``score.weight``, ``score.bias``):
    ``save_pretrained`` output loads with ``AutoModelForTokenClassification``."""
    from transformers import AutoModelForTokenClassification

    model = _with_head(lm, AutoModelForTokenClassification, classifier_dropout=0.0)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.zero_()
    return model


def reward_model(lm: Any, seed: int) -> Any:
    """A sequence-classification model (one score per sequence, read at its last non-pad token)
    from a causal LM: its body the LM's weights, its head drawn from ``seed`` (std 1/sqrt(hidden)).
    A stand-in that knows nothing about the task, for runs without a trained reward model."""
    from transformers import AutoModelForSequenceClassification

    model = _with_head(lm, AutoModelForSequenceClassification)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.score.weight
        w.copy_(torch.randn(w.shape, generator=g) / model.config.hidden_size ** 0.5)
    return model


def load_engine_model(ctx: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The model of an engine's role by its head: the policy (a causal LM, 'lm'), the value model
    built from it ('value': the critic), or a reward model ('reward': the directory's
    sequence-classification model when ``ctx.model.path`` names one, else one built from the policy)."""
    if ctx.head == "reward" and ctx.model.path and _architecture_is(ctx.model.path, "ForSequenceClassification"):
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(ctx.model.path, num_labels=1, dtype=dtype)
        if model.config.pad_token_id is None:  # the score is read at the last non-pad token
            model.config.pad_token_id = ctx.tokenizer.pad_token_id
        return model
    if ctx.head == "value" and ctx.model.path and _architecture_is(ctx.model.path, "ForTokenClassification"):
        from transformers import AutoModelForTokenClassification

        critic = AutoModelForTokenClassification.from_pretrained(ctx.model.path, dtype=dtype)
        _check_vocab(critic, ctx.tokenizer, ctx.model.path)
        return critic
    lm = load_model(ctx.model, ctx.tokenizer, ctx.seed, dtype)
    if ctx.head == "value":
        if ctx.model.path:
            _check_vocab(lm, ctx.tokenizer, ctx.model.path)
        return value_model(lm)
    return reward_model(lm, ctx.seed) if ctx.head == "reward" else lm


def _architecture_is(path: str, suffix: str) -> bool:
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    return any(a.endswith(suffix) for a in config.get("architectures") or [])


def _check_vocab(model: Any, tokenizer: Any, path: str) -> None:
    """A critic reads the policy's token ids: its embedding must have a row for each."""
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ValueError(f"critic_model.path: {path} embeds {rows} tokens, but the policy's tokenizer has "
                         f"{len(tokenizer)}: the critic must read the policy's token ids (the same tokenizer)")
