"""``megatron`` training engine: megatron-core's GPTModel, tensor-parallel over the role's tp axis,
pipeline-parallel over its pp axis and data-parallel over its dp axis (``megatron:dXtYpZ``), and
for a Qwen2-MoE model expert-parallel over e ranks folded onto dp (``megatron:dXeK``).

Also serves forward-only roles (reference). The model is built from the run's transformers
Qwen2/Llama/Qwen2-MoE model (a local HF directory or the random-init one every engine builds from the seed)
and its weights converted in (``megatron_convert``); weights leave it, for weight sync, export and
checkpoints, as full tensors under Hugging Face names, so any inference engine loads them and a
checkpoint of this engine loads into the fsdp engine and back. AdamW with the fsdp engine's
warm-up, gradient clipping over the TP shards and gradient accumulation; gradients are averaged
over dp (with ``engine_args.distributed_optimizer``, megatron-core's DDP and DistributedOptimizer
shard the AdamW state over dp instead: ``megatron_optim``). Parameters in ``model.dtype`` ('auto':
bf16 on GPU, fp32 on CPU, where the engine runs only with the test-only shim, see
``megatron_device``); 16-bit parameters train from fp32 main weights with fp32 gradients
(``megatron_optim.MainWeights``, or the distributed optimizer's), which the checkpoint holds.

Context parallelism (``megatron:dXtYcZ``, padded rows, one pipeline stage, a dense model) splits each
row's sequence over the role's cp axis: each rank runs its contiguous slice (its share of the
padding too), attention all-to-alls around the whole sequence (Ulysses, in the engine's own core
attention: ``megatron_model.context_parallel``; no TransformerEngine), and the final outputs are
gathered over cp, so every cp rank computes the same loss on the whole batch while its backward
reaches only its own tokens: gradients are summed over cp, then averaged over dp.

A Mixture-of-Experts model's routed experts (megatron-core's MoE layer, tokens sent to their
experts by all-to-all) are split over the 'expert' group: each rank holds experts / e of them. Their
gradients are summed over 'expert_dp' (the ranks holding the same experts) and divided by d, and
count once per ep rank in the gradient norm; weights leave whole (gathered over ep).

A hybrid layout ``megatron:(attn:<dims>|ffn:<dims>)`` (MoE parallel folding) lays the same ranks out
twice: attention, norms, router and shared expert over the attn section's tp, pp and dp (the mesh),
the routed experts over the ffn section's expert-tensor (t), expert (e) and expert-data (d) groups
(``subgroups``: 'expert_tp', 'expert', 'expert_dp', and 'expert_tp_ep' that tokens travel in).
megatron-core dispatches the tokens between the two; a routed expert's gradient, summed over the
tokens of every rank it served, is summed over expert_dp and divided by attention's d, and counts
once per expert tp x ep rank in the gradient norm.

Pipeline stages (p > 1) each hold 1/p of the layers; every forward and training step runs
megatron-core's 1F1B schedule over the role's micro-batches (``engine_args.micro_batch`` sequences
each, or the update's gradient-accumulation micro-batches), and what the last stage computes
(log-probs, values, scores, the training stats) is broadcast to the other stages, so every rank
of the role returns the same. Weights leave whole: each stage's are broadcast over pp.

``engine_args.max_tokens_per_micro_batch`` > 0 cuts every pass into micro-batches of at most that
many prompt + response tokens (``common.chunks`` and ``common.weighted_updates``, as the fsdp engine
does): the training loss is exact under any split, every dp rank runs as many micro-batches, the
pipeline schedule takes micro-batches of any shape. Rows stay right-padded within a micro-batch:
megatron-core packs samples into one row only in its 'thd' format (``PackedSeqParams``), which its
local attention refuses; only TransformerEngine's attention runs it, and this engine does not use
TransformerEngine (docs/megatron.md).

The critic and a reward model are the same GPTModel body with a scalar head (hidden -> 1) in place
of the vocabulary output layer, whole on every TP rank: ``values()`` reads it at every response
token, ``scores()`` at each sequence's last non-pad token (transformers' pooling), and
``train()`` minimises the value objective on it. In and out, such a model is transformers'
``...ForTokenClassification`` / ``...ForSequenceClassification`` (``score.weight``, ``score.bias``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from rlbatch import algos
from rlbatch.algos.objective import LossInput
from rlbatch.algos.value import ValueInput, ValueObjective
from rlbatch.engines import training as common
from rlbatch.engines import ulysses
from rlbatch.engines.base import CheckpointState, EngineContext, Sample, Unit, WeightStream, layer_units
from rlbatch.engines.batch import Flat, Full, Packed, flat_sequences, pack, unpack
from rlbatch.engines.megatron import convert
from rlbatch.engines.megatron import optim as megatron_optim
from rlbatch.engines.megatron.device import check_device
from rlbatch.engines.megatron.limits import context_parallel_refusal
from rlbatch.engines.megatron.model import (
    build_gpt,
    engine_groups,
    freeze_padding_row,
    packed_params,
    process_groups,
)
from rlbatch.engines.model import load_engine_model, model_dtype
from rlbatch.engines.offload import StashedState, Stashes, TensorStash, optimizer_tensors

if TYPE_CHECKING:
    # megatron-core has no type information (mypy cannot check its objects): its classes name them here.
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from torch.distributed import ProcessGroup

    from rlbatch.engines.base import Objective

T = TypeVar("T")

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MEGATRON_GROUP_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")
"""Param-group keys megatron-core's optimizer reads, not AdamW's: left out of the checkpoint's groups."""


