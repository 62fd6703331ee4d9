"""The model's shape, and the parameter, FLOP and KV-cache counts that follow from it.

A shape comes from the config's random-init fields (``model.hidden_size`` ...) or, when
``model.path`` is set, from that directory's Hugging Face ``config.json`` (read as JSON: no
transformers import). Counts are exact for Qwen2/Llama-style decoders (RMSNorm, rotary, GQA,
SwiGLU, optional q/k/v bias) and their Mixture-of-Experts variants.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.errors import ConfigError

TINY_VOCAB = 18
"""Vocabulary of the built-in character tokenizer (rlbatch/data/tokenizer.py: 4 special tokens
plus the 14 characters of DEFAULT_ALPHABET), used by random-init models."""

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


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. Dense when ``experts == 0``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    gated: bool = True
    """SwiGLU-style MLP (gate, up, down) rather than two matrices."""
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    """Intermediate size of one routed expert."""
    shared_ffn: int = 0
    """Intermediate size of the shared expert(s), 0 when none."""
    name: str = "model"

    # -- parameters -------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return self.hidden * (q + 2 * kv) + q * self.hidden + bias

    def _mlp(self, inner: int) -> int:
        return (3 if self.gated else 2) * self.hidden * inner

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters of one layer (0 for dense models)."""
        return self.experts * self._mlp(self.moe_ffn) if self.experts else 0

    @property
    def mlp_params(self) -> int:
        """All MLP parameters of one layer (router, routed and shared experts for MoE)."""
        if not self.experts:
            return self._mlp(self.ffn)
        return self.expert_params + self.hidden * self.experts + self._mlp(self.shared_ffn)

    @property
    def layer_params(self) -> int:
        """One decoder layer: FSDP's unit of sharding and the size of one all-gather."""
        return self.attn_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (a tied lm head counted once)."""
        head = 0 if self.tied else self.embedding_params
        return self.layers * self.layer_params + self.hidden + self.embedding_params + head

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
        return max(self.embedding_params, self.hidden * max(self.ffn, self.moe_ffn, q))

    @property
    def tensors(self) -> int:
        """Parameter tensors: each costs a few ops in optimizer steps, offloads and weight syncs."""
        attn = 4 + (3 if self.qkv_bias else 0)
        mlp = (3 if self.gated else 2) * max(1, self.experts) + (1 if self.experts else 0)
        return self.layers * (attn + mlp + 2) + 2 + (0 if self.tied else 1)

    # -- compute and KV cache ---------------------------------------------------------------
    @property
    def matmul_params(self) -> int:
        """N of the FLOP counts: the active weights a token is multiplied by. The lm head counts
        (even when tied to the input embedding, it is a vocab x hidden matmul); the input
        embedding (a lookup) and the norms do not; q/k/v biases do (a few thousand)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.active_params - (0 if self.tied else self.embedding_params) - norms

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
        weights = self.active_params - (0 if self.tied else self.embedding_params)
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
        }


def shape_from_hf_config(cfg: Mapping[str, Any], name: str = "hf") -> ModelShape:
    """A shape from a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Qwen2-MoE, Mixtral ...)."""
    try:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        model_type = str(cfg.get("model_type", ""))
        return ModelShape(
            layers=int(cfg["num_hidden_layers"]), hidden=h, heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or h // heads), ffn=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-family configs say so in attention_bias.
            qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
            gated=str(cfg.get("hidden_act", "silu")) in ("silu", "swiglu", "swish"),
            experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_ffn=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            name=name,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"model.path: {name}/config.json lacks or mangles a field the planner needs: {e}") from None


def shape_from_config(model: Mapping[str, Any], vocab: int | None = None) -> ModelShape:
    """The shape of ``cfg.model``: its config.json when ``path`` is set, else the random-init fields."""
    path = model.get("path")
    if path:
        file = Path(str(path)).expanduser() / "config.json"
        if not file.is_file():
            raise ConfigError(f"model.path: {file} does not exist; the planner reads the model's shape from it")
        return shape_from_hf_config(json.loads(file.read_text()), name=Path(str(path)).name)
    from rlbatch.config.schema import ModelConfig

    m = {**ModelConfig().__dict__, **{k: v for k, v in model.items() if v is not None}}
    h, heads = int(m["hidden_size"]), int(m["num_heads"])
    return ModelShape(
        layers=int(m["num_layers"]), hidden=h, heads=heads, kv_heads=int(m["num_kv_heads"]), head_dim=h // heads,
        ffn=int(m["intermediate_size"]), vocab=vocab or TINY_VOCAB, tied=bool(m["tie_word_embeddings"]),
        qkv_bias=m["arch"] == "qwen2", name=f"{m['arch']}-h{h}-l{m['num_layers']}",
    )
