"""Random-initialised causal LMs built from a ``ModelSpec``: no weights are downloaded.

The model is an ordinary ``transformers`` Qwen2, Llama or Qwen2-MoE, so everything that works on a
real checkpoint (``generate``, ``save_pretrained``, state-dict weight sync) works here too.
The spec usually comes from the run's config (``rlbatch.models.spec.spec_from_config``), the
same spec the planner counts.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from rlbatch.models.spec import ModelSpec, hf_config_kwargs

AttnImpl = Literal["eager", "sdpa"]


def _token_ids(tokenizer: Any) -> dict[str, int]:
    if tokenizer is None:  # the built-in character tokenizer: its ids without building it
        from rlbatch.data.tokenizer import BOS, EOS, PAD, char_vocab

        vocab = char_vocab()
        return {"pad_token_id": vocab[PAD], "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS]}
    return {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}


def tiny_skeleton(spec: ModelSpec, tokenizer: Any = None, attn_implementation: AttnImpl = "sdpa") -> PreTrainedModel:
    """The ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen2MoeForCausalLM`` of ``spec`` with its
    parameters on the meta device (fp32) and its buffers real: what ``build_tiny_model`` fills
    whole and a sharded engine fills shard by shard (``rlbatch.models.weights``)."""
    from rlbatch.models.weights import params_on_meta

    kwargs = hf_config_kwargs(spec)  # refuses what these classes do not build, naming why
    ids = _token_ids(tokenizer)
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen2_moe": Qwen2MoeConfig}[spec.arch]
    model_cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}[spec.arch]
    hf_cfg = config_cls(**kwargs, **ids)
    hf_cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]), params_on_meta():
        model = model_cls(hf_cfg)
    model.generation_config = GenerationConfig(**ids)
    return model


def build_tiny_model(spec: ModelSpec, seed: int = 0, tokenizer: Any = None,
                     attn_implementation: AttnImpl = "sdpa") -> PreTrainedModel:
    """Build a random-initialised ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen2MoeForCausalLM``
    of ``spec`` in float32.

    The weights are ``rlbatch.models.weights.random_init(model, seed)``: drawn as transformers
    draws them (normal with std ``spec.initializer_range``, norms one, biases zero), from generators
    seeded by ``seed`` and each tensor's name, so the same spec gives the same weights whatever
    the caller's global RNG state (which building leaves alone), and a sharded engine that draws
    only its own rows holds exactly these. Pad/bos/eos ids come from ``tokenizer`` (anything with
    ``pad_token_id``, ``bos_token_id`` and ``eos_token_id``; the built-in character tokenizer's when
    None); the pad row of the embedding starts at zero, and the generation config carries the ids
    so ``generate`` stops at EOS without further arguments. Under ``torch.device("meta")`` the
    model is returned unfilled (shapes only).
    """
    from rlbatch.models.weights import allocate, materialise, on_meta_by_default, random_init

    model = tiny_skeleton(spec, tokenizer, attn_implementation)
    if on_meta_by_default():
        return model
    allocate(model, torch.device("cpu"))
    materialise(model, random_init(model, seed))
    return model
