"""tools/bench/scale_sim.py: the controller's real loop against stand-in ranks, at sizes no machine
here can run as processes. Counted, not timed: the messages of a step grow linearly with the ranks."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlbatch.engines import registry
from tools.bench import scale_sim


@pytest.fixture(autouse=True)
def sleep_engines_unplugged_after() -> Iterator[None]:
    """The runs plug in the ``sleep`` engines (``plugins=[rlbatch.engines.sleep]``) in this process
    and set its collector as the controller's (``rlbatch.runtime.heap``): both undone after each
    test, so that later tests see the registry as built and the collector as it was."""
    before, thresholds = set(registry.REGISTRY), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    for name in set(registry.REGISTRY) - before:
        del registry.REGISTRY[name]
    for module in [m for m in sys.modules if m == "rlbatch.engines.sleep" or m.startswith("rlbatch.engines.sleep.")]:
        del sys.modules[module]


def test_the_simulated_controller_runs_its_loop_and_sends_one_command_a_rank_per_phase(tmp_path: Path,
                                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    small = scale_sim.run(8, 4, 5, tmp_path)
    large = scale_sim.run(256, 4, 5, tmp_path)
    # colocated GRPO: six phases on every GPU rank a step (a command and a reply each), and the
    # reward worker's scoring (2 more), whatever the world's size
    assert small[1] == 12 * 8 + 2 and large[1] == 12 * 256 + 2
    assert 0 < small[0] < large[0]
    for n in (8, 256):
        rows = (tmp_path / f"r{n}" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 5  # every step ran, its metrics written


def test_the_tool_prints_its_table_and_its_last_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scale_sim.main(["--ranks", "4,16", "--steps", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [ln for ln in out if ln.startswith("| ")]
    assert [ln.split("|")[1].strip() for ln in table[1:]] == ["4", "16"]
    assert out[-1].startswith("scale (simulated ranks): 16 ranks, controller CPU ") and "% of a 30 s step" in out[-1]
