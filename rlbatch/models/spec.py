"""One description of a decoder-only transformer, shared by the model builder, the engines and
the planner (no torch, no transformers).

A ``ModelSpec`` comes from the run's ``model`` config: from ``model.path``'s Hugging Face
``config.json`` (read as JSON) when a path is set, else from the random-init fields of
``ModelConfig`` with the vocabulary of the built-in character tokenizer. ``rlbatch.models.tiny``
builds the transformers model from a spec, and ``rlbatch.models.shape.ModelShape`` counts its
parameters, FLOPs and KV cache from the same spec, so the model that runs and the model that is
planned for cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbatch.config.bounds import field_problems
from rlbatch.config.schema import ModelConfig
from rlbatch.errors import ConfigError

BUILDABLE_ARCHS = ("qwen2", "llama", "qwen2_moe")
"""Architectures ``rlbatch.models.tiny`` builds from a spec (random-init models)."""

_GATED_ACTS = ("silu", "swiglu", "swish")


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen2/Llama-style decoder (RMSNorm, rotary, GQA, SwiGLU) or its Mixture-of-Experts
    variant. Dense when ``experts == 0``.

    The fields after ``vocab`` default to what a Hugging Face Llama ``config.json`` means when it
    leaves them out.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """Intermediate size of the (dense) MLP."""
    vocab: int
    tied: bool = False
    """The lm head is the input embedding."""
    qkv_bias: bool = False
    """q, k and v projections have a bias (always for Qwen2)."""
    o_bias: bool = False
    """The output projection has a bias too (Llama-family ``attention_bias``; never for Qwen2)."""
    gated: bool = True
    """SwiGLU-style MLP (gate, up, down) rather than two matrices."""
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    """Intermediate size of one routed expert."""
    shared_ffn: int = 0
    """Intermediate size of the shared expert(s), 0 when none."""
    arch: str = "llama"
    """Hugging Face ``model_type``: which transformers class runs the model."""
    max_positions: int = 2048
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    initializer_range: float = 0.02
    """Std of the initial weights of a random-initialised model."""
    name: str = field(default="model", compare=False)
    """For reports: the model directory's name, or ``<arch>-h<hidden>-l<layers>``."""


def char_vocab_size() -> int:
    """Size of the built-in character tokenizer's vocabulary: the vocab of random-init models."""
    from rlbatch.data.tokenizer import char_vocab  # torch- and transformers-free

    return len(char_vocab())


def _fields(model: Any) -> dict[str, Any]:
    """A model config (``ModelConfig``, an OmegaConf node, a plain mapping) as a dict."""
    return dict(model.items()) if isinstance(model, Mapping) else dict(vars(model))


