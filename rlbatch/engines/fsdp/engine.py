"""``fsdp`` training engine: FSDP2 (``fully_shard``) over the role's DeviceMesh, with DTensor tensor
parallelism on its tp axis at t > 1 (``rlbatch.engines.fsdp.tp``), or Ulysses context
parallelism on its cp axis at c > 1 (``rlbatch.engines.ulysses``: each packed row split over the c
ranks, FSDP sharding over dp x cp, the samples shared by the c ranks of a replica).

Also serves forward-only roles (reference): without an optimizer it only computes log-probs.
Parameter names are the transformers model's, i.e. Hugging Face names, so weight export and
checkpoint state need no renaming. AdamW, gradient clipping, linear warm-up, gradient accumulation and
activation checkpointing; bf16 compute with fp32 master weights on GPU, fp32 on CPU. A forward-only
role holds its parameters in the model's dtype (bf16 on GPU): it has no update to keep precise.

The model is built on the meta device, sharded, and only then given memory on the device: each rank
reads only its own rows of the weights (``rlbatch.engines.model.engine_skeleton``), so no rank
ever holds the whole model, on the host or on the device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlbatch.engines import training as common
from rlbatch.engines import ulysses
from rlbatch.engines.attention import prefer_varlen
from rlbatch.engines.base import CheckpointState, EngineContext, Sample, Unit, WeightStream, require_mesh
from rlbatch.engines.batch import Flat, Packed, pack, vision_of
from rlbatch.engines.defaults import (
    GPU_MAX_TOKENS_PER_MICRO_BATCH,
    fsdp_single_unit,
    max_tokens_per_micro_batch,
)
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp import tp as fsdp_tp
from rlbatch.engines.model import engine_skeleton, freeze_vision, model_dtype
from rlbatch.engines.offload import StashedState, Stashes, TensorStash, grad_tensors, optimizer_tensors
from rlbatch.engines.train_state import load_module_state, module_state
from rlbatch.models import lora
from rlbatch.models.weights import allocate

if TYPE_CHECKING:
    from rlbatch.engines.base import Objective


@torch.no_grad()
def _gathered(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter in full, in ``dtype``: a DTensor's local shard is cast first, then all-gathered."""
    t = p.detach().to(dtype)  # a DTensor casts its shard and keeps its placement
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model, inside PEFT's wrapper or not: ``model.layers``, or
    a vision-language model's ``model.language_model.layers`` (its vision tower stays in the root unit)."""
    base = lora.base_model(model)
    name = "model.language_model.layers" if hasattr(base.get_submodule("model"), "language_model") else "model.layers"
    return list(base.get_submodule(name).children())


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def held_dtype(model_dtype_name: str, device: torch.device, trainable: bool) -> torch.dtype:
    """The dtype an fsdp engine holds its parameters in: fp32 master weights for a role that trains
    (bf16 only for compute on a GPU, through the MixedPrecisionPolicy); the model's dtype for a
    forward-only one ('auto': bf16 on a GPU, fp32 on a CPU), which no optimizer updates."""
    return torch.float32 if trainable else model_dtype(model_dtype_name, device)


class _ShardArgs(TypedDict, total=False):
    """The arguments of ``fully_shard`` this engine sets."""

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool


