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

A Qwen2-MoE layer's MLP (every layer sparse) maps to megatron-core's MoE layer (SequentialMLP
experts, a gated shared expert):

    layers.i.mlp.gate.weight         -> ...mlp.router.weight                  replicated
    layers.i.mlp.experts.gate_up_proj[e] (gate rows, then up rows)
                                     -> ...mlp.experts.local_experts.e.linear_fc1  as a dense fc1
    layers.i.mlp.experts.down_proj[e]-> ...mlp.experts.local_experts.e.linear_fc2  as a dense fc2
    layers.i.mlp.shared_expert.{gate,up,down}_proj
                                     -> ...mlp.shared_experts.linear_fc{1,2}  as a dense MLP
    layers.i.mlp.shared_expert_gate  -> ...mlp.shared_experts.gate_weight     replicated

With expert parallelism (ep ranks, tp = 1) each rank holds ``experts / ep`` consecutive experts as
its ``local_experts`` 0, 1, ... (``global_expert_name`` numbers them back). A hybrid layout
(``megatron:(attn:...|ffn:...)``) splits each routed expert over its own expert-tensor ranks
(``expert_tp``, the ffn section's t) as a dense MLP over TP, and the shared expert over attention's tp.

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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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
    experts: int = 0
    """Routed experts per layer (Qwen2-MoE); 0 for a dense MLP."""
    moe_ffn: int = 0
    """Intermediate size of one routed expert."""
    shared_ffn: int = 0
    """Intermediate size of the shared expert."""
    ep: int = 1
    """Expert-parallel ranks the routed experts are split over."""
    sparse_layers: tuple[int, ...] = ()
    """The HF layers whose MLP is sparse (a Qwen2-MoE config's ``decoder_sparse_step`` and
    ``mlp_only_layers``): every layer, or the model is refused (``problems``)."""
    expert_tp: int = 0
    """A hybrid layout's expert-tensor ranks (its ffn section's t); 0: the routed experts follow tp."""

    @property
    def etp(self) -> int:
        """The ranks each routed expert is split over, as a dense MLP over TP."""
        return self.expert_tp or self.tp

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def stage_layers(self) -> int:
        return self.layers // self.pp

    def stage_of(self, hf_name: str) -> int:
        """The pipeline stage that holds an HF-named tensor."""
        if hf_name.startswith("model.layers."):
            return int(hf_name.split(".")[2]) // self.stage_layers
        return 0 if hf_name == "model.embed_tokens.weight" else self.pp - 1


def qkv_bias(hf_config: PretrainedConfig) -> bool:
    """Whether q, k and v have biases: always in Qwen2, ``qkv_bias`` in Qwen2-MoE, ``attention_bias`` in Llama."""
    if hf_config.model_type == "qwen2":
        return True
    return bool(getattr(hf_config, "qkv_bias", False) or getattr(hf_config, "attention_bias", False))


def sparse_layers(hf_config: PretrainedConfig) -> tuple[int, ...]:
    """The layers with a Mixture-of-Experts MLP (transformers' Qwen2-MoE rule); none for a dense model."""
    if not getattr(hf_config, "num_experts", 0):
        return ()
    step, dense = int(getattr(hf_config, "decoder_sparse_step", 1)), set(getattr(hf_config, "mlp_only_layers", []) or [])
    return tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and step > 0 and (i + 1) % step == 0)


def layout(hf_config: PretrainedConfig, tp: int, head: str = "lm", head_bias: bool = False, pp: int = 1, ep: int = 1,
           expert_tp: int = 0) -> Layout:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    return Layout(hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_attention_heads, groups,
                  head_dim, hf_config.intermediate_size, hf_config.vocab_size,
                  head == "lm" and bool(getattr(hf_config, "tie_word_embeddings", False)), qkv_bias(hf_config), tp, pp,
                  head, head_bias, experts, int(getattr(hf_config, "moe_intermediate_size", 0) or 0) if experts else 0,
                  int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if experts else 0,
                  ep, sparse_layers(hf_config), expert_tp)


