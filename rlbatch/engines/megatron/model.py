"""Build a megatron-core GPTModel (local spec: no TransformerEngine needed; its attention also takes
packed rows, ``packed_attention``) from a transformers
Qwen2/Llama/Qwen2-MoE config, over explicit process groups (no global ``parallel_state`` world).

The groups come from the role's DeviceMesh (axes pp, dp, cp, tp) that ``rlbatch.runtime.world``
carves on every rank in the same order; megatron-core receives them as a ``ProcessGroupCollection``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlbatch.engines.base import require_mesh
from rlbatch.engines.megatron.convert import qkv_bias
from rlbatch.placement import subgroups

if TYPE_CHECKING:
    # megatron-core has no type information (mypy cannot check its objects): its classes name them here.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig

    from rlbatch.engines.base import EngineContext

_BY_HAND: dict[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], dict[str, ProcessGroup]] = {}
"""``engine_groups`` of engines built by hand, by the mesh's ranks and (axis, size) pairs."""


def engine_groups(ctx: EngineContext) -> dict[str, ProcessGroup]:
    """The role's groups beyond the mesh axes (``EngineContext.groups``: 'role', and with pipeline
    stages 'model_parallel' and 'pipeline_ends'), which ``rlbatch.runtime.world`` creates on every
    rank of the job. An engine built by hand over a mesh that spans the whole world (tests, tools)
    gets the same groups created here: every rank builds such an engine, so every rank makes the
    same calls in the same order. Cached per mesh (colocated roles share them)."""
    if ctx.groups:
        return dict(ctx.groups)
    device_mesh = require_mesh(ctx.mesh, ctx.role)
    ranks = [int(r) for r in device_mesh.mesh.flatten().tolist()]
    if len(ranks) != dist.get_world_size():
        raise RuntimeError(f"megatron engine, role {ctx.role}: its groups beyond the mesh axes come from "
                           f"rlbatch.runtime.world (EngineContext.groups); built by hand, the mesh must span "
                           f"the whole world ({dist.get_world_size()} ranks), got ranks {ranks}")
    names = device_mesh.mesh_dim_names
    assert names is not None, "the role's mesh names its axes (ctx.group reads them)"
    mesh = tuple(zip(names, device_mesh.mesh.shape, strict=True))
    key = (tuple(ranks), mesh)
    if key not in _BY_HAND:
        _BY_HAND[key] = {"role": dist.new_group(ranks),
                         **subgroups.create(ranks, mesh, dist.get_rank(), dist.new_group)}
    return _BY_HAND[key]


