"""``deepspeed`` training engine: DeepSpeed ZeRO stage 1, 2 or 3 over the role's dp group.

    python -m rlbatch.launch roles.actor_train.backend=deepspeed:d2

DeepSpeed runs on the role's ranks only, whatever the rest of the job does: its data-parallel
group is the role's (an ``mpu`` object hands it over) and every collective it would issue on
the global world runs on the role's group instead (``rlbatch.engines.deepspeed.world``).

The optimizer is torch's AdamW given to DeepSpeed as a client optimizer, so no DeepSpeed op is
compiled: DeepSpeed's fused/CPU Adam and its shared-memory all-reduce are JIT-built C++ (g++,
ninja, about a minute), and the shared-memory all-reduce serves only DeepSpeed inference's
tensor-parallel all-reduce, which training never calls, so it is not built. ZeRO-Offload
(``offload_optimizer``, ``offload_params``) keeps the fp32 master weights and the AdamW state
in host memory and steps them there with the same torch AdamW.

Update schedule, loss, LR warm-up and gradient clipping are those of the fsdp engine
(``rlbatch.engines.training``); bf16 compute with fp32 master weights on GPU, fp32 on CPU.
Checkpoint state is full (gathered) fp32 tensors under the fsdp engine's names, so either
engine resumes from the other's checkpoint. Forward-only roles (reference) are the plain model
in the same compute dtype, bf16 on GPU (ZeRO-3: partitioned, gathered layer by layer on forward).

With ``model.lora`` the trained policy is the model adapted as the fsdp engine adapts it
(``rlbatch.engines.model.engine_skeleton``, the same adapters from the same seed): only the
adapters require grad, so only they are in the optimizer (and in ZeRO's fp32 master partitions);
the frozen base stays in the compute dtype (bf16 on GPU, partitioned under ZeRO-3). The weight sync
is merged (``WeightStream.merged``), the checkpoint holds the adapters and their
AdamW state only, and ``base_logprobs`` is the base model's (the adapters switched off).

A vision-language policy (``model.arch=qwen2_vl|qwen2_5_vl``, ``rlbatch.models.vlm``) trains with its
samples' images as the fsdp engine does (``rlbatch.engines.batch.pack`` with the model's ``vision_of``:
images to the forward, [4, 1, N] multimodal positions in packed rows). Its vision tower is frozen
unless ``model.train_vision`` (``freeze_vision``): no gradient, no optimizer state, no fp32 master
copy; ZeRO-3 still partitions it. The checkpoint holds the frozen tower's weights beside the trained
parameters (as the fsdp engine's), the weight sync streams it as its own units.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlbatch.engines import training as common
from rlbatch.engines.attention import prefer_varlen
from rlbatch.engines.base import CheckpointState, EngineContext, Sample, Unit, WeightStream, layer_units, require_mesh
from rlbatch.engines.batch import Packed, pack, vision_of
from rlbatch.engines.deepspeed.world import import_deepspeed, role_world
from rlbatch.engines.defaults import max_tokens_per_micro_batch
from rlbatch.engines.model import VISION_PREFIX, engine_skeleton, freeze_vision, load_engine_model
from rlbatch.engines.offload import StashedState, Stashes, TensorStash
from rlbatch.engines.train_state import param_groups_meta
from rlbatch.models import lora

if TYPE_CHECKING:
    from peft import PeftModel
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel

    from rlbatch.config.schema import AlgoConfig
    from rlbatch.engines.base import Objective
    from rlbatch.engines.deepspeed import DeepSpeedArgs

ZeroEngine = Any  # untyped library
"""``deepspeed.initialize``'s engine (``deepspeed.DeepSpeedEngine``, a ``torch.nn.Module`` around the
role's model): what rlbatch calls of it is its forward, ``module``, ``optimizer`` (ZeRO's), ``backward``,
``step``, ``set_gradient_accumulation_boundary`` and ``get_global_grad_norm``."""

ZeroParameter = Any  # untyped library
"""A ``torch.nn.Parameter`` of a model under DeepSpeed, with the attributes ZeRO-3 gives it: ``ds_tensor``
(this rank's partition), ``ds_numel`` and ``ds_shape`` (the whole parameter's)."""

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


class RoleMPU:
    """The ``mpu`` DeepSpeed asks its groups from: the role's dp group, no model parallelism."""

    def __init__(self, dp: ProcessGroup, single: ProcessGroup) -> None:
        self.dp, self.single = dp, single

    def get_data_parallel_group(self) -> ProcessGroup:
        return self.dp

    def get_data_parallel_world_size(self) -> int:
        return int(dist.get_world_size(self.dp))

    def get_data_parallel_rank(self) -> int:
        return int(dist.get_rank(self.dp))

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.single

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def compute_dtype(device: torch.device) -> torch.dtype:
    """What a role's model computes in: bf16 on a GPU (DeepSpeed's bf16 mode; a trainable role keeps
    fp32 master weights beside it), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def plain_module(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A forward-only role under ZeRO-1/2, which would shard nothing it holds: the module itself on
    ``device`` in the compute dtype (as a trainable role computes its log-probs), not DeepSpeed's
    engine."""
    return model.to(device=device, dtype=compute_dtype(device)).eval()