def problems(lay: Layout) -> list[str]:
    """What this mapping cannot split over ``lay.tp`` ranks, with the numbers."""
    out = []
    for what, n in (("num_key_value_heads", lay.groups), ("num_attention_heads", lay.heads),
                    ("intermediate_size", lay.ffn)):
        if n % lay.tp:
            out.append(f"{what} = {n} is not divisible by tensor parallel t = {lay.tp}")
    if lay.layers % lay.pp:
        out.append(f"num_hidden_layers = {lay.layers} is not divisible by pipeline parallel p = {lay.pp}")
    if lay.ep > 1 and not lay.experts:
        out.append(f"expert parallel e = {lay.ep} needs a Mixture-of-Experts model (num_experts), this one is dense")
    if lay.experts and lay.experts % lay.ep:
        out.append(f"num_experts = {lay.experts} is not divisible by expert parallel e = {lay.ep}")
    if lay.ep > 1 and lay.tp > 1 and not lay.expert_tp:
        out.append(f"expert parallel e = {lay.ep} with tensor parallel t = {lay.tp} is not built; use t = 1 with e")
    if lay.expert_tp and not lay.experts:
        out.append(f"a hybrid layout's ffn section (t = {lay.expert_tp}, e = {lay.ep}) lays out routed experts; "
                   f"this model is dense")
    if lay.experts:
        for what, n, by, axis in (("moe_intermediate_size", lay.moe_ffn, lay.etp,
                                   "expert tensor parallel" if lay.expert_tp else "tensor parallel"),
                                  ("shared_expert_intermediate_size", lay.shared_ffn, lay.tp, "tensor parallel")):
            if n % by:
                out.append(f"{what} = {n} is not divisible by {axis} t = {by}")
        if not lay.shared_ffn:
            out.append("a Qwen2-MoE model without a shared expert (shared_expert_intermediate_size = 0) is not converted")
        if len(lay.sparse_layers) != lay.layers:
            dense = sorted(set(range(lay.layers)) - set(lay.sparse_layers))
            out.append(f"layers {dense} have a dense MLP (decoder_sparse_step / mlp_only_layers); the engine "
                       f"converts Qwen2-MoE models whose every layer is sparse")
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


def global_expert_name(name: str, lay: Layout, ep_rank: int) -> str | None:
    """A routed expert's GPTModel name on expert-parallel rank ``ep_rank`` as expert parallel rank 0
    of ``ep = 1`` would name it (its global index); None for a tensor that is not a routed expert's."""
    head, sep, tail = name.partition(".mlp.experts.local_experts.")
    if not sep:
        return None
    k, rest = tail.split(".", 1)
    return f"{head}{sep}{ep_rank * lay.local_experts + int(k)}.{rest}"


def to_megatron(hf: Mapping[str, torch.Tensor], lay: Layout, rank: int, stage: int = 0,
                ep_rank: int = 0, etp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """This TP rank's GPTModel tensors of pipeline stage ``stage`` from HF-named tensors (weights or
    weight-shaped state; only the stage's own names are read); with expert parallelism, the routed
    experts of expert-parallel rank ``ep_rank``, split as expert-tensor rank ``etp_rank`` (a hybrid
    layout's; else the TP rank)."""
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
        out.update(_moe_to_megatron(hf, h, m, lay, rank, ep_rank, rank if etp_rank is None else etp_rank)
                   if lay.experts else
                   _mlp_to_megatron(hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"],
                                    hf[h + "mlp.down_proj.weight"], m + "mlp.", lay, rank))
    return out


def _mlp_to_megatron(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, m: str, lay: Layout,
                     rank: int, tp: int | None = None) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's ``linear_fc1`` (this rank's gate rows, then its up rows) and ``linear_fc2``, split
    over ``tp`` ranks (``lay.tp`` unless given)."""
    tp = tp or lay.tp
    return {m + "linear_fc1.weight": torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)]),
            m + "linear_fc2.weight": _rows(down, rank, tp, dim=1)}


def _moe_to_megatron(hf: Mapping[str, torch.Tensor], h: str, m: str, lay: Layout, rank: int,
                     ep_rank: int, etp_rank: int) -> dict[str, torch.Tensor]:
    out = {m + "mlp.router.weight": hf[h + "mlp.gate.weight"],
           m + "mlp.shared_experts.gate_weight": hf[h + "mlp.shared_expert_gate.weight"]}
    s = h + "mlp.shared_expert."
    out.update(_mlp_to_megatron(hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"], hf[s + "down_proj.weight"],
                                m + "mlp.shared_experts.", lay, rank))
    gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
    for k in range(lay.local_experts):
        e = ep_rank * lay.local_experts + k
        gate, up = gate_up[e].chunk(2)
        out.update(_mlp_to_megatron(gate, up, down[e], m + f"mlp.experts.local_experts.{k}.", lay, etp_rank, lay.etp))
    return out


def _unqkv(shards: list[torch.Tensor], lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, qpg = lay.groups, lay.head_dim, lay.q_per_group
    tail = shards[0].shape[1:]
    fused = torch.cat(shards).reshape(g, (qpg + 2) * d, *tail)
    q, k, v = fused.split([qpg * d, d, d], dim=1)
    return q.reshape(g * qpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def _mlp_to_hf(shards: Mapping[str, list[torch.Tensor]], m: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full gate, up and down projections from a SwiGLU MLP's TP shards."""
    halves = [s.chunk(2) for s in shards[m + "linear_fc1.weight"]]
    return (torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves]),
            torch.cat(shards[m + "linear_fc2.weight"], dim=1))


