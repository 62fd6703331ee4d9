"""An engine is one module and one ``register(...)`` line: its own checks before start
(``EngineSpec.rules``) and its model for the planner (``EngineSpec.cost``) come with it, so
validation (``rlbatch/config``) and the planner (``rlbatch/plan``) name no engine."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.engines import registry
from tests.unit.configs import problems, set_

ROOT = Path(__file__).resolve().parents[2] / "rlbatch"


@pytest.mark.parametrize("package", ["config", "plan"])
def test_validation_and_the_planner_name_no_engine(package: str) -> None:
    literal = re.compile(rf"""["']({"|".join(map(re.escape, registry.REGISTRY))})["']""")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sorted((ROOT / package).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert found == []


@pytest.fixture
def echo() -> Iterator[str]:
    """The echo engine plugged in from its file, and taken out again after the test."""
    name = "tests.plugins.echo"
    before = set(registry.REGISTRY)
    importlib.import_module(name) if name not in sys.modules else importlib.reload(sys.modules[name])
    yield name
    for k in set(registry.REGISTRY) - before:
        del registry.REGISTRY[k]
    sys.modules.pop(name, None)


def test_a_plugin_engine_brings_its_checks_and_its_cost_model(echo: str, cfg: dict[str, Any]) -> None:
    from rlbatch.config.hardware import load_hardware
    from rlbatch.config.parse import parse
    from rlbatch.models.shape import ModelShape
    from rlbatch.models.spec import spec_from_config
    from rlbatch.plan.layout import from_placement
    from rlbatch.plan.memory import role_memory
    from rlbatch.plan.predict import predict
    from rlbatch.plan.workload import workload_from_config

    c = set_(cfg, plugins=[echo], roles__actor_infer__backend="echo:d2")
    placement = check(c)
    assert problems(set_(c, roles__actor_infer__engine_args={"echo": 8})) == [
        "roles.actor_infer.engine_args.echo: 8 tokens and EOS do not fit in algo.max_new_tokens=8"]
    layout, w, hw = from_placement(placement), workload_from_config(parse(c).config), load_hardware("cpu")
    shape = ModelShape.of(spec_from_config(c["model"]))
    assert role_memory(layout.roles["actor_infer"], shape, w, 4, hw).state == {"params": 0.0}
    generate = predict(layout, shape, w, hw).phase("generate")
    assert generate is not None and generate.features["overhead"] == pytest.approx(
        w.sequences * w.response_mean * hw.op_overhead_s)


def test_the_schema_is_a_leaf() -> None:
    """rlbatch.config imports nothing of rlbatch outside itself (validation is rlbatch.checks, above it;
    the parser, which reads the registries' names, and the loader that uses it sit a layer up)."""
    code = ("import sys, rlbatch; root = set(sys.modules); "  # the package's own (its ConfigError)
            "import rlbatch.config.schema, rlbatch.config.plain, rlbatch.config.register; "
            "print(*sorted(m for m in set(sys.modules) - root if m.startswith('rlbatch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = out.stdout.split()
    assert "rlbatch.config.schema" in got and all(m.split(".")[:2] == ["rlbatch", "config"] for m in got), got