def ds_config(args: DeepSpeedArgs, algo: AlgoConfig, device: torch.device, trainable: bool) -> dict[str, object]:
    """The DeepSpeed config of a role. Gradient accumulation is driven by the engine (one optimizer
    step per update of ``common.updates``), so DeepSpeed's own is 1."""
    zero: dict[str, object] = {"stage": int(args.zero_stage)}
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    if args.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    cfg: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": compute_dtype(device) == torch.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if trainable:
        cfg["gradient_clipping"] = float(algo.grad_clip)
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the host partitions under offload
    return cfg


def host_model(ctx: EngineContext) -> PreTrainedModel | PeftModel:
    """The role's model whole on the host in fp32. A trained policy with ``model.lora`` comes from
    ``engine_skeleton`` (where the adapters are applied, seeded by name as every engine's are),
    filled on the host; any other model from ``load_engine_model`` (the same tensors)."""
    if lora.of(ctx) is None:
        model: PreTrainedModel | PeftModel = load_engine_model(ctx)
    else:
        sk = engine_skeleton(ctx)
        sk.materialise(torch.device("cpu"))
        model = sk.model
    freeze_vision(model, bool(ctx.model.train_vision))  # a VLM's tower: no gradient, no optimizer state
    return model


VLM_LAYERS = ("model.language_model.layers.", f"{VISION_PREFIX}blocks.")
"""Where a vision-language model keeps its decoder layers and its vision tower's blocks."""


def export_units(names: list[str]) -> list[list[str]]:
    """``layer_units`` of a model's parameter names, PEFT-wrapped or not: an adapter streams in the unit
    of the layer it adapts, beside the weight it is merged into. A vision-language model's decoder
    layers and vision blocks are units one by one too (``VLM_LAYERS``)."""
    inner = {lora.unwrapped(n): n for n in names}

    def layer(name: str) -> str | None:
        prefix = next((p for p in VLM_LAYERS if name.startswith(p)), None)
        return None if prefix is None else prefix + name[len(prefix):].split(".")[0]

    if not any(layer(n) for n in inner):
        return [[inner[n] for n in unit] for unit in layer_units(list(inner))]
    return [[inner[n] for n in run] for _, run in itertools.groupby(inner, key=layer)]


