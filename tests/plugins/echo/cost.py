"""The planner's model of the echo engine (``EngineSpec.cost``)."""

from __future__ import annotations

from rlbatch.config.hardware import Hardware
from rlbatch.models.shape import ModelShape
from rlbatch.plan.costs import EngineCost
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.memory import RoleMemory
from rlbatch.plan.workload import Workload


class EchoCost(EngineCost):
    """The planner's model of it (``EngineSpec.cost``): no weights on the device, a generation as
    long as its host work (one model-free step per response token)."""

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        return RoleMemory(r.name, {"params": 0.0}, {"generate": {}, "sync": {}})

    def generate(self, r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                 layout: Layout) -> dict[str, float]:
        return {"overhead": w.sequences * w.response_mean * hw.op_overhead_s, "fixed": 1.0}
