"""Hugging Face Qwen2/Llama weights <-> megatron-core GPTModel (local spec) weights, per TP rank.

The mapping (exact: it only moves numbers):

    model.embed_tokens.weight        -> embedding.word_embeddings.weight      rows split over TP
    lm_head.weight (untied)          -> output_layer.weight                   rows split over TP
    layers.i.input_layernorm         -> decoder.layers.i.input_layernorm      replicated
    layers.i.post_attention_layernorm-> decoder.layers.i.pre_mlp_layernorm    replicated
    layers.i.self_attn.{q,k,v}_proj  -> decoder.layers.i.self_attention.linear_qkv
                                        per query group g: [q heads of g; k_g; v_g], the groups
                                        split over TP contiguously (the bias the same way)
    layers.i.self_attn.o_proj        -> ...self_attention.linear_proj         columns split over TP
    layers.i.mlp.{gate,up}_proj      -> decoder.layers.i.mlp.linear_fc1       per rank cat(gate_r, up_r)
    layers.i.mlp.down_proj           -> decoder.layers.i.mlp.linear_fc2       columns split over TP
    model.norm                       -> decoder.final_layernorm               replicated
    score.{weight,bias} (value/reward)-> output_layer.{weight,bias}           replicated

Under pipeline parallelism (p stages) each stage holds a contiguous 1/p of the layers, numbered
from 0 on every stage (HF layer ``stage * layers/p + j`` is the stage's ``decoder.layers.j``); the
embedding lives on the first stage, the final norm and the output layer on the last. A tied
embedding is held twice then: the last stage's ``output_layer.weight`` is a copy of the first
stage's embedding (kept equal by summing their gradients), and only the first's leaves.

A value model (transformers' ``...ForTokenClassification``: ``score.weight`` [1, hidden] and
``score.bias``) or a reward model (``...ForSequenceClassification``: ``score.weight`` only) has the
same body; its scalar head takes the place of the vocabulary output layer, whole on every TP rank.

The vocabulary is padded with zero rows to a multiple of TP (Megatron splits it evenly); the
padding never leaves this module. The same functions convert anything shaped like the weights
(Adam's moments), which is how checkpoints stay engine-neutral.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """The shapes that decide the mapping, read from a transformers config."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    tp: int = 1
    pp: int = 1
    """Pipeline stages: each holds ``layers // pp`` consecutive layers."""
    head: str = "lm"
    """'lm' (the vocabulary output layer), or a scalar head: 'value' or 'reward' (``score.*``)."""
    head_bias: bool = False
    """Whether the scalar head has a bias (``score.bias``: transformers' token classification)."""

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def stage_layers(self) -> int:
        return self.layers // self.pp

    def stage_of(self, hf_name: str) -> int:
        """The pipeline stage that holds an HF-named tensor."""
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) // self.stage_layers
        return 0 if hf_name == "model.embed_tokens.weight" else self.pp - 1


def layout(hf_config: Any, tp: int, head: str = "lm", head_bias: bool = False, pp: int = 1) -> Layout:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return Layout(hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_attention_heads, groups,
                  head_dim, hf_config.intermediate_size, hf_config.vocab_size,
                  head == "lm" and bool(getattr(hf_config, "tie_word_embeddings", False)), qkv_bias, tp, pp, head,
                  head_bias)


