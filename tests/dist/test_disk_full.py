"""A disk that fills up during a checkpoint ends the job at once, says where and how much is free,
and leaves the previous checkpoint loadable (local mpiexec, CPU).

The disk fills through the ``enospc`` fault (rlbatch/runtime/faults.py: every space-allocating
open of the process fails with ENOSPC, status files included), so no mount is needed;
``tools/fault_scenarios/disk_full.py`` shows the same on a real, full tmpfs.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist

FAIL_FAST_S = 30.0
"""From the failed write to the launcher's exit: the ranks abort within a second or two of their
error (DiskFull, then MPI_Abort; mpiexec ends the others at once). 30 s leaves room for a loaded
2-core machine, and stays far below cluster.timeout_s=120 below: an exit that waited for the
control plane's timeout (a rank that never answered) fails this test."""


def test_a_full_disk_during_a_checkpoint_ends_the_job_fast_and_names_the_disk(run_root: Path) -> None:
    run = run_root / "run"
    # The trainer's ranks (0, 1) and the controller (3) find the disk full at their second checkpoint
    # write (step 1; step 0's stays). The reward rank (2) writes its small RNG file and waits for the
    # next command, as on a real disk where the big shards are what no longer fit: only the failing
    # ranks' own error paths can end the job.
    out = launch([f"run_dir={run}", "steps=3", "save_every=1", "cluster.timeout_s=120"], run_root,
                 env={"RLBATCH_FAULT": "enospc:0,1,3:checkpoint_write:2"}, timeout=300)
    ended = time.time()
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    filled = re.search(r"^(\S+ \S+) .*injecting fault 'enospc", (run / "logs" / "rank0.log").read_text(), re.M)
    assert filled, "rank 0 never reached its second checkpoint write"
    at = datetime.strptime(filled.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert ended - at < FAIL_FAST_S, f"the job took {ended - at:.0f}s to end after the disk filled"
    console = out.stdout + out.stderr
    named = re.search(r"DiskFull: no space left writing the checkpoint (\S+)/checkpoints/step_000001\.tmp-\S+: "
                      r"(.+) mounted at (\S+) has [\d.]+ MiB \(0 bytes\) free", console)
    assert named, console[-4000:]
    assert named.group(1) == str(run)

    from rlbatch.checkpoint import open_checkpoint

    previous = open_checkpoint(run)  # every file against its manifest's size and sha256
    assert previous.step == 0 and previous.path.name == "step_000000"
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(previous.path / "actor_train", run_root / "actor_train.pt")
    state = torch.load(run_root / "actor_train.pt")
    assert any(k.startswith("model.") for k in state) and any(k.startswith("optim.") for k in state)