def _moe_to_hf(shards: Mapping[str, list[torch.Tensor]], h: str, m: str, lay: Layout) -> dict[str, torch.Tensor]:
    gate, up, down = _mlp_to_hf(shards, m + "mlp.shared_experts.")
    out = {h + "mlp.gate.weight": shards[m + "mlp.router.weight"][0],
           h + "mlp.shared_expert_gate.weight": shards[m + "mlp.shared_experts.gate_weight"][0],
           h + "mlp.shared_expert.gate_proj.weight": gate, h + "mlp.shared_expert.up_proj.weight": up,
           h + "mlp.shared_expert.down_proj.weight": down}
    experts = [_mlp_to_hf(shards, m + f"mlp.experts.local_experts.{e}.") for e in range(lay.experts)]
    out[h + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
    out[h + "mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
    return out


def to_hf(shards: Mapping[str, list[torch.Tensor]], lay: Layout, stage: int = 0) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of pipeline stage ``stage`` from its TP ranks' GPTModel tensors
    (``shards[name][r]``: rank r's; routed experts under ``global_expert_name``, all of them, each
    its expert-tensor ranks' shards). The
    last stage's copy of a tied embedding is not among them."""
    out: dict[str, torch.Tensor] = {}
    if stage == 0:
        out.update(embedding_to_hf(shards, lay))
    for j in range(lay.stage_layers):
        out.update(layer_to_hf(shards, lay, stage * lay.stage_layers + j, j))
    if stage == lay.pp - 1:
        out.update(head_to_hf(shards, lay))
    return out


def embedding_to_hf(shards: Mapping[str, list[torch.Tensor]], lay: Layout) -> dict[str, torch.Tensor]:
    """The first stage's embedding, full, from its TP shards (the vocabulary padding cut off)."""
    return {"model.embed_tokens.weight": torch.cat(shards["embedding.word_embeddings.weight"])[: lay.vocab]}


def layer_to_hf(shards: Mapping[str, list[torch.Tensor]], lay: Layout, hf_layer: int,
                stage_layer: int) -> dict[str, torch.Tensor]:
    """HF layer ``hf_layer``, full, from the TP shards of its stage's ``decoder.layers.<stage_layer>``."""
    h, m = _hf_layer(hf_layer), _mc_layer(stage_layer)
    a = h + "self_attn."
    out: dict[str, torch.Tensor] = {h + "input_layernorm.weight": shards[m + "input_layernorm.weight"][0]}
    for kind in ("weight", "bias") if lay.qkv_bias else ("weight",):
        q, k, v = _unqkv(shards[m + f"self_attention.linear_qkv.{kind}"], lay)
        out[a + f"q_proj.{kind}"], out[a + f"k_proj.{kind}"], out[a + f"v_proj.{kind}"] = q, k, v
    out[a + "o_proj.weight"] = torch.cat(shards[m + "self_attention.linear_proj.weight"], dim=1)
    if lay.experts:
        out.update(_moe_to_hf(shards, h, m, lay))
    else:
        gate, up, down = _mlp_to_hf(shards, m + "mlp.")
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"], out[h + "mlp.down_proj.weight"] = gate, up, down
    out[h + "post_attention_layernorm.weight"] = shards[m + "pre_mlp_layernorm.weight"][0]
    return out


def head_to_hf(shards: Mapping[str, list[torch.Tensor]], lay: Layout) -> dict[str, torch.Tensor]:
    """The last stage's final norm and head (the output layer, or the scalar head ``score.*``), full;
    a tied embedding's copy on the last stage is not among them."""
    out = {"model.norm.weight": shards["decoder.final_layernorm.weight"][0]}
    if lay.head != "lm":
        out["score.weight"] = shards["output_layer.weight"][0]
        if lay.head_bias:
            out["score.bias"] = shards["output_layer.bias"][0]
    elif not lay.tied:
        out["lm_head.weight"] = torch.cat(shards["output_layer.weight"])[: lay.vocab]
    return out