def problems(lay: Layout) -> list[str]:
    """What this mapping cannot split over ``lay.tp`` ranks, with the numbers."""
    out = []
    for what, n in (("num_key_value_heads", lay.groups), ("num_attention_heads", lay.heads),
                    ("intermediate_size", lay.ffn)):
        if n % lay.tp:
            out.append(f"{what} = {n} is not divisible by tensor parallel t = {lay.tp}")
    if lay.layers % lay.pp:
        out.append(f"num_hidden_layers = {lay.layers} is not divisible by pipeline parallel p = {lay.pp}")
    return out


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _rows(t: torch.Tensor, rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def _pad_vocab(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    extra = lay.padded_vocab - t.shape[0]
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, rank: int) -> torch.Tensor:
    g, d = lay.groups, lay.head_dim
    tail = q.shape[1:]
    q = q.reshape(g, lay.q_per_group * d, *tail)
    fused = torch.cat([q, k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)  # [g, (qpg+2)*d, ...]
    return _rows(fused, rank, lay.tp).reshape(-1, *tail)


def to_megatron(hf: Mapping[str, torch.Tensor], lay: Layout, rank: int, stage: int = 0) -> dict[str, torch.Tensor]:
    """This TP rank's GPTModel tensors of pipeline stage ``stage`` from HF-named tensors (weights or
    weight-shaped state; only the stage's own names are read)."""
    tp, first, last = lay.tp, stage == 0, stage == lay.pp - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = _rows(_pad_vocab(hf["model.embed_tokens.weight"], lay), rank, tp)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if lay.head != "lm":
            out["output_layer.weight"] = hf["score.weight"]
            if lay.head_bias:
                out["output_layer.bias"] = hf["score.bias"]
        elif not lay.tied:
            out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], lay), rank, tp)
        elif not first:  # the tied embedding's copy on the last stage
            out["output_layer.weight"] = _rows(_pad_vocab(hf["model.embed_tokens.weight"], lay), rank, tp)
    for j in range(lay.stage_layers):
        h, m = _hf_layer(stage * lay.stage_layers + j), _mc_layer(j)
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                                                           hf[a + "v_proj.weight"], lay, rank)
        if lay.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                                             hf[a + "v_proj.bias"], lay, rank)
        out[m + "self_attention.linear_proj.weight"] = _rows(hf[a + "o_proj.weight"], rank, tp, dim=1)
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)])
        out[m + "mlp.linear_fc2.weight"] = _rows(hf[h + "mlp.down_proj.weight"], rank, tp, dim=1)
    return out


def _unqkv(shards: list[torch.Tensor], lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, qpg = lay.groups, lay.head_dim, lay.q_per_group
    tail = shards[0].shape[1:]
    fused = torch.cat(shards).reshape(g, (qpg + 2) * d, *tail)
    q, k, v = fused.split([qpg * d, d, d], dim=1)
    return q.reshape(g * qpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def to_hf(shards: Mapping[str, list[torch.Tensor]], lay: Layout, stage: int = 0) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of pipeline stage ``stage`` from its TP ranks' GPTModel tensors
    (``shards[name][r]``: rank r's). The last stage's copy of a tied embedding is not among them."""
    first, last = stage == 0, stage == lay.pp - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["model.embed_tokens.weight"] = torch.cat(shards["embedding.word_embeddings.weight"])[: lay.vocab]
    for j in range(lay.stage_layers):
        h, m = _hf_layer(stage * lay.stage_layers + j), _mc_layer(j)
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = shards[m + "input_layernorm.weight"][0]
        for kind in ("weight", "bias") if lay.qkv_bias else ("weight",):
            q, k, v = _unqkv(shards[m + f"self_attention.linear_qkv.{kind}"], lay)
            out[a + f"q_proj.{kind}"], out[a + f"k_proj.{kind}"], out[a + f"v_proj.{kind}"] = q, k, v
        out[a + "o_proj.weight"] = torch.cat(shards[m + "self_attention.linear_proj.weight"], dim=1)
        halves = [s.chunk(2) for s in shards[m + "mlp.linear_fc1.weight"]]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
        out[h + "mlp.down_proj.weight"] = torch.cat(shards[m + "mlp.linear_fc2.weight"], dim=1)
        out[h + "post_attention_layernorm.weight"] = shards[m + "pre_mlp_layernorm.weight"][0]
    if last:
        out["model.norm.weight"] = shards["decoder.final_layernorm.weight"][0]
        if lay.head != "lm":
            out["score.weight"] = shards["output_layer.weight"][0]
            if lay.head_bias:
                out["score.bias"] = shards["output_layer.bias"][0]
        elif not lay.tied:
            out["lm_head.weight"] = torch.cat(shards["output_layer.weight"])[: lay.vocab]
    return out
