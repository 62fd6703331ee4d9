"""The parameter, FLOP and KV-cache counts of a model.

The model is the run's ``ModelSpec`` (rlbatch/models/spec.py): from ``model.path``'s Hugging
Face ``config.json`` (read as JSON: no transformers import) or from the config's random-init
fields, the same description the engines build the random-init model from. Counts are exact for
Qwen2/Llama-style decoders (RMSNorm, rotary, GQA, SwiGLU, optional attention biases) and their
Mixture-of-Experts variants.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from rlbatch.config.schema import ModelConfig
from rlbatch.models.spec import ModelSpec, spec_from_config, spec_from_hf_config

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


class ModelShape(ModelSpec):
    """A ``ModelSpec`` with the counts the planner needs. Dense when ``experts == 0``."""

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelShape:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    # -- parameters -------------------------------------------------------------------------
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
        """Parameter tensors: each costs a few ops in optimizer steps, offloads and weight syncs.
        transformers holds a layer's routed experts as two stacked tensors (gate-up and down)."""
        attn = 4 + (3 if self.qkv_bias else 0) + (1 if self.o_bias else 0)
        mlp = 3 if self.gated else 2
        if self.experts:  # routed (2), router, shared expert, its gate
            mlp = 2 + 1 + (mlp if self.shared_ffn else 0) + (1 if self.shared_gate else 0)
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


def shape_from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> ModelShape:
    """The shape of a Hugging Face ``config.json`` mapping (Llama, Qwen2, Mistral, Qwen2-MoE, Mixtral ...)."""
    return ModelShape.of(spec_from_hf_config(cfg, name))


def shape_from_config(model: ModelConfig | Mapping[str, Any], vocab: int | None = None) -> ModelShape:
    """The shape of ``cfg.model``: its config.json when ``path`` is set, else the random-init fields
    with ``vocab`` tokens (the built-in tokenizer's vocabulary when None), as the engines build it."""
    return ModelShape.of(spec_from_config(model, vocab))