class DeepSpeedEngine(StashedState):
    """A role's model under DeepSpeed ZeRO on the role's ranks (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        mesh, algo, args = ctx.mesh, ctx.algo, ctx.args
        common.require_data_parallel(require_mesh(mesh, ctx.role), "deepspeed")
        if int(args.zero_stage) not in (1, 2, 3):
            raise ValueError(f"deepspeed engine: engine_args.zero_stage must be 1, 2 or 3, got {args.zero_stage}")
        deepspeed = import_deepspeed()
        # DeepSpeed takes its device from LOCAL_RANK (and reads it in its ZeRO checks): the rank's own
        # GPU, whatever the launcher or the job's environment exported.
        os.environ["LOCAL_RANK"] = str(ctx.device.index or 0)
        self.device, self.algo, self.tokenizer = ctx.device, algo, ctx.tokenizer
        self.micro_batch, self.stage = int(args.micro_batch), int(args.zero_stage)
        self.group = ctx.group("dp")
        self.lora = lora.of(ctx)
        model = host_model(ctx)
        recompute = ctx.trainable and bool(algo.activation_checkpointing)
        if recompute:
            model.gradient_checkpointing_enable()
        # A value or reward model returns no KV cache to share a prompt's pass through (and a recomputed
        # layer would append its keys to a shared prompt's cache a second time).
        self.share_prompts = args.share_prompts and not recompute and ctx.head == "lm"
        self.max_tokens = max_tokens_per_micro_batch(args, ctx.device.type)
        self.split = common.Split(self.micro_batch, self.max_tokens, self.group, ctx.device)
        # packed rows by their boundaries, not a dense mask, where the kernel exists (bf16 on CUDA)
        self.varlen = self.max_tokens > 0 and prefer_varlen(model, ctx.device, compute_dtype(ctx.device))
        self.names = [n for n, _ in model.named_parameters()]
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.engine: ZeroEngine  # or, forward-only under ZeRO-1/2, the plain module (``plain_module``)
        config = ds_config(args, algo, ctx.device, ctx.trainable)
        mpu = RoleMPU(self.group, ctx.group("tp"))
        # DeepSpeed gets the model on the host: it casts it to the compute dtype parameter by parameter,
        # then moves it to its device (LOCAL_RANK's). Moved there first, the whole model would sit on
        # the GPU in fp32 (4 bytes a parameter, left in PyTorch's cache after the cast) before ZeRO
        # casts or partitions it.
        with role_world(self.group):
            if ctx.trainable:
                model.train()
                trained = [p for p in model.parameters() if p.requires_grad]  # with model.lora: the adapters
                self.optimizer = torch.optim.AdamW(trained, lr=algo.lr, weight_decay=algo.weight_decay, foreach=True)
                self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, common.warmup(int(algo.warmup_steps)))
                self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config, mpu=mpu,
                                                       dist_init_required=False)
            elif self.stage == 3:
                model.eval()
                self.engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, dist_init_required=False)
            else:
                self.engine = plain_module(model, ctx.device)
        self.module: torch.nn.Module = self.engine.module if hasattr(self.engine, "module") else self.engine
        self.params = [p for _, p in self.module.named_parameters()]
        # Checkpoint names are the module's state_dict keys, as the fsdp engine writes them: a tied
        # weight (lm_head = embed_tokens) appears under both names; optimizer state once, by parameter.
        # Only trained parameters: with model.lora the frozen base is rebuilt from its source, not saved.
        self.trained = [(n, p) for n, p in zip(self.names, self.params, strict=True) if p.requires_grad]
        by_id = {id(p): p for _, p in self.trained}
        self.model_keys = [(k, by_id[id(v)]) for k, v in self.module.state_dict(keep_vars=True).items()
                           if id(v) in by_id]
        # Frozen parameters that are not rebuilt from the model's source (a VLM's frozen vision tower
        # without model.lora): saved as the fsdp engine saves them, from the compute copy (their only one).
        frozen = {id(p): p for p in self.params if not p.requires_grad} if self.lora is None else {}
        self.frozen_keys = [(k, frozen[id(v)]) for k, v in self.module.state_dict(keep_vars=True).items()
                            if id(v) in frozen]
        self.vision = vision_of(self.module)  # a vision-language model: samples' images reach its forward
        self.state = Stashes({"params": TensorStash("params", self._param_tensors)})
        if self.optimizer is not None:
            self.state.add("optimizer", TensorStash("optimizer", self._optimizer_tensors))

    # -- state by kind (StashedState: state_kinds, offload, reload) --------------------------------

    def _param_tensors(self) -> Iterator[torch.Tensor]:
        """The module's weights: the local partition of each under ZeRO-3, else the parameter (under
        ZeRO-1/2 a view into DeepSpeed's flat buffer, moved whole)."""
        for p in self.params:
            ds_tensor: torch.Tensor | None = getattr(p, "ds_tensor", None)
            yield p if ds_tensor is None else ds_tensor

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """The fp32 master partitions and the AdamW state of them."""
        zero = self.engine.optimizer
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            yield from getattr(zero, name, [])
        assert self.optimizer is not None
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    yield v

    # -- forward and training -----------------------------------------------------------------------
    def _pack(self, chunk: list[Sample]) -> Packed:
        return pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=self.share_prompts,
                    flat=self.max_tokens > 0, vision=self.vision)

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        with role_world(self.group):
            return common.logprobs(self.engine, samples, self.split, self._pack)

    def base_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """With ``model.lora``: the log-probs of the base model, the adapters switched off (what the
        reference computes from its own copy of the base weights)."""
        assert self.lora is not None, "base_logprobs needs an engine with adapters (model.lora)"
        with lora.adapters_off(self.module), role_world(self.group):
            return common.logprobs(self.engine, samples, self.split, self._pack)

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        with role_world(self.group):
            return common.values(self.engine, samples, self.split, self._pack)

    def scores(self, samples: list[Sample]) -> list[float]:
        with role_world(self.group):
            return common.scores(self.engine, samples, self.split, self._pack, self.engine.module.score)

    def train(self, samples: list[Sample], objective: Objective) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` (``common.updates``): DeepSpeed
        reduces the gradients at the last micro-batch of each update, clips them and steps."""
        assert self.optimizer is not None and self.scheduler is not None, "train() on a forward-only engine"
        a = self.algo
        totals = common.Totals(a.grad_accum)
        with role_world(self.group):
            for micro_batches in common.weighted_updates(samples, a, objective, self.max_tokens, self.group, self.device,
                                                         old_logprobs=self.logprobs):
                for i, m in enumerate(micro_batches):
                    self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
                    loss, stats = common.chunk_loss(self.engine, self._pack(m.samples), m.objective)
                    self.engine.backward(loss / m.divisor, scale_wrt_gas=False)
                    totals.add(stats, m.weight)
                self.engine.step()
                if a.grad_clip > 0:
                    norm = self.engine.get_global_grad_norm()
                    totals.add({"grad_norm": float(norm) if norm is not None else 0.0}, 1.0)
                self.scheduler.step()
                totals.updates += 1
        return totals.result(float(self.scheduler.get_last_lr()[0]))

    # -- weights out ----------------------------------------------------------------------------------
    @contextmanager
    def export_weights(self) -> Iterator[WeightStream]:
        """The weights under their Hugging Face names, streamed one decoder layer at a time
        (``WeightStream``). Under ZeRO-3 each parameter is all-gathered from its partitions over the
        role's ranks, each partition cast first; under ZeRO-1/2 every rank holds the parameters whole,
        so they leave as they are (a cast copies one layer at a time). With ``model.lora``: each layer's
        adapted weights merged, under the base model's names."""
        manifest, produce = self._source([[(n, n) for n in unit] for unit in export_units(self.names)])
        stream = WeightStream(manifest, produce)
        if self.lora is not None:
            stream = stream.merged(self.lora)
        with closing(stream):  # the stream's gathers end with the sync, or with its error
            yield stream

    @contextmanager
    def export_adapters(self) -> Iterator[WeightStream]:
        """With ``model.lora``: the adapters alone, under PEFT's saved names (``lora.adapter_name``),
        for an inference engine that keeps the base weights and loads adapters
        (``EngineSpec.loads_adapters``): one decoder layer's adapters at a time, the base weights never
        gathered."""
        assert self.lora is not None, "export_adapters needs an engine with adapters (model.lora)"
        units = [run for unit in export_units(self.names)
                 if (run := [(a, n) for n in unit if (a := lora.adapter_name(n)) is not None])]
        stream = WeightStream(*self._source(units))
        with closing(stream):  # the stream's gathers end with the sync, or with its error
            yield stream

    def _source(self, units: list[list[tuple[str, str]]]) -> tuple[list[tuple[str, torch.Size]],
                                                                     Callable[[torch.dtype | None], Iterator[Unit]]]:
        """A ``WeightStream``'s manifest and units of ``units``, lists of (name it leaves under, parameter
        name): each parameter whole, in the dtype asked for (``_exported``)."""
        zero3 = self.stage == 3 and self.engine is not self.module
        params: dict[str, ZeroParameter] = dict(zip(self.names, self.params, strict=True))
        manifest = [(out, torch.Size(params[n].ds_shape) if zero3 else params[n].shape) for unit in units for out, n in unit]

        def produce(dtype: torch.dtype | None) -> Iterator[Unit]:
            for unit in units:
                yield [(out, self._exported(params[n], dtype, zero3)) for out, n in unit]

        return manifest, produce

    @torch.no_grad()
    def _exported(self, p: ZeroParameter, dtype: torch.dtype | None, zero3: bool) -> torch.Tensor:
        if not zero3:
            return p.detach() if dtype is None else p.detach().to(dtype)
        # ZeRO-3 keeps rank r's partition as elements [r*n, (r+1)*n) of the flattened parameter, the last
        # one padded: gathered in rank order and cut to ds_numel, they are the parameter.
        part = p.ds_tensor.detach().to(self.device, dtype or p.ds_tensor.dtype)  # on the host under offload_params
        flat = torch.empty(part.numel() * dist.get_world_size(self.group), dtype=part.dtype, device=self.device)
        dist.all_gather_into_tensor(flat, part, group=self.group)
        return flat[: p.ds_numel].view(p.ds_shape)

    # -- checkpoint state -----------------------------------------------------------------------------
    def _ensure_optimizer_state(self) -> None:
        """Create the AdamW state of a fresh optimizer (zeros, step 0: what AdamW's first step creates)
        and link it to the parameters, so there is state to read into or to save."""
        assert self.optimizer is not None
        zero = self.engine.optimizer
        masters = [*getattr(zero, "single_partition_of_fp32_groups", []), *getattr(zero, "fp32_partitioned_groups_flat", [])]
        for p in masters:
            state = self.optimizer.state[p]
            if "exp_avg" not in state:
                state.update({"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()

    def _step(self) -> torch.Tensor:
        assert self.optimizer is not None
        steps = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return torch.as_tensor(steps[0] if steps else 0.0, dtype=torch.float32).clone()

    def checkpoint_state(self) -> CheckpointState | None:
        """Full fp32 weights and AdamW state per Hugging Face name (``model.<name>``,
        ``optim.<name>.{exp_avg,exp_avg_sq,step}``) of the trained parameters (with ``model.lora``: the
        adapters only), and the weights alone of frozen ones that are not rebuilt from the model's
        source (a vision-language model's frozen tower without ``model.lora``), gathered on every rank
        of the role: plain tensors, written once by DCP. None when forward-only."""
        if self.optimizer is None:
            return None
        assert self.scheduler is not None  # built with the optimizer
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        tensors: dict[str, torch.Tensor] = {}
        with role_world(self.group):
            self._ensure_optimizer_state()
            step = self._step()
            for key, p in self.model_keys:
                tensors[f"model.{key}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
            zero3 = self.stage == 3 and self.engine is not self.module
            for key, p in self.frozen_keys:
                tensors[f"model.{key}"] = self._exported(p, torch.float32, zero3).cpu().clone()
            for name, p in self.trained:
                for key in ADAM_KEYS:
                    tensors[f"optim.{name}.{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
                tensors[f"optim.{name}.step"] = step.clone()
        meta = {"engine": "deepspeed", "param_groups": param_groups_meta(self.optimizer, [n for n, _ in self.trained]),
                "scheduler": self.scheduler.state_dict()}
        return CheckpointState(tensors, meta, self.group)

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        """Set the weights (master and compute copies), the AdamW state and step, the LR schedule."""
        assert self.optimizer is not None and self.scheduler is not None, (
            "load_checkpoint_state on a forward-only engine")
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        t = state.tensors
        with torch.no_grad(), role_world(self.group):
            self._ensure_optimizer_state()
            for key, p in self.model_keys:
                full = t[f"model.{key}"].to(self.device)
                safe_set_full_fp32_param(p, full)
                self._set_compute_weight(p, full)
            for key, p in self.frozen_keys:
                self._set_compute_weight(p, t[f"model.{key}"].to(self.device))
            for name, p in self.trained:
                for key in ADAM_KEYS:
                    safe_set_full_optimizer_state(p, t[f"optim.{name}.{key}"].to(self.device), key)
            step = float(t[f"optim.{self.trained[0][0]}.step"])
            for s in self.optimizer.state.values():
                s["step"].fill_(step)
        hyper = state.meta.get("param_groups") or []
        for group, saved in zip(self.optimizer.param_groups, hyper, strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if state.meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(state.meta["scheduler"])

    def _set_compute_weight(self, p: torch.Tensor, full: torch.Tensor) -> None:
        """The copy forward reads: the partition under ZeRO-3, the whole parameter under ZeRO-1/2."""
        ds_tensor = getattr(p, "ds_tensor", None)
        if ds_tensor is None:
            p.data.copy_(full.to(p.dtype))
            return
        flat = full.reshape(-1).to(ds_tensor.dtype)
        part = ds_tensor.numel()
        start = dist.get_rank(self.group) * part
        n = max(0, min(part, flat.numel() - start))
        ds_tensor.data[:n].copy_(flat[start : start + n])
