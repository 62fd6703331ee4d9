"""The planner's model of rlbatch's megatron engine (megatron-core: tp, pp, ep over its meshes)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlbatch.engines.megatron import MegatronArgs
from rlbatch.plan.costs import EngineCost, Held

if TYPE_CHECKING:
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import RoleLayout
    from rlbatch.plan.workload import Workload


class MegatronCost(EngineCost):
    """Its engine builds the whole fp32 model on the host on every rank before it converts it
    (``load_engine_model``): not modelled in ``load_bytes``."""

    def sequence_parallel(self, r: RoleLayout) -> bool:
        """On unless engine_args.sequence_parallel is false: then a layer keeps Korthikanti's
        10 + 24/t count, not (34 + ...)/t."""
        return r.args_as(MegatronArgs).sequence_parallel

    def reduces_each_step(self, r: RoleLayout) -> bool:
        return True

    def outputs_over_cp(self, r: RoleLayout) -> bool:
        """Context parallelism gathers each row's final outputs over cp (every cp rank computes the loss)."""
        return True

    def pipeline_sizes(self, t: int, gpn: int) -> list[int]:
        return [1, 2, 4, 8, 16]

    def expert_sizes(self, shape: ModelShape, t: int, d: int, gpn: int) -> list[int]:
        """The engine splits a Mixture-of-Experts model's experts over groups of e data-parallel
        ranks, without tensor parallelism."""
        if not shape.experts or t != 1:
            return [1]
        return [e for e in super().tensor_sizes(min(shape.experts, gpn)) if shape.experts % e == 0 and d % e == 0]

    def held(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> Held:
        """Megatron-LM's theoretical memory, on the most loaded (first) pipeline stage."""
        b = r.backend
        assert b is not None
        d, t, p, c = b.d, b.t, b.p, b.c
        notes: list[str] = []
        dense = shape.layers * (shape.layer_params - shape.expert_params) + shape.hidden
        emb = shape.embedding_params * (1 if shape.tied or p > 1 else 2)
        ffn = b.ffn
        e_split = (ffn.e * ffn.t) if ffn is not None else (b.e * t)
        shard = (dense / p + emb) / t + shape.layers * shape.expert_params / p / e_split
        # rlbatch's megatron engine keeps fp32 gradients, fp32 main weights beside 16-bit weights (fp32
        # weights are their own) and AdamW's two fp32 moments: Megatron-LM's 18 bytes per parameter in
        # bf16. engine_args.distributed_optimizer (off by default) gives each of the d*c data-parallel
        # ranks the main weights and moments of 1/(d*c) of them: 6 + 12/dp bytes.
        dist_opt = r.args_as(MegatronArgs).distributed_optimizer
        main = 4 if e < 4 else 0
        state = {"params": e * shard} if forward_only else {
            "params": e * shard, "grads": 4 * shard, "optimizer": (8 + main) * shard / (d * c if dist_opt else 1)}
        if dist_opt and not forward_only:
            notes.append(f"distributed optimizer: optimizer state / {d * c}")
        # weight sync gathers full tensors one at a time
        return Held(state, math.ceil(shape.layers / p), sync_bytes=e * max(shape.layer_params, shape.embedding_params) / t,
                    notes=notes)
