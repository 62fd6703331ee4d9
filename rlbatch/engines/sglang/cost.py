"""The planner's model of SGLang: it reserves a share of the GPU (mem_fraction_static) as vLLM does."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbatch.engines.sglang import SGLangArgs
from rlbatch.plan.costs import EngineCost
from rlbatch.plan.memory import Reservation, generic_infer_memory

if TYPE_CHECKING:
    from rlbatch.config.hardware import Hardware
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import RoleLayout
    from rlbatch.plan.memory import RoleMemory
    from rlbatch.plan.workload import Workload


class SGLangCost(EngineCost):
    continuous_batching = True

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        """What it reserves at start (``mem_fraction_static`` of the GPU), from the role's engine_args."""
        a = r.args_as(SGLangArgs)
        reserve = Reservation("mem_fraction_static", a.mem_fraction_static, a.max_num_batched_tokens, a.max_num_seqs)
        return generic_infer_memory(r, shape, w, e, hw, reserve)