def _routed(p: torch.nn.Parameter) -> bool:
    """A routed expert's weight on the expert groups: split over ep > 1 ranks, or a hybrid layout's
    (megatron-core marks those ``allreduce=False``: reduced over expert_dp, not all of dp)."""
    return getattr(p, "allreduce", True) is False


def _sum_over(grads: list[torch.Tensor], group: ProcessGroup | None, divide: int = 1) -> None:
    """Sum ``grads`` in place over ``group`` (one all-reduce of their concatenation), divided by ``divide``."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat /= divide
    torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                               strict=True)])


class MegatronEngine(StashedState):
    """A role's model as a megatron-core GPTModel over its tp and dp axes (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        check_device(ctx.device)
        self.device, self.algo, self.tokenizer = ctx.device, ctx.algo, ctx.tokenizer
        self.micro_batch = int(ctx.args.micro_batch)
        self.tp_group, self.dp_group, self.pp_group = ctx.group("tp"), ctx.group("dp"), ctx.group("pp")
        # Under a token budget with pack_rows a micro-batch is one packed row (megatron-core's 'thd'
        # format, which the engine's attention takes: megatron_model.packed_attention); else rows are padded.
        self.max_tokens = int(ctx.args.max_tokens_per_micro_batch)
        self.packed = self.max_tokens > 0 and bool(ctx.args.pack_rows)
        self.split = common.Split(self.micro_batch, self.max_tokens, self.dp_group, ctx.device)
        self.tp, self.tp_rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        self.pp, self.stage = dist.get_world_size(self.pp_group), dist.get_rank(self.pp_group)
        self.cp_group = ctx.group("cp")
        self.cp = dist.get_world_size(self.cp_group)
        self.last = self.stage == self.pp - 1
        groups = engine_groups(ctx)
        self.group = groups["role"]
        self.ep_group, self.edp_group = groups.get("expert"), groups.get("expert_dp")
        self.ep = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        self.ep_rank = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        # A hybrid layout's routed experts have tp groups of their own; else they follow tp.
        self.hybrid = "expert_tp" in groups
        self.etp_group = groups["expert_tp"] if self.hybrid else self.tp_group
        self.etp, self.etp_rank = dist.get_world_size(self.etp_group), dist.get_rank(self.etp_group)
        self.tp_ep_group = groups.get("expert_tp_ep", self.ep_group)
        """The ranks holding different shards of the routed experts (None: every rank all of them)."""
        self.head = ctx.head
        hf = load_engine_model(ctx, torch.float32)
        self.hf_config = hf.config
        self.pad_id = hf.config.pad_token_id  # a reward model pools at the last token that is not this one
        self.hf_names = [n for n, _ in hf.named_parameters()]
        self.hf_shapes = {n: p.shape for n, p in hf.named_parameters()}
        self.lay = convert.layout(hf.config, self.tp, ctx.head, "score.bias" in self.hf_names, self.pp, self.ep,
                                  self.etp if self.hybrid else 0)
        if bad := convert.problems(self.lay):
            raise ValueError(f"megatron engine, role {ctx.role}: " + "; ".join(bad))
        self.sp = bool(ctx.args.sequence_parallel) and self.tp > 1
        if self.lay.experts and self.tp > 1 and ctx.trainable and not self.sp:
            raise ValueError(f"megatron engine, role {ctx.role}: a Mixture-of-Experts model trains at tensor "
                             f"parallel t = {self.tp} with sequence parallelism only (megatron-core's rule); leave "
                             f"engine_args.sequence_parallel true")
        if self.cp > 1 and (why := context_parallel_refusal(self.pp, self.packed, self.lay.experts, self.hybrid,
                                                            ctx.trainable and bool(ctx.args.distributed_optimizer))):
            raise ValueError(f"megatron engine, role {ctx.role}: context parallelism c = {self.cp} {why}")
        if (self.ep > 1 or self.hybrid) and ctx.trainable and ctx.args.distributed_optimizer:
            raise ValueError(f"megatron engine, role {ctx.role}: engine_args.distributed_optimizer with expert "
                             f"parallelism (e = {self.ep}) or a hybrid layout is not built; leave it false")
        dtype = model_dtype(str(ctx.model.dtype), ctx.device)  # 'auto': bf16 on GPU, fp32 on CPU
        if dtype == torch.float16 and ctx.trainable:
            raise ValueError(f"megatron engine, role {ctx.role}: model.dtype=fp16 is not trained (fp16 gradients need "
                             f"loss scaling, which this engine does not build); use bf16 or fp32")
        self.pgc = pgc = process_groups(ctx, groups)
        self.model = build_gpt(hf.config, pgc, self.tp, self.lay.padded_vocab, dtype, ctx.head,
                               self.lay.head_bias, self.pp, self.ep, self.sp, self.etp, self.cp_group).to(ctx.device)
        self.p2p: P2PCommunicator | None = None
        if self.pp > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self.p2p = P2PCommunicator(pp_group=self.pp_group, config=self.model.config)
        embeddings = hf.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)  # Qwen2, Llama, Qwen2-MoE
        freeze_padding_row(self.model, embeddings.padding_idx)
        self.params = dict(self.model.named_parameters())
        with torch.no_grad():
            local = self._load_full({n: p.detach() for n, p in hf.named_parameters()})
            # 16-bit weights train from fp32 main weights that start at the model's exact values: a copy
            # of this rank's share (the share itself may be views that keep the whole model alive).
            initial = {n: t.clone() for n, t in local.items()} if ctx.trainable and dtype != torch.float32 else {}
        del hf, local
        self.state = Stashes({"params": TensorStash("params", self.model.parameters)})
        self.optimizer: torch.optim.Optimizer | None = None
        self.main: megatron_optim.MainWeights | None = None
        """Without the distributed optimizer: the fp32 main weights ``self.optimizer`` steps."""
        self.dist_opt: DistributedOptimizer | None = None
        """megatron-core's DistributedOptimizer (engine_args.distributed_optimizer); ``self.optimizer``
        is then the torch AdamW inside it, stepping this rank's slices."""
        # what the forward calls: the model, or its megatron-core DDP wrapper
        self.net: GPTModel | DistributedDataParallel = self.model
        if ctx.trainable:
            self.model.train()
            a = ctx.algo
            if ctx.args.distributed_optimizer:
                self.net, self.dist_opt = megatron_optim.build(self.model, pgc, a, self.group, dtype)
                if initial:
                    megatron_optim.set_main(self.dist_opt, {p: initial[n] for n, p in self.params.items()})
                self.optimizer = self.dist_opt.optimizer
                dist_opt, buffers = self.dist_opt, self.net.buffers
                self.state.add("grads", TensorStash("grads", lambda: [b.grad_data for b in buffers]))
                self.state.add("optimizer", TensorStash("optimizer", lambda: megatron_optim.state_tensors(dist_opt)))
            else:
                self.main = main = megatron_optim.MainWeights(self.params.items(), initial)
                self.optimizer = opt = torch.optim.AdamW(list(main.of.values()), lr=a.lr, weight_decay=a.weight_decay,
                                                         foreach=True)
                self.state.add("grads", TensorStash("grads", main.grads))
                self.state.add("optimizer", TensorStash("optimizer", lambda: [*optimizer_tensors(opt), *main.copies()]))
            assert self.optimizer is not None
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, common.warmup(int(a.warmup_steps)))
        else:
            self.model.eval()

    # -- weights in and out -------------------------------------------------------------------
    def _local(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's GPTModel-shaped share of HF-named tensors (its tp rank, stage and experts)."""
        return convert.to_megatron(hf, self.lay, self.tp_rank, self.stage, self.ep_rank, self.etp_rank)

    def _load_full(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set the model's weights from HF-named full tensors; returns this rank's share of them (as given,
        not rounded to the model's dtype)."""
        local = self._local(hf)
        if missing := sorted(set(self.params) ^ set(local)):
            raise RuntimeError(f"megatron engine: GPTModel and the HF mapping disagree on {missing}")
        for name, p in self.params.items():
            p.copy_(local[name])
        return local

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF-named tensors of the whole model from this rank's GPTModel-shaped tensors
        (collective over tp, the routed experts over ep, then over pp)."""
        return self._across_stages(convert.to_hf(self._shards(local), self.lay, self.stage))

    def _shards(self, local: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """Every TP rank's copy of each of this rank's GPTModel-shaped tensors (collective over tp); the
        routed experts of every ep rank under their global names, each its expert-tensor ranks'
        shards (collective over ep and expert tp)."""
        shards: dict[str, list[torch.Tensor]] = {}
        for name, t in local.items():
            t = t.detach().contiguous()
            if (self.ep > 1 or self.hybrid) and convert.global_expert_name(name, self.lay, 0) is not None:
                pieces = [t]
                if self.etp > 1:
                    pieces = [torch.empty_like(t) for _ in range(self.etp)]
                    dist.all_gather(pieces, t, group=self.etp_group)
                for r in range(self.ep):
                    shards[str(convert.global_expert_name(name, self.lay, r))] = []
                for piece in pieces:
                    parts = [torch.empty_like(piece) for _ in range(self.ep)]
                    dist.all_gather(parts, piece, group=self.ep_group)
                    for r, x in enumerate(parts):
                        shards[str(convert.global_expert_name(name, self.lay, r))].append(x)
                continue
            if self.tp == 1:
                shards[name] = [t]
                continue
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t, group=self.tp_group)
            shards[name] = parts
        return shards

    def _across_stages(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's HF-named tensors on every stage: each stage broadcasts its own, flattened
        into one buffer (the other stages know the names and shapes from the HF model)."""
        if self.pp == 1:
            return part
        like = next(iter(part.values()))
        full: dict[str, torch.Tensor] = {}
        for s in range(self.pp):
            names = [n for n in self.hf_names if self.lay.stage_of(n) == s]
            sizes = [self.hf_shapes[n].numel() for n in names]
            if s == self.stage:
                flat = torch.cat([part[n].reshape(-1) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
            dist.broadcast(flat, src=dist.get_global_rank(self.pp_group, s), group=self.pp_group)
            full.update({n: t.view(self.hf_shapes[n]) for n, t in zip(names, flat.split(sizes), strict=True)})
        return full

    @contextmanager
    def export_weights(self) -> Iterator[WeightStream]:
        """The weights under their Hugging Face names in the HF model's order, streamed one piece at a
        time (``WeightStream``): the embedding, each decoder layer, the final norm and head. The stage
        holding a piece gathers it over tp (its routed experts over ep), each shard cast first, converts
        it, and with pipeline stages broadcasts it over pp."""
        stream = WeightStream([(n, self.hf_shapes[n]) for n in self.hf_names],
                              lambda dtype: (self._export_piece(names, dtype) for names in layer_units(self.hf_names)))
        with closing(stream):  # the stream's gathers end with the sync, or with its error
            yield stream

    @staticmethod
    def _hf_piece(name: str) -> str:
        """The export piece an HF-named tensor belongs to: 'embedding', 'layer <i>' or 'head' (the final
        norm and the output or scalar head)."""
        return f"layer {name.split('.')[2]}" if name.startswith("model.layers.") else (
            "embedding" if name == "model.embed_tokens.weight" else "head")

    def _mc_piece(self, name: str) -> str | None:
        """The export piece (``_hf_piece``) a GPTModel tensor of this rank converts into; None for the last
        stage's copy of a tied embedding, which does not leave."""
        if name.startswith("decoder.layers."):
            return f"layer {self.stage * self.lay.stage_layers + int(name.split('.')[2])}"
        if name.startswith("embedding."):
            return "embedding"
        return None if self.lay.tied and name.startswith("output_layer.") else "head"

    @torch.no_grad()
    def _export_piece(self, names: list[str], dtype: torch.dtype | None) -> Unit:
        piece, stage = self._hf_piece(names[0]), self.lay.stage_of(names[0])
        want = dtype or next(iter(self.params.values())).dtype
        full: dict[str, torch.Tensor] | None = None
        if stage == self.stage:
            shards = self._shards({n: p.detach().to(want) for n, p in self.params.items() if self._mc_piece(n) == piece})
            if piece == "embedding":
                full = convert.embedding_to_hf(shards, self.lay)
            elif piece == "head":
                full = convert.head_to_hf(shards, self.lay)
            else:
                i = int(piece.split()[1])
                full = convert.layer_to_hf(shards, self.lay, i, i - stage * self.lay.stage_layers)
            del shards
        if self.pp > 1:  # the holding stage's piece to every stage, as one buffer
            sizes = [self.hf_shapes[n].numel() for n in names]
            flat = (torch.cat([full[n].reshape(-1) for n in names]) if full is not None
                    else torch.empty(sum(sizes), dtype=want, device=self.device))
            full = None
            dist.broadcast(flat, src=dist.get_global_rank(self.pp_group, stage), group=self.pp_group)
            full = {n: t.view(self.hf_shapes[n]) for n, t in zip(names, flat.split(sizes), strict=True)}
        assert full is not None
        return [(n, full[n]) for n in names]

    # -- forward ------------------------------------------------------------------------------
    def _pack(self, chunk: list[Sample]) -> Packed:
        b = pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=False, flat=self.packed)
        if self.packed and self.head == "reward":  # whole sequences, each scored at its last token (``_pool``)
            b = dataclasses.replace(b, inputs=flat_sequences(chunk, -1 if self.pad_id is None else self.pad_id,
                                                             self.device))
        return b

    def _forward(self, b: Packed) -> torch.Tensor:
        """[B, L, V] logits (or [B, L, 1] of a scalar head) at every position of right-padded
        sequences: the causal mask alone keeps pads out of every real position (so does the padding
        to a multiple of t under sequence parallelism). A packed row (``Flat``): [1, N, V] over its
        N tokens, attention confined to each sample. On a pipeline stage before the last: its
        hidden states, for the next stage."""
        x = b.inputs
        assert isinstance(x, Full | Flat)  # prompts are not shared here (``_pack``)
        ids = x.input_ids
        length = ids.shape[1]
        # The sequence splits evenly over cp, and each slice over tp; pads after it change nothing before.
        split = self.cp * (self.tp if self.sp else 1)
        if length % split:
            ids = torch.nn.functional.pad(ids, (0, split - length % split), value=self.tokenizer.pad_token_id)
        kwargs: dict[str, PackedSeqParams] = {}
        if isinstance(x, Flat):
            kwargs["packed_seq_params"] = packed_params(x.cu_seq_lens, ids.shape[1])
            pos = torch.nn.functional.pad(x.position_ids, (0, ids.shape[1] - length))
        else:
            pos = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
        if self.cp > 1:  # this rank's slice in, every rank's out ([B, L, ...]; backward: this slice's part)
            ids, pos = ulysses.local(ids, self.cp_group), ulysses.local(pos, self.cp_group)
        out = self.net(input_ids=ids, position_ids=pos, attention_mask=None, **kwargs)
        if self.cp > 1:
            out = ulysses.gather(out, self.cp_group)
        if not self.last:
            return out
        return out[:, :length, : self.lay.vocab] if self.head == "lm" else out[:, :length]

    @staticmethod
    def _select(b: Packed, out: torch.Tensor) -> torch.Tensor:
        """[B, R, ...] of the final output at the positions that score each response token (a packed
        row's: zero where a row of B x R holds no response token)."""
        x = b.inputs
        if isinstance(x, Flat):
            kept = out[0, x.keep]
            rows = torch.zeros(len(b.lengths) * x.width, kept.shape[-1], dtype=kept.dtype, device=kept.device)
            return rows.index_copy(0, x.where, kept).view(len(b.lengths), x.width, -1)
        assert isinstance(x, Full)
        return out.gather(1, x.index[:, :, None].expand(-1, -1, out.shape[-1]))

    def _each(self, samples: list[Sample], fn: Callable[[Packed, torch.Tensor], list[T]]) -> list[T]:
        """``fn(batch, final output)`` of every micro-batch, concatenated. With pipeline stages: the
        1F1B schedule forward-only, ``fn`` run on the last stage and its results broadcast. Micro-batches
        as ``common.chunks`` cuts them: ``micro_batch`` sequences, or runs of at most
        ``max_tokens_per_micro_batch`` tokens, as many on every dp rank (the repeats it adds at the end
        are dropped here)."""
        packs = [self._pack(c) for c in common.chunks(samples, self.split)]
        if self.pp == 1:
            out = [x for b in packs for x in fn(b, self._forward(b))]
        else:
            results = self._pipeline(packs, lambda i, out, non_loss_data=True: fn(packs[i], out), forward_only=True)
            out = [x for r in self._from_last(results) for x in r]
        return out[: len(samples)]

    @staticmethod
    def _ids(b: Packed) -> torch.Tensor:
        assert isinstance(b.inputs, Full)
        return b.inputs.input_ids

    def _pipeline(self, packs: list[Packed], loss_func: Callable[..., object], forward_only: bool) -> list[Any]:
        """megatron-core's 1F1B schedule over ``packs`` (one micro-batch each): every stage runs its
        layers; the last calls ``loss_func(i, output)`` for micro-batch ``packs[i]`` and returns what
        it did, one item a micro-batch (forward-only: ``loss_func``'s result; training: the stats, the
        last of the triple it returns; the caller knows their type), the others nothing. Training:
        megatron backpropagates each micro-batch's loss as it is. The micro-batches may differ in
        shape (``variable_seq_lengths``: each activation's shape is sent before it), so a token
        budget's micro-batches need no common sequence length."""
        from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

        def step(data: Iterator[int], model: GPTModel | DistributedDataParallel,
                 ) -> tuple[torch.Tensor, partial[object]]:
            i = next(data)
            return self._forward(packs[i]), partial(loss_func, i)

        return forward_backward_pipelining_without_interleaving(
            forward_step_func=step, data_iterator=iter(range(len(packs))), model=self.net, num_microbatches=len(packs),
            seq_length=0, micro_batch_size=0, forward_only=forward_only, collect_non_loss_data=forward_only,
            p2p_communicator=self.p2p, pg_collection=self.pgc)

    def _from_last(self, obj: T) -> T:
        """The last pipeline stage's ``obj`` on every stage (tensors come back on this rank's device)."""
        box = [tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, obj) if self.last else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, box[0])

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self._each(samples, lambda b, out: unpack(
            algos.token_logprobs(self._select(b, out).float(), b.targets), b.lengths))

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample response-token values of the value head (the critic)."""
        return self._each(samples, lambda b, out: unpack(self._select(b, out)[..., 0].float(), b.lengths))

    @torch.no_grad()
    def scores(self, samples: list[Sample]) -> list[float]:
        """One score per sample from the reward head, read at the sequence's rightmost token that is not
        the model's pad token (transformers' sequence-classification pooling; the last position
        when the model names no pad token)."""
        return self._each(samples, self._pool)

    def _pool(self, b: Packed, out: torch.Tensor) -> list[float]:
        if isinstance(b.inputs, Flat):  # a packed row: each sequence's pooling position (``flat_sequences``)
            return out[0, b.inputs.keep, 0].float().tolist()
        ids = self._ids(b)
        per_token = out[..., 0].float()
        if self.pad_id is None:
            last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=ids.device)
        else:
            cols = torch.arange(ids.shape[1], device=ids.device)
            last = (cols * (ids != self.pad_id)).argmax(-1)
        return per_token[torch.arange(ids.shape[0], device=ids.device), last].tolist()

    # -- training -----------------------------------------------------------------------------
    def _loss(self, b: Packed, out: torch.Tensor, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on one micro-batch's final output: the policy's on log-probs, or the value
        objective (``ValueObjective``, ``head == "value"``) on the value head's output."""
        if isinstance(objective, ValueObjective):  # head == "value"
            return objective(ValueInput(self._select(b, out)[..., 0].float(), b.mask, b.fields))
        logits = self._select(b, out).float()
        logp = algos.token_logprobs(logits, b.targets)
        return objective(LossInput(logp, b.mask, b.token_advantages(), b.fields,
                                   logits if objective.needs_logits else None))

    def _backward(self, micro_batches: list[common.MicroBatch], totals: common.Totals) -> None:
        """Gradients of one update (``common.weighted_updates``): each micro-batch's loss divided by
        its ``divisor`` (``grad_accum``; under a token budget 1, the objective already the share of
        the whole mini-batch's aggregation, or inf for a rank's zero-loss repeat), its stats weighted
        by its ``weight``. Gradients are then averaged over dp, as weighted_updates assumes."""
        packs = [self._pack(m.samples) for m in micro_batches]
        if self.pp == 1:
            for b, m in zip(packs, micro_batches, strict=True):
                loss, stats = self._loss(b, self._forward(b), m.objective)
                (loss / m.divisor).backward()
                totals.add(stats, m.weight)
            return
        one = torch.ones((), dtype=torch.int, device=self.device)
        # The schedule backpropagates the loss as it is (calculate_per_token_loss), and megatron-core's
        # DDP then sums the gradients over dp instead of averaging them: the mean over dp is taken here.
        dp = dist.get_world_size(self.dp_group) if self.dist_opt is not None else 1

        def loss_func(i: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
            m = micro_batches[i]
            loss, stats = self._loss(packs[i], out, m.objective)
            return loss / (m.divisor * dp), one, stats

        results = self._pipeline(packs, loss_func, forward_only=False)
        if self.last:  # the other stages compute no loss
            for stats, m in zip(results, micro_batches, strict=True):
                totals.add(stats, m.weight)

    def _reduce_grads(self) -> None:
        """Average gradients over dp (each dp rank's loss is the mean over its own share). A routed
        expert under expert parallelism is held by the expert_dp ranks only, and its gradient on each
        already sums what the tokens of its ep peers sent it: summed over expert_dp, divided by d."""
        d = dist.get_world_size(self.dp_group)
        if d == 1:
            return
        dense, experts = self._grads()
        _sum_over([g for _, g in dense], self.dp_group, d)
        _sum_over(experts, self.edp_group, d)

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient the step reads for model parameter ``p``: its slot in megatron-core's DDP
        buffer (distributed optimizer), else its main weight's (``p.grad`` itself for fp32 weights)."""
        if self.dist_opt is not None:
            return p.main_grad  # type: ignore[attr-defined]
        assert self.main is not None
        return self.main.of[p].grad

    def _grads(self) -> tuple[list[tuple[torch.nn.Parameter, torch.Tensor]], list[torch.Tensor]]:
        """(parameter, gradient) of every parameter with one but the routed experts under expert
        parallelism, and the routed experts' gradients."""
        with_grad = [(p, g) for p in self.model.parameters() if (g := self._grad(p)) is not None]
        return [(p, g) for p, g in with_grad if not _routed(p)], [g for p, g in with_grad if _routed(p)]

    def _sync_tied(self) -> None:
        """A tied embedding split over pipeline stages: sum the gradients of its two copies (the first
        stage's lookup table, the last stage's output layer), so both take the same update. Before
        the reduction over dp: with the distributed optimizer each dp rank then holds only its
        slice of the buffer reduced, at other offsets on the two stages."""
        if self.lay.tied and self.pp > 1 and self.pgc.embd is not None:
            w = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(self._grad(w), group=self.pgc.embd)

    def _sync_sequence_parallel(self) -> None:
        """Under sequence parallelism each TP rank's norms (and MoE router) saw its slice of the
        sequence: sum their gradients over tp, so every rank holds the whole one."""
        if not self.sp:
            return
        grads = [self._grad(p) for p in self.model.parameters() if getattr(p, "sequence_parallel", False)]
        _sum_over([g for g in grads if g is not None], self.tp_group)

    def _sync_context_parallel(self) -> None:
        """Under context parallelism each cp rank's gradients are those of its own slice of the tokens
        (the same loss on every rank, its backward through this rank's slice only): sum them over cp."""
        if self.cp == 1:
            return
        _sum_over([g for p in self.model.parameters() if (g := self._grad(p)) is not None], self.cp_group)

    def _clip(self, max_norm: float) -> float:
        """Clip by the global norm: TP-split weights count each shard, replicated ones (norms) once,
        routed experts on the expert groups each expert tp x ep rank's, each pipeline stage its own (the last
        stage's copy of a tied embedding not again)."""
        params, experts = self._grads()
        split = [g for p, g in params if getattr(p, "tensor_model_parallel", False)]
        repl = [g for p, g in params if not getattr(p, "tensor_model_parallel", False)]
        counted = [g for p, g in params if getattr(p, "tensor_model_parallel", False) and not getattr(p, "shared", False)]
        sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros((), device=self.device)
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        if repl:
            sq = sq + torch.stack([g.float().pow(2).sum() for g in repl]).sum()
        if experts:  # each expert tp x ep rank's shards once
            own = torch.stack([g.float().pow(2).sum() for g in experts]).sum()
            dist.all_reduce(own, group=self.tp_ep_group)
            sq = sq + own
        if self.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(split + repl + experts, coef)
        return float(norm)

    def train(self, samples: list[Sample], objective: Objective) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` over this replica's share (the tp
        and pp peers of a replica receive the same samples), micro-batches by ``algo.grad_accum`` or
        by ``engine_args.max_tokens_per_micro_batch`` (``common.weighted_updates``: the loss exact
        under the split, as many micro-batches on every dp rank)."""
        assert self.optimizer is not None, "train() on a forward-only engine"
        a = self.algo
        totals = common.Totals(a.grad_accum)
        for micro_batches in common.weighted_updates(samples, a, objective, self.max_tokens, self.dp_group, self.device,
                                                     old_logprobs=self.logprobs):
            if self.dist_opt is not None:
                self.net.zero_grad_buffer()
                self.dist_opt.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=False)
            self._backward(micro_batches, totals)
            self._sync_tied()
            self._sync_sequence_parallel()
            self._sync_context_parallel()
            if self.dist_opt is not None:
                self.net.finish_grad_sync()  # reduce-scatter: each dp rank gets its slices' gradients, averaged over dp
                _, norm, _ = self.dist_opt.step()  # clips by the global norm, steps its slices, all-gathers the weights
                if a.grad_clip > 0:
                    totals.add({"grad_norm": float(norm)}, 1.0)
            else:
                self._reduce_grads()
                if a.grad_clip > 0:
                    totals.add({"grad_norm": self._clip(a.grad_clip)}, 1.0)
                self.optimizer.step()
                assert self.main is not None
                self.main.to_model()
            self.scheduler.step()
            totals.updates += 1
        result = totals.result(float(self.scheduler.get_last_lr()[0]))
        return result if self.pp == 1 else self._from_last(result)  # the loss stats are the last stage's

    # -- checkpoint ---------------------------------------------------------------------------
    def checkpoint_state(self) -> CheckpointState | None:
        """Weights and AdamW state as full HF-named plain tensors (``model.<hf>``, ``optim.<hf>.<key>``),
        the layout the fsdp engine's checkpoints have once resharded, so either loads the other's.
        Every rank of the role holds the same tensors; DCP writes each once."""
        if self.optimizer is None:
            return None
        with torch.no_grad():
            by_param = {p: n for n, p in self.params.items()}
            state = self.optimizer.state
            if self.dist_opt is not None:  # the fp32 main weights and moments, from every dp rank's slices
                full = megatron_optim.gather(self.net, self.dist_opt, self.dp_group)
                local = {key: {by_param[p]: full[p][key] for p in self.params.values()} for key in megatron_optim.STATE_KEYS}
            else:  # the fp32 main weights (the parameters themselves when fp32) and their moments
                assert self.main is not None
                mains = {n: self.main.of[p] for n, p in self.params.items()}
                local = {"param": mains} | {
                    key: {n: state[m][key] if key in state.get(m, {}) else torch.zeros_like(m) for n, m in mains.items()}
                    for key in ADAM_KEYS}
            tensors = {f"model.{n}": t.clone() for n, t in self._gather(local["param"]).items()}
            if self.lay.tied:  # a transformers state dict names the shared matrix twice
                tensors["model.lm_head.weight"] = tensors["model.model.embed_tokens.weight"]
            for key in ADAM_KEYS:
                tensors.update({f"optim.{n}.{key}": t.clone() for n, t in self._gather(local[key]).items()})
            step = next((s["step"] for s in state.values() if "step" in s), torch.zeros((), dtype=torch.float32))
            tensors.update({f"optim.{n}.step": step.detach().clone().float() for n in self.hf_names})
        group = self.optimizer.param_groups[0]
        meta = {"engine": "megatron", "param_groups": [{**{k: v for k, v in group.items()
                                                            if k != "params" and k not in MEGATRON_GROUP_KEYS},
                                                         "params": list(self.hf_names)}],
                "scheduler": self.scheduler.state_dict()}
        return CheckpointState(tensors, meta, self.group)

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        assert self.optimizer is not None, "load_checkpoint_state on a forward-only engine"
        t = state.tensors
        with torch.no_grad():
            main = self._load_full({n: t[f"model.{n}"] for n in self.hf_names})  # fp32: the main weights
            moments = {key: self._local({n: t[f"optim.{n}.{key}"] for n in self.hf_names}) for key in ADAM_KEYS}
            step = t[f"optim.{self.hf_names[0]}.step"]
            if self.dist_opt is not None:
                megatron_optim.scatter(self.dist_opt, {p: {"param": main[name], **{k: moments[k][name] for k in ADAM_KEYS}}
                                                       for name, p in self.params.items()}, step)
            else:
                assert self.main is not None
                self.main.load({p: main[name] for name, p in self.params.items()})
                for name, p in self.params.items():
                    m = self.main.of[p]
                    self.optimizer.state[m] = {"step": step.detach().clone().float().reshape(()),
                                               **{k: moments[k][name].clone().to(m) for k in ADAM_KEYS}}
        saved = state.meta["param_groups"][0]
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in saved.items() if k != "params"})
        if state.meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(state.meta["scheduler"])