class FSDPEngine(StashedState):
    """A role's model sharded with FSDP2 over its dp axis, split over its tp axis (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        mesh, algo = require_mesh(ctx.mesh, f"fsdp engine, role {ctx.role}"), ctx.algo
        args: FSDPArgs = ctx.args
        self.tp, self.cp = fsdp_tp.require_dp_tp(mesh)
        self.device, self.algo, self.tokenizer = ctx.device, algo, ctx.tokenizer
        self.micro_batch = int(args.micro_batch)
        self.lora = lora.of(ctx)
        if self.lora is not None and self.tp > 1 and float(self.lora.dropout) > 0:
            raise ValueError(f"fsdp engine, role {ctx.role}: model.lora.dropout {self.lora.dropout} under tensor parallel "
                             f"t = {self.tp}: the ranks would mask the adapters' whole inputs differently (fsdp_rules)")
        self.dp_group = ctx.group("dp")
        self.cp_group = ctx.group("cp") if self.cp > 1 else None
        held = held_dtype(str(ctx.model.dtype), ctx.device, ctx.trainable)
        skeleton = engine_skeleton(ctx, held)
        model = skeleton.model
        freeze_vision(model, bool(ctx.model.train_vision))  # a VLM's tower: no gradient, no optimizer state
        recompute = ctx.trainable and bool(algo.activation_checkpointing)
        if recompute:
            model.gradient_checkpointing_enable()
        # A value or reward model returns no KV cache to share a prompt's pass through (and a recomputed
        # layer would append its keys to a shared prompt's cache a second time).
        self.share_prompts = args.share_prompts and not recompute and ctx.head == "lm"
        self.max_tokens = max_tokens_per_micro_batch(args, ctx.device.type)
        if self.cp > 1:  # context parallelism splits packed rows (padded rows have no sample boundaries to keep)
            if getattr(args, "max_tokens_per_micro_batch", None) == 0:
                raise ValueError(f"fsdp engine, role {ctx.role}: context parallelism c = {self.cp} splits packed rows; "
                                 "engine_args.max_tokens_per_micro_batch=0 asks for padded ones")
            self.max_tokens = self.max_tokens or GPU_MAX_TOKENS_PER_MICRO_BATCH
        self.split = common.Split(self.micro_batch, self.max_tokens, self.dp_group, ctx.device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if ctx.device.type == "cuda" else None
        # FSDP shards over every rank of a replica's context-parallel group too (each holds distinct
        # parameter shards; the loss is scaled by c for FSDP's mean over them: ``train``)
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if self.cp > 1 else mesh["dp"]
        kwargs: _ShardArgs = {"mesh": shard_mesh}
        if mp:
            kwargs["mp_policy"] = mp
        self.mp = mp
        if self.cp > 1:  # attention over the whole row by all-to-alls (varlen inside where it exists)
            ulysses.use(model)
            self.varlen = False
        else:  # packed rows by their boundaries, not a dense mask, where the kernel exists (bf16 on CUDA)
            self.varlen = self.max_tokens > 0 and prefer_varlen(model, ctx.device, torch.bfloat16 if mp else held)
        # Tensor-parallel layers are units of their own: torch's FSDP2 + TP recipe, and a whole-model
        # unshard would gather only the dp shards of the split weights (export reads them one by one).
        self.single_unit = fsdp_single_unit(param_bytes(model), args.single_unit_max_mb) and self.tp == 1
        if self.tp > 1:
            cfg = model.config
            fsdp_tp.parallelize(_layers(model), mesh["tp"], int(cfg.num_attention_heads),
                                int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads))
        if not self.single_unit:
            for layer in _layers(model):  # a unit per layer: gathered one at a time, overlapping compute
                fully_shard(layer, **kwargs)
        # FSDP2 leaves the root unit (embedding, final norm, head) unsharded after a forward, for the
        # backward that follows in training; a forward-only role has none, so it would hold them
        # gathered until its next forward, on the device through other roles' phases (offload moves shards).
        root = kwargs.copy()
        if not ctx.trainable:
            root["reshard_after_forward"] = True
        fully_shard(model, **root)  # in place: ``model`` becomes an FSDP module (and is returned)
        assert isinstance(model, FSDPModule)
        self.model = model
        self.vision = vision_of(model)  # a vision-language model: samples' images reach its forward
        if self.tp > 1:  # 2-D shards: each rank's rows, then its columns
            allocate(model, ctx.device)
            fsdp_tp.materialise(model, skeleton.weights)
        else:
            skeleton.materialise(ctx.device)  # this rank's shard only, read by rows
        # A checkpoint is written by every rank holding a distinct shard: the tp and cp peers too.
        self.ckpt_group = fsdp_tp.role_group(ctx) if self.tp > 1 or self.cp > 1 else self.dp_group
        self.state = Stashes({"params": TensorStash("params", self.model.parameters)})
        self.optimizer: torch.optim.Optimizer | None = None
        if ctx.trainable:
            self.model.train()
            trained = [p for p in self.model.parameters() if p.requires_grad]  # with model.lora: the adapters
            self.optimizer = torch.optim.AdamW(trained, lr=algo.lr, weight_decay=algo.weight_decay,
                                               foreach=True)  # one dispatch per step, not one per DTensor
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, common.warmup(int(algo.warmup_steps)))
            opt = self.optimizer
            self.state.add("grads", TensorStash("grads", lambda: grad_tensors(self.model)))
            self.state.add("optimizer", TensorStash("optimizer", lambda: optimizer_tensors(opt)))
        else:
            self.model.eval()

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return common.logprobs(self.model, samples, self.split, self._pack)

    def base_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """With ``model.lora``: the log-probs of the base model, the adapters switched off (what the
        reference computes from its own copy of the base weights)."""
        assert self.lora is not None, "base_logprobs needs an engine with adapters (model.lora)"
        with lora.adapters_off(self.model):
            return common.logprobs(self.model, samples, self.split, self._pack)

    def _pack(self, chunk: list[Sample]) -> Packed:
        b = pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=self.share_prompts,
                 flat=self.max_tokens > 0, vision=self.vision)
        if self.cp_group is not None:  # this rank's slice of the row
            assert isinstance(b.inputs, Flat)
            b = dataclasses.replace(b, inputs=ulysses.split(b.inputs, self.cp_group))
        return b

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        return common.values(self.model, samples, self.split, self._pack)

    def scores(self, samples: list[Sample]) -> list[float]:
        cut = None if self.cp_group is None else functools.partial(ulysses.split, group=self.cp_group)
        return common.scores(self.model, samples, self.split, self._pack, self.model.get_submodule("score"), cut)

    def train(self, samples: list[Sample], objective: Objective) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` over this rank's share of the batch
        (``rlbatch.engines.training.updates``)."""
        assert self.optimizer is not None, "train() on a forward-only engine"
        a = self.algo
        totals = common.Totals(a.grad_accum)
        for micro_batches in common.weighted_updates(samples, a, objective, self.max_tokens, self.dp_group, self.device,
                                                     old_logprobs=self.logprobs):
            self.optimizer.zero_grad(set_to_none=False)
            for m in micro_batches:
                loss, stats = common.chunk_loss(self.model, self._pack(m.samples), m.objective)
                (loss * self.cp / m.divisor).backward()
                totals.add(stats, m.weight)
            if a.grad_clip > 0 and self.tp > 1:  # parameters on two meshes (dp x tp, dp): torch's refuses
                totals.add({"grad_norm": fsdp_tp.clip_grad_norm(list(self.model.parameters()), a.grad_clip)}, 1.0)
            elif a.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
                total_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                totals.add({"grad_norm": float(total_norm)}, 1.0)
            self.optimizer.step()
            self.scheduler.step()
            totals.updates += 1
        return totals.result(float(self.scheduler.get_last_lr()[0]))

    @contextmanager
    def export_weights(self) -> Iterator[WeightStream]:
        """The weights under their Hugging Face names, streamed one FSDP unit at a time
        (``WeightStream``; the manifest's shapes are the DTensors' global ones, nothing is gathered
        for it). Each parameter's shard is cast to the dtype asked for, then all-gathered on its own
        (``full_tensor``). A model that is one unit, asked for in the dtype its all-gather moves (the
        parameters', or bf16 under mixed precision: FSDP casts each shard first), is all-gathered in one
        collective (``unshard``) and read in place instead: a small model's sync costs one collective's
        latency, not one per parameter. A larger unit is not: FSDP's unshard copies it through one flat
        buffer (held beside the unit) at a cost above the collectives it saves (docs/benchmarks.md)."""
        # A forward without backward leaves the root unit unsharded (FSDP keeps it for the backward):
        # reshard it (local, no collective) so the parameters read here are the fp32 DTensor shards.
        self.model.reshard()
        units = self._export_units()
        names = [(n, p.shape) for _, params in units for n, p in params]
        stream = WeightStream(names, lambda dtype: self._export(units, dtype))
        if self.lora is not None:  # adapters merged into their base weights, under the base names
            stream = stream.merged(self.lora)
        with closing(stream):  # the stream's gathers end with the sync, or with its error
            yield stream

    @contextmanager
    def export_adapters(self) -> Iterator[WeightStream]:
        """With ``model.lora``: the adapters alone, under PEFT's saved names (``lora.adapter_name``),
        for an inference engine that keeps the base weights and loads adapters
        (``EngineSpec.loads_adapters``). Streamed one FSDP unit's adapters at a time, each adapter's
        shard cast and all-gathered on its own: the base weights are never gathered."""
        assert self.lora is not None, "export_adapters needs an engine with adapters (model.lora)"
        self.model.reshard()  # as in export_weights: read the sharded parameters
        units = [run for _, params in self._export_units()
                 if (run := [(a, p) for n, p in params if (a := lora.adapter_name(n)) is not None])]
        stream = WeightStream([(a, p.shape) for run in units for a, p in run],
                              lambda dtype: ([(a, _gathered(p, dtype or p.dtype)) for a, p in run] for run in units))
        with closing(stream):  # the stream's gathers end with the sync, or with its error
            yield stream

    def _export_units(self) -> list[tuple[FSDPModule, list[tuple[str, torch.nn.Parameter]]]]:
        """Runs of consecutive parameters (``named_parameters`` order) sharded by one FSDP unit: the whole
        model when it is one unit; else the root's embedding, each decoder layer, the root's final norm."""
        units = {prefix: m for prefix, m in self.model.named_modules() if isinstance(m, FSDPModule)}

        def owner(name: str) -> str:  # the innermost unit holding the parameter ("" is the root)
            parts = name.split(".")
            return next(".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1) if ".".join(parts[:k]) in units)

        return [(units[prefix], list(run)) for prefix, run in itertools.groupby(self.model.named_parameters(),
                                                                                  key=lambda np: owner(np[0]))]

    def _export(self, units: list[tuple[FSDPModule, list[tuple[str, torch.nn.Parameter]]]],
                dtype: torch.dtype | None) -> Iterator[Unit]:
        # No torch.no_grad() decorator here: on a generator it keeps the last unit it yielded while the
        # next one is gathered (two units alive); each gather below needs no autograd anyway.
        for unit, params in units:
            want = dtype or params[0][1].dtype
            gathers = self.mp.param_dtype if self.mp is not None and self.mp.param_dtype else params[0][1].dtype
            if len(units) == 1 and want == gathers:
                with torch.no_grad():
                    unit.unshard()  # one all-gather; the module's parameters are the unsharded ones until reshard
                try:
                    yield [(n, self.model.get_parameter(n).detach()) for n, _ in params]
                finally:
                    unit.reshard()
            else:
                yield [(n, _gathered(p, want)) for n, p in params]

    def checkpoint_state(self) -> CheckpointState | None:
        """Model and AdamW state as named tensors (see ``rlbatch.engines.train_state``); None
        when forward-only."""
        if self.optimizer is None:
            return None
        return module_state(self.model, self.optimizer, self.scheduler, self.ckpt_group, "fsdp",
                            trained_only=self.lora is not None)

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        assert self.optimizer is not None, "load_checkpoint_state on a forward-only engine"
        load_module_state(self.model, self.optimizer, self.scheduler, state, trained_only=self.lora is not None)
