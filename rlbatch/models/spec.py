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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlbatch.config.bounds import field_problems
from rlbatch.config.schema import ModelConfig
from rlbatch.errors import ConfigError

BUILDABLE_ARCHS = ("qwen2", "llama", "qwen2_moe")
"""Architectures ``rlbatch.models.tiny`` builds from a spec (random-init models)."""

VLM_ARCHS = ("qwen2_vl", "qwen2_5_vl")
"""Vision-language architectures (``rlbatch.models.vlm``): a random-init one's language model is the
Qwen2 decoder of the same ``model.*`` fields (``arch`` kept so the engines know to build the VLM),
its vision tower ``rlbatch.models.vlm.VisionSpec``'s defaults; a ``model.path`` is one when its
config.json's ``model_type`` is."""

VISION_TOKEN_COUNT = 4
"""Tokens a random-init VLM's tokenizer gains (``rlbatch.models.vlm.VISION_TOKENS``): its vocabulary
is the character tokenizer's plus these."""


def vlm_arch(model: Any) -> str | None:
    """The vision-language architecture of a ``ModelConfig`` (or a mapping of its fields):
    'qwen2_vl' / 'qwen2_5_vl', None for a text model. ``model.arch`` of a random-init model,
    ``model.path``'s config.json ``model_type`` (None when there is no config.json to read)."""
    m = _fields(model)
    if not m.get("path"):
        arch = str(m.get("arch") or "")
        return arch if arch in VLM_ARCHS else None
    file = Path(str(m["path"])).expanduser() / "config.json"
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return str(model_type) if model_type in VLM_ARCHS else None

_GATED_ACTS = ("silu", "swiglu", "swish")


@dataclass(frozen=True)
class VisionSizes:
    """A Qwen2-VL / Qwen2.5-VL vision tower's sizes and its image processor's resize bounds: what a
    random-init model is built with (``rlbatch.models.vlm.VisionSpec``) and what the planner counts
    (``VisionTower``) alike, one definition for both. The defaults are the tiny tower of a random-init
    VLM (``model.arch=qwen2_vl`` / ``qwen2_5_vl``)."""

    depth: int = 2
    hidden: int = 32
    """Width of the vision blocks (Qwen2-VL's ``embed_dim``, Qwen2.5-VL's ``hidden_size``)."""
    heads: int = 2
    ffn: int = 64
    """Intermediate size of a vision block's MLP (Qwen2-VL: ``mlp_ratio`` x ``hidden``, so a multiple)."""
    patch_size: int = 14
    merge_size: int = 2
    """Patches merged (per side) into one language-model token."""
    temporal_patch_size: int = 2
    window_size: int = 112
    """Qwen2.5-VL: side in pixels of the windows its windowed-attention blocks attend within."""
    full_attention_blocks: tuple[int, ...] | None = None
    """Qwen2.5-VL: blocks that attend over the whole image; None: the last one."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 64
    """An image is resized (aspect kept, sides multiples of patch_size x merge_size) to between
    min_pixels and max_pixels: at most max_pixels / (patch_size x merge_size)^2 tokens."""


@dataclass(frozen=True)
class VisionTower(VisionSizes):
    """A Qwen2-VL / Qwen2.5-VL vision tower and its image processor's resize bounds, for counting
    (``rlbatch.models.shape.VisionShape``). ``VisionTower(arch=...)``: the tower of a random-init VLM
    (``VisionSizes``' defaults, as ``rlbatch.models.vlm.VisionSpec()`` builds it)."""

    arch: str = "qwen2_vl"
    """'qwen2_vl' (LayerNorm, GELU MLP, full attention) or 'qwen2_5_vl' (RMSNorm, SwiGLU MLP,
    windowed attention but in ``full_attention_blocks``)."""
    out_hidden: int = 0
    """Width of the merger's output (the language model's hidden); 0: the language model's."""
    in_channels: int = 3


HUB_MIN_PIXELS, HUB_MAX_PIXELS = 56 * 56, 28 * 28 * 16384
"""The resize bounds of the published Qwen2-VL / Qwen2.5-VL ``preprocessor_config.json`` files: what a
model directory without one is taken to use."""


def vision_from_hf_config(cfg: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None) -> VisionTower | None:
    """The vision tower of a Qwen2-VL / Qwen2.5-VL ``config.json`` mapping (None for a text model),
    with the resize bounds of its ``preprocessor_config.json`` mapping when given. Qwen2-VL's
    ``vision_config`` names the tower's width ``embed_dim`` (its ``hidden_size`` is the merger's
    output), Qwen2.5-VL's ``hidden_size`` (output ``out_hidden_size``)."""
    arch = str(cfg.get("model_type", ""))
    v = cfg.get("vision_config")
    if arch not in ("qwen2_vl", "qwen2_5_vl") or not isinstance(v, Mapping):
        return None
    pre: Mapping[str, Any] = preprocessor or {}
    size: Mapping[str, Any] = pre["size"] if isinstance(pre.get("size"), Mapping) else {}
    tower = VisionTower(
        arch=arch, depth=int(v["depth"]), heads=int(v["num_heads"]), patch_size=int(v.get("patch_size", 14)),
        merge_size=int(v.get("spatial_merge_size", 2)), temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        in_channels=int(v.get("in_chans") or v.get("in_channels") or 3),
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or HUB_MIN_PIXELS),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or HUB_MAX_PIXELS))
    if arch == "qwen2_vl":
        width = int(v["embed_dim"])
        return replace(tower, hidden=width, ffn=int(float(v.get("mlp_ratio", 4)) * width), out_hidden=int(v["hidden_size"]))
    full = v.get("fullatt_block_indexes")
    return replace(tower, hidden=int(v["hidden_size"]), ffn=int(v["intermediate_size"]),
                   out_hidden=int(v.get("out_hidden_size") or 0), window_size=int(v.get("window_size", 112)),
                   full_attention_blocks=tuple(int(b) for b in full) if full is not None else None)


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
    vision: VisionTower | None = None
    """A vision-language model's vision tower (the decoder above is its language model); None: text only."""


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
    if arch not in BUILDABLE_ARCHS + VLM_ARCHS:
        problems.append(f"model.arch: {arch!r} cannot be random-initialised; expected one of "
                        f"{BUILDABLE_ARCHS + VLM_ARCHS}")
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
        vocab=vocab if vocab is not None else char_vocab_size() + (VISION_TOKEN_COUNT if arch in VLM_ARCHS else 0),
        tied=bool(m["tie_word_embeddings"]),
        qkv_bias=arch.startswith("qwen2"), arch=arch, max_positions=int(m["max_position_embeddings"]),
        initializer_range=float(m["initializer_range"]), name=f"{arch}-h{h}-l{layers}", **moe,
    )


def spec_from_hf_config(cfg: Mapping[str, Any], name: str = "hf") -> ModelSpec:
    """The model of a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Qwen2-MoE, Mixtral ...)."""
    try:
        vision = vision_from_hf_config(cfg)
        if vision is not None and isinstance(cfg.get("text_config"), Mapping):  # transformers >= 5 nests the LM
            tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))
            cfg = {**cfg["text_config"], "model_type": cfg["model_type"], "tie_word_embeddings": tie}
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
            initializer_range=float(cfg.get("initializer_range") or 0.02), name=name, vision=vision,
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
