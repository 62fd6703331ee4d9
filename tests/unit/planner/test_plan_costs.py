"""The planner reaches engines through their cost models (``EngineSpec.cost``,
``rlbatch.plan.costs``): an engine added with a cost model of its own is planned by it, with no
edit to the planner (tests/unit/test_engine_seam.py: the planner names no engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from conftest import make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.engines import registry
from rlbatch.engines.registry import EngineKind
from rlbatch.models.shape import ModelShape
from rlbatch.plan.costs import EngineCost, Held
from rlbatch.plan.layout import RoleLayout
from rlbatch.plan.memory import role_memory
from rlbatch.plan.predict import predict
from rlbatch.plan.search import train_dims
from rlbatch.plan.workload import Workload
from tests.unit.planner.test_plan_packing import Q7B


class ToyCost(EngineCost):
    """A training engine that keeps 3 bytes a parameter and splits over t only by twos."""

    def held(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> Held:
        return Held({"params": 3.0 * shape.params / r.backend.d}, shape.layers, notes=["toy engine"])  # type: ignore[union-attr]

    def tensor_sizes(self, gpn: int) -> list[int]:
        return [1]


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    spec = dataclasses.replace(registry.REGISTRY["fsdp"], name="toytrain", implementation=None,
                               cost=f"{__name__}:ToyCost")
    monkeypatch.setitem(registry.REGISTRY, "toytrain", spec)
    yield "toytrain"


def test_an_engine_with_a_cost_model_of_its_own_is_planned_by_it(toy: str) -> None:
    cfg = make_config(roles=roles(f"{toy}:d4", "vllm:d4", "list(range(0,4))", "list(range(0,4))"))
    layout, w, hw = make_layout(cfg), workload_of(cfg, 512, 0.5), load_hardware("h100_sxm")
    m = role_memory(layout.roles["actor_train"], Q7B, w, 2, hw)
    assert m.state == {"params": pytest.approx(3.0 * Q7B.params / 4)} and "toy engine" in m.notes
    assert "gather_buffers" not in m.transient["train"]  # the defaults: nothing gathered
    assert predict(layout, Q7B, w, hw).step_s > 0
    assert train_dims(toy, 8, 8, Q7B, w) == [f"{toy}:d8"]  # its tensor sizes: 1 only
    assert EngineKind.TRAIN is registry.spec_of(toy).kind
