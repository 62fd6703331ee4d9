"""The first commands users try with Megatron learn: the default experiment with
``roles.actor_train.backend=megatron:t2`` colocated with the hf actor_infer or ``megatron:p2`` on
ranks of its own (the reference inherits it), and with a Mixture-of-Experts model over
``megatron:d2e2``. On this CPU machine the
test-only shim reaches every rank through the plugin mechanism (docs/megatron.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import launch
from tests.dist.test_learning import rewards

pytestmark = pytest.mark.dist


DISAGGREGATED = ["roles=disaggregated", "roles.actor_train.device_mapping=[1,2]",
                 "roles.reference.device_mapping=[1,2]", "roles.actor_infer.device_mapping=[0]"]
"""actor_train and the reference on ranks 1-2, the hf actor_infer on rank 0: a role that does not
hold global rank 0, weights synced across processes."""

CASES = {
    # backend, placement -> (steps, rise of the last four steps' mean reward over the first four's).
    # Seed 1: t2 colocated 0.002 over the first 4 steps and 0.28 over steps 13-16 (p2 colocated, by
    # hand, the same rewards); p2 disaggregated 0.003 and 0.52 over steps 21-24.
    "t2-colocated": (["roles.actor_train.backend=megatron:t2"], 16, 0.1),
    "p2-disaggregated": (["roles.actor_train.backend=megatron:p2", *DISAGGREGATED], 24, 0.2),
    # A Mixture-of-Experts model (4 experts, top-2), each of the two ranks holding 2 of them: 0.002
    # over the first 4 steps, 0.40 over steps 21-24.
    "moe-e2-colocated": (["model.arch=qwen2_moe", "roles.actor_train.backend=megatron:d2e2"], 24, 0.2),
}


@pytest.mark.full
@pytest.mark.timeout(960)
@pytest.mark.parametrize("case", list(CASES))
def test_default_experiment_with_megatron_learns(case: str, run_root: Path) -> None:
    overrides, steps, rise = CASES[case]
    out = launch([*overrides, "plugins=[tests.plugins.megatron_cpu]", f"steps={steps}", f"run_dir={run_root / 'run'}"],
                 run_root, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = rewards(run_root / "run")
    assert len(r) == steps and sum(r[-4:]) / 4 > sum(r[:4]) / 4 + rise, r
