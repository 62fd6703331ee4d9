"""The ``megatron`` engine's optimizers: fp32 main weights beside 16-bit model weights
(``MainWeights``, with torch AdamW on every rank), or megatron-core's distributed optimizer
(``engine_args.distributed_optimizer``).

A bf16 weight holds 8 bits of mantissa: an AdamW update smaller than ~2^-9 of the weight (at RL
learning rates, ~1e-6, nearly every update) rounds away when applied to it. Both optimizers
therefore step fp32 main weights, accumulate and reduce fp32 gradients, and copy the weights
back to the model rounded; the checkpoint holds the fp32 main weights.

megatron-core's ``DistributedDataParallel`` puts every parameter and gradient in contiguous buffers;
its ``DistributedOptimizer`` gives each data-parallel rank one contiguous 1/d of each buffer to
own: the fp32 main weights and AdamW's moments of that slice only (so optimizer state per rank is
divided by d), gradients reduce-scattered into the slices, updated weights all-gathered back.

Built over the role's own groups, without ``get_megatron_optimizer`` (whose parameter-group set-up
runs an ``all_gather_object`` over the whole job, which ranks outside the role never join):
the torch AdamW and the ``DistributedOptimizer`` are constructed here directly.

Checkpoints stay plain full tensors (``rlbatch.engines.train_state``'s names): ``gather`` rebuilds
each parameter's main weight and moments from the dp slices (an all-gather of each bucket, exact),
``scatter`` writes a full tensor back into this rank's slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # megatron-core has no type information (mypy cannot check its objects): its classes name them here.
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed import ProcessGroup

    from rlbatch.config.schema import AlgoConfig

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""Per parameter: the main (fp32) weight and AdamW's two moments."""


