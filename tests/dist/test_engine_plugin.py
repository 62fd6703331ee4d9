"""An engine written only against the engine contract plugs in through the registry from its own
package (tests/plugins/echo/, shaped as a built-in engine), with no change anywhere else, and runs
the pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(("roles", "backend"), [("colocated", "echo:d2"),
                                                  pytest.param("disaggregated", "echo:d1", marks=pytest.mark.full)])
def test_echo_inference_engine_runs_the_pipeline(run_root: Path, roles: str, backend: str) -> None:
    run = run_root / "run"
    out = launch([f"roles={roles}", "steps=2", f"run_dir={run}", "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "algo.max_new_tokens=4",
                  "plugins=[tests.plugins.echo]", f"roles.actor_infer.backend={backend}",
                  "+roles.actor_infer.engine_args.echo=2"], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # 8 samples a step, each the prompt's last 2 tokens and EOS: the echo engine generated them
    assert all(r["tokens/generated"] == 8 * 3 for r in rows), [r["tokens/generated"] for r in rows]
    assert "done: 2 steps" in out.stdout


def test_unknown_engine_args_of_a_plugin_engine_are_refused(run_root: Path) -> None:
    out = launch(["dry_run=true", "plugins=[tests.plugins.echo]", "roles.actor_infer.backend=echo:d2",
                  "+roles.actor_infer.engine_args.loud=true"], run_root)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "loud" in out.stderr and "echo" in out.stderr