def process_groups(ctx: EngineContext, groups: dict[str, ProcessGroup]) -> ProcessGroupCollection:
    """megatron-core's ProcessGroupCollection from the role's mesh (axes pp, dp, cp, tp) and
    ``engine_groups``. The cp group is the engine's own (``context_parallel``): megatron-core's local
    layers take no part in it.

    Without pipeline stages the tp group is also the model-parallel group and the pp group (this
    rank alone) the embedding group. With them, the model-parallel group spans this replica's tp x pp
    ranks and the embedding group the first and last stages' ranks at this tp position (the two
    copies of a tied embedding; a middle stage has none)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    tp, dp, pp = ctx.group("tp"), ctx.group("dp"), ctx.group("pp")
    pgc.tp, pgc.pp, pgc.cp, pgc.dp = tp, pp, ctx.group("cp"), dp
    pgc.mp, pgc.tp_cp, pgc.dp_cp = tp, tp, dp
    pgc.embd = pgc.pos_embd = pp
    stages = dist.get_world_size(pp)
    if stages > 1:
        pgc.mp = groups["model_parallel"]
        pgc.embd = groups["pipeline_ends"] if dist.get_rank(pp) in (0, stages - 1) else None
        pgc.pos_embd = None  # rotary positions: no position-embedding weights to share
    # The experts of a Mixture-of-Experts layer are split over tp like a dense MLP (expert tp = tp).
    # Without expert parallelism the expert groups are a rank alone (ep) and dp; given here, so that
    # megatron-core's DDP does not create a group on this rank alone (out of step with the others).
    # With it (tp = 1), 'expert' splits the experts and 'expert_dp' holds the same ones.
    pgc.ep, pgc.expt_dp = groups.get("expert", ctx.group("cp")), groups.get("expert_dp", dp)
    pgc.expt_tp, pgc.tp_ep = tp, groups.get("expert", tp)
    if "expert_tp" in groups:  # a hybrid layout: the experts' own tp, and the t x e ranks tokens travel between
        pgc.expt_tp, pgc.tp_ep = groups["expert_tp"], groups["expert_tp_ep"]
    return pgc


def moe_config(hf_config: PretrainedConfig) -> dict[str, int | float | str]:
    """TransformerConfig fields of a Qwen2-MoE model (none for a dense one): top-k routing on the
    router's softmax (renormalised over the k only with ``norm_topk_prob``), in fp32 as transformers
    computes it; every token kept (no capacity); a shared expert scaled by ``sigmoid(gate . x)``; no
    load-balancing loss (the fsdp engine trains the transformers model without one either)."""
    if not getattr(hf_config, "num_experts", 0):
        return {}
    return dict(
        num_moe_experts=hf_config.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size, moe_shared_expert_gate=True,
        moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False), moe_router_score_function="softmax",
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False, moe_permute_fusion=False,
    )


def transformer_config(hf_config: PretrainedConfig, tp: int, dtype: torch.dtype, pp: int = 1, ep: int = 1,
                       sequence_parallel: bool = False, etp: int | None = None) -> TransformerConfig:
    from megatron.core.transformer.transformer_config import TransformerConfig

    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf_config),
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
        sequence_parallel=sequence_parallel and tp > 1,
        # Between stages: micro-batches of any shape (the shapes travel first), the loss each
        # micro-batch returns used as it is (the engine scales it; not divided by their number).
        pipeline_dtype=dtype, variable_seq_lengths=pp > 1, calculate_per_token_loss=pp > 1,
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable lengths
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, **moe_config(hf_config),
    )


class RMSNorm(torch.nn.RMSNorm):
    """megatron-core's local-spec norm (torch's RMSNorm) that also runs under sequence parallelism,
    which megatron-core's own wrapper refuses without TransformerEngine or Apex: a norm is per token,
    so on a sequence shard it computes what it computes on the whole; only its weight's gradient is
    partial on each TP rank, marked ``sequence_parallel`` for the engine to sum over tp."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: object) -> None:
        # In the model's dtype, as every other weight (a bf16 model with fp32 norms would run torch's
        # unfused norm on every call).
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


class ScalarHead(torch.nn.Linear):
    """A value or reward head (hidden -> 1) in place of GPTModel's vocabulary output layer: the same
    call and return as megatron-core's ``ColumnParallelLinear`` (``(output, bias)``), not split over
    TP. It reads the final hidden states whole on every TP rank (under sequence parallelism gathered
    over tp first; the backward keeps each rank's own part, as every rank computes the same loss),
    so every rank computes the same values and the head's gradients are the same on each
    (replicated, like the norms: counted once in the gradient norm)."""

    def __init__(self, hidden: int, bias: bool, dtype: torch.dtype, tp_group: ProcessGroup | None = None) -> None:
        super().__init__(hidden, 1, bias=bias, dtype=dtype)
        self.tp_group = tp_group
        """The tp group to gather the sequence over (None: no sequence parallelism)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,  # type: ignore[override]
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.tp_group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        return torch.nn.functional.linear(x, self.weight, self.bias), None


def packed_attention() -> type[DotProductAttention]:
    """megatron-core's local ``DotProductAttention``, which also takes packed rows (the ``thd``
    format: ``packed_seq_params`` with each sample's boundaries, ``cu_seqlens``), which the local one
    refuses and only TransformerEngine's attention runs. Given boundaries, attention is confined to
    each sample (causal within it) by an exact block-diagonal mask through the local attention's own
    softmax; without them it is the local attention unchanged. The ``thd`` inputs are
    [tokens, heads, head_dim] (megatron-core squeezes the batch dimension of 1), the output
    [tokens, 1, heads x head_dim] as the local attention returns it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        cp_group: ProcessGroup | None = None
        """The context-parallel group of c > 1 ranks (set by ``context_parallel``); None without."""

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                    attention_bias: torch.Tensor | None = None,
                    packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
            if self.cp_group is not None:
                if packed_seq_params is not None or attention_mask is not None or attention_bias is not None:
                    raise NotImplementedError("megatron engine: context parallelism over padded rows, causal, only")
                return ulysses_causal(query, key, value, self.cp_group, float(self.softmax_scale))
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            cu = packed_seq_params.cu_seqlens_q.long()
            n = query.shape[0]
            if int(cu[-1]) != n or not torch.equal(cu, packed_seq_params.cu_seqlens_kv.long()):
                raise ValueError(f"megatron engine: packed rows of {n} tokens with boundaries {cu.tolist()} (queries) "
                                 f"and {packed_seq_params.cu_seqlens_kv.tolist()} (keys)")
            sample = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff())
            pos = torch.arange(n, device=cu.device)
            masked = (sample[:, None] != sample[None, :]) | (pos[None, :] > pos[:, None])  # True: not attended
            return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), masked[None, None],
                                   attn_mask_type, attention_bias)

    return PackedDotProductAttention


