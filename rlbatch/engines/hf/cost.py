"""The planner's model of rlbatch's hf inference engine (transformers' generate, data parallel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbatch.engines.defaults import worth_sharing
from rlbatch.engines.hf import HFArgs
from rlbatch.plan.costs import EngineCost
from rlbatch.plan.memory import PerCall, generic_infer_memory, largest_tensor

if TYPE_CHECKING:
    from rlbatch.config.hardware import Hardware
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import RoleLayout
    from rlbatch.plan.memory import RoleMemory
    from rlbatch.plan.workload import Workload


class HFCost(EngineCost):
    def load_bytes(self, r: RoleLayout, shape: ModelShape, e: int, hw: Hardware) -> float:
        """It reads a model directory one tensor at a time into a model on the host (``load_model``),
        which on a GPU it then copies to the device: the whole model in its dtype on the host."""
        return 4.0 * largest_tensor(shape) if hw.is_cpu else e * float(shape.params)

    def shares_prompts(self, r: RoleLayout, w: Workload, mb: int, trained: bool) -> bool:
        """Each distinct prompt but its last token once, then the last token of every row."""
        return r.args_as(HFArgs).share_prompts and worth_sharing(w.distinct_prompts(mb), mb)

    def tensor_sizes(self, gpn: int) -> list[int]:
        return [1]  # data-parallel engines of one rank each

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        """Up to max_batch sequences per generate call; the KV cache grows with them."""
        return generic_infer_memory(r, shape, w, e, hw, PerCall(r.args_as(HFArgs).max_batch))
