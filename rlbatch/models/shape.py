"""The parameter, FLOP and KV-cache counts of a model.

The model is the run's ``ModelSpec`` (rlbatch/models/spec.py): from ``model.path``'s Hugging
Face ``config.json`` (read as JSON: no transformers import) or from the config's random-init
fields, the same description the engines build the random-init model from. Counts are exact for
Qwen2/Llama-style decoders (RMSNorm, rotary, GQA, SwiGLU, optional attention biases) and their
Mixture-of-Experts variants.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from rlbatch.config.schema import ModelConfig
from rlbatch.models.spec import ModelSpec, VisionTower, spec_from_config, spec_from_hf_config, vision_from_hf_config

OPS_PER_LAYER_FWD = 150
"""Op-equivalents of host work one eager HF Qwen2/Llama decoder layer costs in a forward pass
(torch dispatch plus transformers' Python: norms, rotary, attention interface, masks). On a tiny
model this, not FLOPs, sets the time. Measured on the cpu profile: a 1-token forward costs
0.85 ms per layer, 146 x op_overhead_s. Calibration absorbs the error of the count."""
OPS_PER_LAYER_DECODE = 200
"""The same for one decode step with a KV cache (cache update, mask per step): 1.2 ms per layer
at batch 8 on the cpu profile."""
OPS_PER_MODEL_FWD = 130
"""Op-equivalents outside the layers: embedding, rotary tables, causal mask, final norm, lm head
(0.75 ms of a 1-token forward on the cpu profile)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the Qwen2-VL image processor resizes a height x width image to: each side rounded to a
    multiple of ``factor`` (patch x merge), the area scaled into [min_pixels, max_pixels], aspect kept
    (transformers' ``smart_resize``, without transformers)."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {height}x{width}: sides must be >= 1 with an aspect ratio of at most 200")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class VisionShape(VisionTower):
    """A ``VisionTower`` with its parameter and FLOP counts (transformers' Qwen2-VL / Qwen2.5-VL vision
    modules: a bias-free Conv3d patch embedding, ``depth`` blocks, a patch merger)."""

    @classmethod
    def of(cls, tower: VisionTower, out_hidden: int) -> VisionShape:
        """``tower`` with its merger's output width set (``out_hidden``: the language model's hidden when 0)."""
        return cls(**{f.name: getattr(tower, f.name) for f in fields(tower)} | {"out_hidden": tower.out_hidden or out_hidden})

    @property
    def patch_width(self) -> int:
        """Values of one patch (``pixel_values``' row): channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def _mlp(self) -> int:
        """A block's MLP weights (Qwen2-VL: fc1, fc2; Qwen2.5-VL: gate, up, down)."""
        return (3 if self.arch == "qwen2_5_vl" else 2) * self.hidden * self.ffn

    @property
    def _merger(self) -> int:
        """The merger's weights: merge^2 patches concatenated, a square layer, then to out_hidden."""
        wide = self.hidden * self.merge_size ** 2
        return wide * wide + wide * self.out_hidden

    @property
    def block_params(self) -> int:
        h = self.hidden
        norms = 2 * (2 * h if self.arch == "qwen2_vl" else h)  # LayerNorm has a bias, RMSNorm not
        mlp_bias = 2 * self.ffn + h if self.arch == "qwen2_5_vl" else self.ffn + h
        return norms + 4 * h * h + 4 * h + self._mlp + mlp_bias

    @property
    def params(self) -> int:
        wide = self.hidden * self.merge_size ** 2
        merger = (2 * self.hidden if self.arch == "qwen2_vl" else self.hidden) + self._merger + wide + self.out_hidden
        return self.patch_width * self.hidden + self.depth * self.block_params + merger

    @property
    def tensors(self) -> int:
        """Parameter tensors: patch embedding; per block 2 norms (4 with LayerNorm biases), qkv and
        proj (weight, bias), the MLP's linears (weight, bias); the merger's norm and two linears."""
        lnorm = self.arch == "qwen2_vl"
        block = (4 if lnorm else 2) + 4 + 2 * (2 if lnorm else 3)
        return 1 + self.depth * block + (2 if lnorm else 1) + 4

    def tokens(self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None) -> int:
        """Language-model tokens of a height x width image (``rlbatch.models.vlm.VisionSpec.tokens``),
        the resize bounds the tower's unless given."""
        f = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, f, min_pixels or self.min_pixels, max_pixels or self.max_pixels)
        return (h // f) * (w // f)

    def fwd_flops(self, patches: float) -> float:
        """Forward FLOPs of the tower on one image of ``patches`` patches (``tokens`` x merge^2): 2 per
        weight and patch, and attention (4 x hidden per query and key) over every patch of the image
        in Qwen2-VL's blocks and Qwen2.5-VL's full-attention blocks, within windows of
        (window_size / patch_size)^2 patches in Qwen2.5-VL's others."""
        h = self.hidden
        if self.arch == "qwen2_5_vl":
            full = len(self.full_attention_blocks) if self.full_attention_blocks is not None else 1
            window = min(patches, (self.window_size / self.patch_size) ** 2)
        else:
            full, window = self.depth, patches
        attention = 4.0 * h * patches * (full * patches + (self.depth - full) * window)
        linear = 2.0 * patches * (self.patch_width * h + self.depth * (4 * h * h + self._mlp))
        return linear + attention + 2.0 * patches / self.merge_size ** 2 * self._merger


class ModelShape(ModelSpec):
    """A ``ModelSpec`` with the counts the planner needs. Dense when ``experts == 0``."""

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelShape:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    # -- parameters -------------------------------------------------------------------------
    @property
    def tower(self) -> VisionShape | None:
        """A vision-language model's vision tower with its counts; None for a text model."""
        return VisionShape.of(self.vision, self.hidden) if self.vision is not None else None

    @property
    def vision_params(self) -> int:
        """Parameters of the vision tower (patch merger included); 0 for a text model."""
        return self.tower.params if self.tower is not None else 0

    @property
    def attn_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = ((q + 2 * kv) if self.qkv_bias else 0) + (self.hidden if self.o_bias else 0)
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias

    def _mlp(self, inner: int) -> int:
        return (3 if self.gated else 2) * self.hidden * inner

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters of one layer (0 for dense models)."""
        return self.experts * self._mlp(self.moe_ffn) if self.experts else 0

    @property
    def shared_gate(self) -> bool:
        """A Qwen2-MoE shared expert is scaled by a gate of its own (hidden -> 1)."""
        return bool(self.experts and self.shared_ffn and self.arch == "qwen2_moe")

    @property
    def mlp_params(self) -> int:
        """All MLP parameters of one layer (router, routed and shared experts and the shared
        expert's gate for MoE)."""
        if not self.experts:
            return self._mlp(self.ffn)
        return (self.expert_params + self.hidden * self.experts + self._mlp(self.shared_ffn)
                + (self.hidden if self.shared_gate else 0))

    def adapter_params(self, rank: int, targets: tuple[str, ...] = ("all-linear",)) -> int:
        """Parameters of rank-``rank`` LoRA adapters (r x (in + out) per adapted linear layer) on the
        decoder's linear layers named by ``targets`` ('all-linear': every one; the LM head never)."""
        return self.layers * sum(rank * (a + b) for a, b in self._adapted(targets))

    def adapted_layers(self, targets: tuple[str, ...] = ("all-linear",)) -> int:
        """The linear layers LoRA adapts for ``targets`` (each gets two adapter tensors, A and B)."""
        return self.layers * len(self._adapted(targets))

    def _adapted(self, targets: tuple[str, ...]) -> list[tuple[int, int]]:
        """(in, out) of each adapted linear layer of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = [("gate_proj", self.hidden, self.ffn)] if self.gated else []
        mlp += [("up_proj", self.hidden, self.ffn), ("down_proj", self.ffn, self.hidden)]
        if self.experts:  # routed experts are fused tensors, not linear layers: the shared expert's MLP and gate
            f = self.shared_ffn
            mlp = [(n, a if a == self.hidden else f, b if b == self.hidden else f) for n, a, b in mlp] if f else []
            mlp += [("shared_expert_gate", self.hidden, 1)] if self.shared_gate else []
        linears = [("q_proj", self.hidden, q), ("k_proj", self.hidden, kv), ("v_proj", self.hidden, kv),
                   ("o_proj", q, self.hidden), *mlp]
        every = list(targets) == ["all-linear"]
        return [(a, b) for name, a, b in linears if every or name in targets]

    @property
    def layer_params(self) -> int:
        """One decoder layer: FSDP's unit of sharding and the size of one all-gather."""
        return self.attn_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (a tied lm head counted once; a vision tower included)."""
        head = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.hidden + self.embedding_params + head + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (routed experts: only experts_per_token of them)."""
        if not self.experts:
            return self.params
        idle = (self.experts - self.experts_per_token) * self._mlp(self.moe_ffn)
        return self.params - self.layers * idle

    @property
    def largest_module_params(self) -> int:
        """Largest single module's own parameters (DeepSpeed's 'largest layer'): usually the embedding."""
        q = self.heads * self.head_dim
        merger = self.tower._merger if self.tower is not None else 0
        return max(self.embedding_params, self.hidden * max(self.ffn, self.moe_ffn, q), merger)

    @property
    def tensors(self) -> int:
        """Parameter tensors: each costs a few ops in optimizer steps, offloads and weight syncs.
        transformers holds a layer's routed experts as two stacked tensors (gate-up and down)."""
        attn = 4 + (3 if self.qkv_bias else 0) + (1 if self.o_bias else 0)
        mlp = 3 if self.gated else 2
        if self.experts:  # routed (2), router, shared expert, its gate
            mlp = 2 + 1 + (mlp if self.shared_ffn else 0) + (1 if self.shared_gate else 0)
        vision = self.tower.tensors if self.tower is not None else 0
        return self.layers * (attn + mlp + 2) + 2 + (0 if self.tied else 1) + vision

    # -- compute and KV cache ---------------------------------------------------------------
    @property
    def matmul_params(self) -> int:
        """N of the FLOP counts: the active weights a token is multiplied by. The lm head counts
        (even when tied to the input embedding, it is a vocab x hidden matmul); the input
        embedding (a lookup) and the norms do not; q/k/v biases do (a few thousand). A vision tower's
        weights multiply image patches, not tokens (``VisionShape.fwd_flops``)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.active_params - (0 if self.tied else self.embedding_params) - norms - self.vision_params

    def fwd_flops_per_token(self, ctx: float) -> float:
        """Forward FLOPs of one token attending to ``ctx`` earlier tokens: 2 per matmul weight
        plus 4*a*d*ctx per layer for QK^T and AV."""
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.heads * self.head_dim * ctx

    def train_flops_per_token(self, seq_len: float) -> float:
        """Model FLOPs of one trained token (forward + backward) in a sequence of ``seq_len``,
        in the form of PaLM (Chowdhery et al. 2022, arXiv:2204.02311, App. B), the usual basis
        of MFU: 6N + 12*L*H*Q*T, N = ``matmul_params``, attention over the whole sequence T
        (causal masking is not discounted), recomputation not counted."""
        return 3.0 * self.fwd_flops_per_token(seq_len)

    def decode_read_bytes(self, batch: int, ctx: float, dtype_bytes: int) -> float:
        """HBM bytes a decode step of ``batch`` sequences at context ``ctx`` reads at least: every
        weight once (an untied input embedding only by the rows it looks up: not counted) and
        the KV cache of every sequence. Over HBM bandwidth, the floor of the step time."""
        weights = self.active_params - (0 if self.tied else self.embedding_params) - self.vision_params
        return weights * dtype_bytes + batch * ctx * self.kv_bytes_per_token(dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        """KV cache of one token over all layers: K and V, kv_heads * head_dim each."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "layers": self.layers, "hidden": self.hidden, "heads": self.heads,
            "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn, "vocab": self.vocab,
            "tied": self.tied, "experts": self.experts, "experts_per_token": self.experts_per_token,
            "params": self.params, "active_params": self.active_params,
            **({"vision_params": self.vision_params} if self.vision is not None else {}),
        }


def shape_from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> ModelShape:
    """The shape of a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Qwen2-MoE, Mixtral ...)."""
    return ModelShape.of(spec_from_hf_config(cfg, name))


def shape_from_config(model: ModelConfig | Mapping[str, Any], vocab: int | None = None) -> ModelShape:
    """The shape of ``cfg.model``: its config.json when ``path`` is set, else the random-init fields
    with ``vocab`` tokens (the built-in tokenizer's vocabulary when None), as the engines build it."""
    spec = spec_from_config(model, vocab)
    fields_ = dict(model.items()) if isinstance(model, Mapping) else dict(vars(model))
    path = fields_.get("path")
    if path and spec.vision is not None:  # the resize bounds are the image processor's
        pre = Path(str(path)).expanduser() / "preprocessor_config.json"
        if pre.is_file():
            config = json.loads((Path(str(path)).expanduser() / "config.json").read_text())
            spec = replace(spec, vision=vision_from_hf_config(config, json.loads(pre.read_text())))
    elif not path and spec.vision is None and spec.arch in ("qwen2_vl", "qwen2_5_vl"):
        spec = replace(spec, vision=VisionTower(arch=spec.arch))  # a random-init VLM: VisionSpec's defaults
    return ModelShape.of(spec)