def ulysses_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: ProcessGroup,
                   scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence from this rank's contiguous slice of it (Ulysses:
    ``rlbatch.engines.ulysses``): ``query`` [S/c, B, Hq, D] and ``key``/``value`` [S/c, B, Hkv, D] (this
    TP rank's heads) become head-split [S, B, H/c, D] by one all-to-all over ``group``, attention runs
    as megatron-core's local attention computes it (scores and softmax in fp32, the probabilities in the
    inputs' dtype times the values), and a second all-to-all brings [S/c, B, Hq x D] back. Key/value
    heads fewer than c are repeated up to it (each query head keeps its own)."""
    from rlbatch.engines.ulysses import all_to_all, split_heads

    key, value = split_heads(query.shape[2], key, value, dist.get_world_size(group), dim=2)
    q, k, v = (all_to_all(t, group, 2, 0) for t in (query, key, value))  # [S, B, H/c, D]
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, H/c, S, D]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    n = scores.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(v.dtype)
    out = torch.matmul(probs, v).permute(2, 0, 1, 3).contiguous()  # [S, B, H/c, D]
    out = all_to_all(out, group, 0, 2)  # [S/c, B, Hq, D]
    return out.reshape(*out.shape[:2], -1)


def context_parallel(model: GPTModel, group: ProcessGroup) -> None:
    """Split ``model``'s sequence over ``group`` (context parallelism, Ulysses): each rank runs its
    contiguous slice of every padded row (the engine slices and gathers, ``MegatronEngine._forward``),
    attention all-to-alls around the whole sequence (``ulysses_causal``), and the rotary embedding
    gives a rank the positions of its own slice (megatron-core's, built for its zigzag split with
    TransformerEngine's attention, gives ranks chunks r and 2c-1-r). Every other layer is per token."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    rank = dist.get_rank(group)
    for m in model.modules():
        if isinstance(m, DotProductAttention):
            m.cp_group = group
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:  # a pipeline stage without rotary embedding: none here (cp runs at p = 1)
        return

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: ProcessGroup | None = None) -> torch.Tensor:
        if packed_seq:
            raise NotImplementedError("megatron engine: context parallelism over packed rows is not built")
        return rotary.get_emb(max_seq_len, offset + rank * max_seq_len)  # this slice's positions

    rotary.forward = forward


def packed_params(cu_seq_lens: torch.Tensor, length: int) -> PackedSeqParams:
    """megatron-core's ``PackedSeqParams`` (the ``thd`` format) of a packed row of ``length`` tokens
    whose samples start at ``cu_seq_lens`` (``Flat.cu_seq_lens``: 0, ..., its token count). Pads
    after the samples (to a multiple of t under sequence parallelism) are a sample of their own, so
    every position belongs to one and no sample attends to them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seq_lens.to(torch.int32)
    if length > int(cu[-1]):
        cu = torch.cat([cu, cu.new_tensor([length])])
    longest = int(cu.diff().max()) if len(cu) > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def freeze_padding_row(model: GPTModel, padding_idx: int | None) -> None:
    """transformers' ``nn.Embedding(padding_idx=...)``: a lookup of the padding token passes no
    gradient to its row. megatron-core's embedding has no such index, and a sampled response may
    contain the pad token as a real token; so the gradient reaching the embedding's output is zeroed
    at those positions (the row still learns through a tied output layer, as in transformers).
    Under sequence parallelism the output is this TP rank's slice of the sequence."""
    if padding_idx is None:
        return
    sp = model.config.sequence_parallel

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor],
             out: torch.Tensor) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if out.requires_grad:
            keep = (ids != padding_idx).transpose(0, 1)[..., None].to(out.dtype)  # [b, s] -> [s, b, 1] like out
            if sp:
                tp = model.pg_collection.tp
                keep = keep.chunk(dist.get_world_size(tp))[dist.get_rank(tp)]
            out.register_hook(lambda g: g * keep)

    if getattr(model, "pre_process", True):  # pipeline stages after the first have no embedding
        model.embedding.register_forward_hook(hook, with_kwargs=True)