class MainWeights:
    """fp32 main weights of a model's parameters, the ones torch AdamW steps: a copy of each 16-bit
    parameter, the parameter itself when it is fp32 (then nothing changes). A 16-bit parameter's
    gradient is added into its main weight's fp32 ``.grad`` as soon as backward has produced it
    (and dropped), so micro-batches accumulate, and the engine reduces and clips, in fp32."""

    def __init__(self, params: Iterable[tuple[str, torch.nn.Parameter]], initial: dict[str, torch.Tensor]) -> None:
        """``initial``: the weights by name in fp32 (this rank's shards of the HF model's), which
        the model's 16-bit copies hold rounded."""
        self.of: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for name, p in params:
            if p.dtype == torch.float32:
                self.of[p] = p
                continue
            main = torch.nn.Parameter(initial[name].detach().to(device=p.device, dtype=torch.float32, copy=True))
            p.register_post_accumulate_grad_hook(partial(_accumulate, main))
            self.of[p] = main
            self.pairs.append((p, main))

    def copies(self) -> list[torch.Tensor]:
        """The fp32 copies (not the fp32 parameters that are their own main weights)."""
        return [m for _, m in self.pairs]

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.of.values() if m.grad is not None]

    @torch.no_grad()
    def to_model(self) -> None:
        """The model's 16-bit weights from the main weights, rounded to nearest."""
        if self.pairs:
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    @torch.no_grad()
    def load(self, weights: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Set the main weights (fp32, exact) and the model's from them."""
        for p, w in weights.items():
            self.of[p].copy_(w)
        self.to_model()


@torch.no_grad()
def _accumulate(main: torch.Tensor, p: torch.Tensor) -> None:
    if p.grad is None:
        return
    if main.grad is None:
        main.grad = p.grad.float()
    else:
        main.grad.add_(p.grad)
    p.grad = None


def build(model: GPTModel, pgc: ProcessGroupCollection, algo: AlgoConfig, role_group: ProcessGroup,
          dtype: torch.dtype) -> tuple[DistributedDataParallel, DistributedOptimizer]:
    """(DDP-wrapped model, DistributedOptimizer) over ``pgc.dp``, clipping at ``algo.grad_clip``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model, pg_collection=pgc)
    params = [p for p in ddp.parameters() if p.requires_grad]
    group = {"params": params, "is_expert_parallel": False, "default_config": True, "wd_mult": 1.0,
             "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": float(algo.lr), "min_lr": 0.0}
    adamw = torch.optim.AdamW([group], lr=float(algo.lr), weight_decay=float(algo.weight_decay))
    config = OptimizerConfig(optimizer="adam", lr=float(algo.lr), weight_decay=float(algo.weight_decay),
                             clip_grad=float(algo.grad_clip), bf16=dtype == torch.bfloat16, params_dtype=dtype,
                             use_distributed_optimizer=True)
    optimizer = DistributedOptimizer(adamw, config, None, None, model_chunks=[ddp], per_model_buffers={0: ddp.buffers},
                                     data_parallel_group=pgc.dp, data_parallel_group_gloo=None,
                                     data_parallel_group_idx=0, distributed_optimizer_instance_id=0)
    # The gradient norm sums every rank's slices (dp) and every TP shard; weights replicated over tp
    # (norms, a scalar head) count on tp rank 0 only.
    optimizer.grad_stats_parallel_group = role_group
    optimizer.tp_group, optimizer.expert_tp_group = pgc.tp, pgc.tp
    return ddp, optimizer


def _slice(optimizer: DistributedOptimizer, p: torch.nn.Parameter, key: str) -> torch.Tensor | None:
    """This rank's slice of parameter ``p``'s main weight or moment (None: no state yet)."""
    return optimizer._get_main_param_and_optimizer_states(p).get(key)


def state_tensors(optimizer: DistributedOptimizer) -> list[torch.Tensor]:
    """The device tensors the optimizer owns (offload kind 'optimizer'): AdamW's moments and the fp32
    main weights kept beside 16-bit model weights. fp32 model weights are their own main weights
    (views into the model's buffer), which 'params' moves."""
    out = [v for s in optimizer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    for group in getattr(optimizer, "shard_fp32_from_float16_groups", []):
        out += [p for p in group if p is not None]
    return out


def gather(ddp: DistributedDataParallel, optimizer: DistributedOptimizer,
           dp_group: ProcessGroup) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Every model parameter's full main weight and moments (this TP rank's shape), from the dp
    slices: one all-gather per bucket and key. Collective over dp. Missing state reads as zeros."""
    d = dist.get_world_size(dp_group)
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for gi, buffer in enumerate(ddp.buffers):
        ranges = next(iter(optimizer.gbuf_ranges[gi].values()))
        for bi, bucket in enumerate(buffer.buckets):
            size = bucket.grad_data.numel() // d
            owned = ranges[bi]["param_map"]
            for key in STATE_KEYS:
                local = torch.zeros(size, dtype=torch.float32, device=bucket.grad_data.device)
                for p, r in owned.items():
                    t = _slice(optimizer, p, key)
                    if t is not None:
                        local[r["gbuf_local"].start : r["gbuf_local"].end] = t.detach().reshape(-1).float()
                full = torch.empty(size * d, dtype=torch.float32, device=local.device)
                dist.all_gather_into_tensor(full, local, group=dp_group)
                for p, (start, end, bucket_id) in buffer.param_index_map.items():
                    if bucket_id == bi:
                        piece = full[start - bucket.offset : end - bucket.offset].view(p.shape).clone()
                        out.setdefault(p, {})[key] = piece
    return out


def _main_slice(optimizer: DistributedOptimizer, p: torch.nn.Parameter) -> tuple[torch.Tensor, slice] | None:
    """This rank's fp32 main weight of parameter ``p`` and where it lies in ``p`` flattened (None:
    no slice on this rank)."""
    if p not in optimizer.model_param_group_index_map:
        return None
    r = optimizer._get_model_param_range_map(p)["param"]
    gi, order = optimizer.model_param_group_index_map[p]
    return optimizer.optimizer.param_groups[gi]["params"][order], slice(r.start, r.end)


@torch.no_grad()
def set_main(optimizer: DistributedOptimizer, weights: dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """Set this rank's slice of each parameter's main weight from the full fp32 tensor (this TP
    rank's shape) and the model's weights of that slice from it. The optimizer makes its main
    weights from the (16-bit) model weights; this puts the exact ones in their place."""
    for p, w in weights.items():
        if (own := _main_slice(optimizer, p)) is not None:
            own[0].copy_(w.reshape(-1)[own[1]])
    optimizer._copy_main_params_to_model_params()


def scatter(optimizer: DistributedOptimizer, full: dict[torch.nn.Parameter, dict[str, torch.Tensor]],
            step: torch.Tensor) -> None:
    """Set this rank's slice of each parameter's main weight and moments from full tensors (this TP
    rank's shape), and AdamW's step count."""
    set_main(optimizer, {p: tensors["param"] for p, tensors in full.items()})
    for p, tensors in full.items():
        if (own := _main_slice(optimizer, p)) is None:
            continue
        main, where = own
        optimizer.optimizer.state[main] = {"step": step.detach().clone().float().reshape(()),
                                           **{k: tensors[k].reshape(-1)[where].clone().to(main)
                                              for k in ("exp_avg", "exp_avg_sq")}}
