"""Tensor parallelism of the ``fsdp`` engine (``fsdp:dXtY``): DTensor tensor parallelism on the
role's tp axis, composed with FSDP2 on dp.

Each decoder layer's attention and MLP are split Megatron-style: q/k/v and gate/up by output
features (``ColwiseParallel``: each tp rank computes its own heads and its own slice of the MLP),
o and down by input features (``RowwiseParallel``: one all-reduce of the layer's output per block).
The embedding, norms and LM head stay whole on every tp rank: a vocabulary-sharded embedding would
silently untie a tied LM head, and the norms' gradients are the same on every tp rank of a
replica. ``fully_shard`` on the dp axis then shards every parameter over dp, the split ones as
2-D DTensors (dp x tp), the others on dp alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from rlbatch.engines.base import require_mesh
from rlbatch.models.weights import TensorSource

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from rlbatch.engines.base import EngineContext

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
"""Split by output features: each tp rank holds its heads (attention) or its share of the MLP."""
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
"""Split by input features: the partial outputs are summed over tp (one all-reduce each)."""


def mesh_dims(mesh: DeviceMesh) -> dict[str, int]:
    return dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))


def require_dp_tp(mesh: DeviceMesh) -> tuple[int, int]:
    """The mesh's (tp, cp) sizes; refuses pipeline parallelism, which the fsdp engine does not run."""
    dims = mesh_dims(mesh)
    tp, cp = dims.get("tp", 1), dims.get("cp", 1)
    if dims.get("pp", 1) > 1:
        raise NotImplementedError(f"fsdp engine: data, tensor and context parallelism (dXtYcZ) are implemented, "
                                  f"not pipeline stages; got mesh {dims}")
    return tp, cp


def layer_plan(layer: torch.nn.Module) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one decoder layer, by submodule name. A layer without these
    linear layers (a Mixture-of-Experts block) is refused: its experts are not split here.

    A linear layer with a low-rank adapter (PEFT's ``base_layer`` + ``lora_A`` + ``lora_B``, the
    update ``B @ A``) is split with its base: by output features, B splits as the base does and A
    stays whole (each rank feeds A the whole input, as its base gets it, and adds its own rows of
    ``B @ A x``); by input features, A splits as the base does (its partial products are summed
    over tp with the base's) and B stays whole."""
    names = {n for n, _ in layer.named_modules()}
    if missing := [n for n in COLWISE + ROWWISE if n not in names]:
        raise NotImplementedError(f"fsdp engine: tensor parallelism splits {', '.join(COLWISE + ROWWISE)} of each "
                                  f"decoder layer; {type(layer).__name__} has no {', '.join(missing)}")
    plan: dict[str, ParallelStyle] = {}
    for split, style, adapter in ((COLWISE, ColwiseParallel, "lora_B"), (ROWWISE, RowwiseParallel, "lora_A")):
        for n in split:
            if f"{n}.base_layer" not in names:
                plan[n] = style()
                continue
            plan[f"{n}.base_layer"] = style()
            plan |= {m: style() for m in names if m.startswith(f"{n}.{adapter}.") and m.count(".") == n.count(".") + 2}
    return plan


def parallelize(layers: Iterable[torch.nn.Module], tp_mesh: DeviceMesh, heads: int, kv_heads: int) -> None:
    """Split each decoder layer over ``tp_mesh`` (the module docstring). Heads that do not divide
    are refused here too (validation refuses them before start: ``fsdp_rules``)."""
    t = tp_mesh.size()
    if heads % t or kv_heads % t:
        raise ValueError(f"fsdp engine: tensor parallel t = {t} splits attention by heads: num_attention_heads "
                         f"{heads} and num_key_value_heads {kv_heads} must both be divisible by {t}")
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer))


@torch.no_grad()
def materialise(model: torch.nn.Module, source: TensorSource) -> None:
    """Fill every parameter's local shard from ``source`` (after ``allocate``): a 2-D DTensor's
    block is read by its rows (dim 0) and then cut to its columns, so no rank reads more than its
    dp share of a tensor-parallel weight's rows."""
    for name, p in model.named_parameters():
        if p.dim() == 0:
            raise NotImplementedError(f"{name}: a 0-dim parameter is not read by rows")
        if isinstance(p, DTensor):
            local = p.to_local()
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        else:
            local, shape, offset = p.detach(), tuple(p.shape), (0,) * p.dim()
        if local.numel() == 0:
            continue
        assert tuple(local.shape) == tuple(shape), f"{name}: local shard {tuple(local.shape)}, its layout gives {shape}"
        rows = source.rows(name, tuple(p.shape), offset[0], offset[0] + shape[0])
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        local.copy_(rows[(slice(None), *cols)])


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` over parameters on several meshes (dp x tp and dp alone), which torch's
    refuses (it stacks the per-tensor norms): the norm of each mesh's gradients in full
    (``full_tensor`` sums the shards), combined; every gradient scaled as torch's would. Returns
    the total norm before clipping."""
    by_mesh: dict[DeviceMesh | None, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], 2.0, foreach=True)
        full = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(full.float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return float(total)


def role_group(ctx: EngineContext) -> ProcessGroup | None:
    """The process group of all the role's ranks (dp x tp), which a checkpoint is written by:
    ``EngineContext.groups['role']``, or for an engine built by hand over a mesh spanning the
    whole world, the world (None)."""
    if "role" in ctx.groups:
        return ctx.groups["role"]
    ranks = require_mesh(ctx.mesh, f"fsdp engine, role {ctx.role}").mesh.numel()
    if ranks != dist.get_world_size():
        raise RuntimeError(f"fsdp engine, role {ctx.role}: with tensor parallelism its checkpoint group comes from "
                           f"rlbatch.runtime.world (EngineContext.groups['role']); built by hand, the mesh must span "
                           f"the whole world ({dist.get_world_size()} ranks), got {ranks}")
    return None