def spec_from_model_config(model: Any, vocab: int | None = None) -> ModelSpec:
    """The random-init model of a ``ModelConfig`` (or a mapping of some of its fields: the others,
    and those that are None, take ``ModelConfig``'s defaults). ``vocab`` is the tokenizer's size,
    the built-in character tokenizer's when None."""
    given = {k: v for k, v in _fields(model).items() if v is not None}
    m = {**vars(ModelConfig()), **given}
    if problems := field_problems(m, ModelConfig, "model"):  # a size < 1 would build a broken model, or none
        raise ConfigError(problems)
    arch, h, heads, kv = str(m["arch"]), int(m["hidden_size"]), int(m["num_heads"]), int(m["num_kv_heads"])
    if arch not in BUILDABLE_ARCHS:
        problems.append(f"model.arch: {arch!r} cannot be random-initialised; expected one of {BUILDABLE_ARCHS}")
    if h % heads:
        problems.append(f"model.hidden_size {h} must divide evenly into model.num_heads {heads} heads")
    elif (h // heads) % 2:  # the rotary embedding turns pairs of a head's dimensions
        problems.append(f"model.hidden_size {h} / model.num_heads {heads} = head size {h // heads} must be even: "
                        f"the rotary embedding turns pairs of dimensions")
    if heads % kv:
        problems.append(f"model.num_heads {heads} must divide evenly into model.num_kv_heads {kv} groups")
    moe: dict[str, Any] = {}
    if arch == "qwen2_moe":
        moe = dict(experts=int(m["num_experts"]), experts_per_token=int(m["num_experts_per_token"]),
                   moe_ffn=int(m["moe_intermediate_size"]), shared_ffn=int(m["shared_expert_intermediate_size"]))
        if moe["experts_per_token"] > moe["experts"]:
            problems.append(f"model.num_experts_per_token {moe['experts_per_token']} must be between 1 and "
                            f"model.num_experts {moe['experts']}")
    if problems:
        raise ConfigError(problems)
    layers = int(m["num_layers"])
    return ModelSpec(
        layers=layers, hidden=h, heads=heads, kv_heads=kv, head_dim=h // heads, ffn=int(m["intermediate_size"]),
        vocab=vocab if vocab is not None else char_vocab_size(), tied=bool(m["tie_word_embeddings"]),
        qkv_bias=arch.startswith("qwen2"), arch=arch, max_positions=int(m["max_position_embeddings"]),
        initializer_range=float(m["initializer_range"]), name=f"{arch}-h{h}-l{layers}", **moe,
    )


def spec_from_hf_config(cfg: Mapping[str, Any], name: str = "hf") -> ModelSpec:
    """The model of a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Qwen2-MoE, Mixtral ...)."""
    try:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        model_type = str(cfg.get("model_type", ""))
        qwen2 = model_type.startswith("qwen2")
        # transformers >= 5 nests rope_theta in rope_parameters; older config.json files have it on top.
        rope = cfg.get("rope_parameters") or {}
        return ModelSpec(
            layers=int(cfg["num_hidden_layers"]), hidden=h, heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or h // heads), ffn=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; Llama-family configs put both in attention_bias.
            qkv_bias=bool(cfg.get("attention_bias", qwen2)),
            o_bias=bool(cfg.get("attention_bias", False)) and not qwen2,
            gated=str(cfg.get("hidden_act", "silu")) in _GATED_ACTS,
            experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            arch=model_type or "llama", max_positions=int(cfg.get("max_position_embeddings") or 2048),
            rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
            norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            initializer_range=float(cfg.get("initializer_range") or 0.02), name=name,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"model.path: {name}/config.json lacks or mangles a field rlbatch needs: {e}") from None


def spec_from_config(model: Any, vocab: int | None = None) -> ModelSpec:
    """The model of ``cfg.model``: its ``config.json`` when ``path`` is set, else the random-init
    fields (``vocab``: the tokenizer's size, the built-in tokenizer's when None)."""
    path = _fields(model).get("path")
    if not path:
        return spec_from_model_config(model, vocab)
    file = Path(str(path)).expanduser() / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.path: {file} does not exist; the model's shape is read from it")
    return spec_from_hf_config(json.loads(file.read_text()), name=Path(str(path)).name)


def hf_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """Keyword arguments of the transformers config class (``Qwen2Config``, ``LlamaConfig``) that
    builds ``spec``: the inverse of ``spec_from_hf_config``. Raises ValueError for what the
    random-init builder does not make (MoE, a non-gated MLP, biases the arch does not have)."""
    problems = []
    if spec.arch not in BUILDABLE_ARCHS:
        problems.append(f"arch {spec.arch!r} is not one of {BUILDABLE_ARCHS}")
    if not spec.gated:
        problems.append("only SwiGLU MLPs are built (gated)")
    if (spec.arch == "qwen2_moe") != bool(spec.experts):
        problems.append("experts are built for arch qwen2_moe, which has them (experts > 0)")
    if spec.arch.startswith("qwen2") and (not spec.qkv_bias or spec.o_bias):
        problems.append("a Qwen2 has q/k/v biases and no o bias")
    if spec.arch == "llama" and spec.qkv_bias != spec.o_bias:
        problems.append("a Llama has biases on all of q/k/v/o or on none (attention_bias)")
    if spec.heads % spec.kv_heads:
        problems.append(f"heads {spec.heads} must divide evenly into kv_heads {spec.kv_heads} groups")
    if problems:
        raise ValueError(f"cannot build {spec.name}: " + "; ".join(problems))
    kw: dict[str, Any] = dict(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, hidden_act="silu",
        max_position_embeddings=spec.max_positions, tie_word_embeddings=spec.tied,
        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"}, rms_norm_eps=spec.norm_eps,
        initializer_range=spec.initializer_range,
    )
    if spec.arch == "llama":
        kw.update(attention_bias=spec.qkv_bias, head_dim=spec.head_dim)
    if spec.arch == "qwen2_moe":  # every layer sparse; top-k weights as softmax gives them (not renormalised)
        kw.update(num_experts=spec.experts, num_experts_per_tok=spec.experts_per_token,
                  moe_intermediate_size=spec.moe_ffn, shared_expert_intermediate_size=spec.shared_ffn,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
    elif spec.head_dim != spec.hidden // spec.heads:  # Qwen2Config has no head_dim field; the modules read one
        kw.update(head_dim=spec.head_dim)
    return kw