def build_gpt(hf_config: PretrainedConfig, pgc: ProcessGroupCollection, tp: int, padded_vocab: int, dtype: torch.dtype,
              head: str = "lm", head_bias: bool = False, pp: int = 1, ep: int = 1, sequence_parallel: bool = False,
              etp: int | None = None, cp_group: ProcessGroup | None = None) -> GPTModel:
    """An uninitialised GPTModel of ``hf_config`` (weights are copied in by the caller): this pipeline
    stage's part of it (``pgc.pp``'s rank of ``pp``: its layers, the embedding on the first stage,
    the final norm and output layer on the last; with ``ep`` > 1, its share of the routed experts;
    each routed expert split over ``etp`` ranks, tp unless a hybrid layout says otherwise).
    Under ``sequence_parallel`` (t > 1) the activations outside the TP regions are split along the
    sequence over tp (the norms and the MoE router see a slice each). With a ``cp_group`` of c > 1
    ranks each runs its slice of the sequence (``context_parallel``). ``head``
    'value' or 'reward': a ``ScalarHead`` replaces the vocabulary output layer (the policy's, built by
    GPTModel first, is dropped at once: a transient on the host with ``use_cpu_initialization``)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # scratch space of the TP layers, once per process
        parallel_state._set_global_memory_buffer()
    # Dropout is 0 and nothing is recomputed, so the model-parallel RNG tracker has no work: the
    # no-op tracker avoids seeding CUDA generators (model_parallel_cuda_manual_seed).
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    rope = getattr(hf_config, "rope_theta", None) or (getattr(hf_config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    stage = dist.get_rank(pgc.pp) if pp > 1 else 0
    config = transformer_config(hf_config, tp, dtype, pp, ep, sequence_parallel, etp)
    layer = get_gpt_layer_local_spec(num_experts=getattr(hf_config, "num_experts", None) or None,
                                     normalization="RMSNorm")
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    layer.submodules.self_attention.submodules.core_attention = packed_attention()  # packed rows too
    model = GPTModel(
        config=config,
        transformer_layer_spec=TransformerBlockSubmodules(
            layer_specs=[layer] * get_num_layers_to_build(config, pp_rank=stage), layer_norm=RMSNorm),
        vocab_size=padded_vocab, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=stage == 0, post_process=stage == pp - 1, parallel_output=False,
        share_embeddings_and_output_weights=head == "lm" and bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_base=int(rope), pg_collection=pgc,
    )
    if head != "lm" and stage == pp - 1:
        model.output_layer = ScalarHead(hf_config.hidden_size, head_bias, dtype,
                                        pgc.tp if config.sequence_parallel else None)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        context_parallel(model, cp_group)
    return model
