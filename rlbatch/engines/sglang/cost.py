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

RESERVATION = Reservation("mem_fraction_static", SGLangArgs.mem_fraction_static, SGLangArgs.max_num_batched_tokens,
                          SGLangArgs.max_num_seqs)
"""What SGLang reserves at start, its engine_args' defaults where a run sets none."""


class SGLangCost(EngineCost):
    continuous_batching = True

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        return generic_infer_memory(r, shape, w, e, hw, reserve=RESERVATION)
