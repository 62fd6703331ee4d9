"""A rank that hangs, instead of dying, in a weight sync or a generation: the run ends with a
failure soon after ``cluster.timeout_s`` (the controller's wait for the phase, then the launcher
stopping every rank), and the report names the phase, the role and the rank that hung.

The fast tier's case is a sync whose peer never arrives: the inference rank hangs as the sync
starts, the sender's broadcast to it waits in the sync group, and the controller waits for both.
The others (full tier): the sender hangs; a receiver hangs mid-stream, between buckets; a
generation hangs; and with a tensor-parallel vLLM worker (t=2) and LoRA adapters synced alone, one
peer hangs in the adapters' sync or in generation while the other waits for it inside vLLM."""

from __future__ import annotations

import datetime
import re
import time
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs

pytestmark = pytest.mark.dist
TIMEOUT_S = 20
RUN = ["roles=disaggregated", "steps=1", f"cluster.timeout_s={TIMEOUT_S}", "algo.prompts_per_step=8",
       "algo.samples_per_prompt=4"]
"""Ranks 0: actor_train + reference, 1: actor_infer (hf), 2: reward, 3: controller. One step: the
hangs below all come in it (its generation, then its sync)."""
MARGIN_S = 30
"""After the controller's wait: its 3 s pause before it aborts the job (for the ranks whose own
collectives fail meanwhile to record why), the launcher stopping every rank, the report, all on a
loaded 2-core machine. A hang that nothing ended would run into the test's own time limit."""
VLLM_TP = ["experiment=arithmetic_vllm", 'roles.actor_infer.device_mapping="[1,2]"', "roles.actor_infer.backend=vllm:d1t2",
           "model.lora.rank=8"]
"""actor_infer: one vLLM worker of two tensor-parallel ranks (1 and 2); with LoRA a sync moves the
adapters alone (vLLM loads adapters). Rank 3 is the reward worker, 4 the controller."""
TRAIN0 = "rank 0 (actor_train[0], reference[0]; GPU rank 0, node 0)"
INFER1 = "rank 1 (actor_infer[0]; GPU rank 1, node 0)"
SYNC = "phase 'sync' of actor_train, actor_infer"
GENERATE = "phase 'generate' of actor_infer"


def injected_at(run: Path, fault: str) -> float:
    """When the rank logged the injected fault (the rank logs' local time)."""
    found = re.search(rf"^(\S+ \S+) \[.*?\] WARNING rlbatch\.runtime\.faults: injecting fault '{re.escape(fault)}'",
                      rank_logs(run), re.M)
    assert found is not None, f"no rank injected {fault!r}"
    return datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def hang(run_root: Path, fault: str, *extra: str, timeout: float = 300) -> tuple[list[str], float]:
    """Launch with ``fault``; return the report's lines and the seconds from the hang to the
    launcher's exit, having checked that the run failed."""
    run = run_root / "run"
    out = launch([*RUN, *extra, f"run_dir={run}"], run_root, env={"RLBATCH_FAULT": fault}, timeout=timeout)
    ended = time.time()
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    report = out.stderr[out.stderr.find("the run failed"):]
    assert "the run failed" in report, out.stderr[-3000:]
    return [ln.strip() for ln in report.splitlines()[1:] if ln.strip()], ended - injected_at(run, fault)


def test_a_sync_whose_peer_never_arrives_ends_the_run_naming_the_phase_role_and_rank(run_root: Path) -> None:
    lines, took = hang(run_root, "hang:1:sync_recv")
    assert lines[0].startswith(f"{INFER1} hung in {SYNC} "), lines
    assert f"no answer within {TIMEOUT_S}s" in lines[0], lines
    assert not any("died" in ln for ln in lines), lines  # it hung: nothing killed it before the launcher
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.0f}s after the rank hung"


@pytest.mark.full
@pytest.mark.parametrize(("fault", "extra", "cause", "phase"), [
    ("hang:0:sync_send", [], TRAIN0, SYNC),
    # every tensor a bucket of its own: the receiver stops after two of them went through
    ("hang:1:sync_bucket:3", ["+roles.actor_train.engine_args.sync_bucket_mb=0"], INFER1, SYNC),
    ("hang:1:generate", [], INFER1, GENERATE),
], ids=["sender", "mid-stream", "generation"])
def test_a_hang_in_a_sync_or_a_generation_ends_the_run_naming_it(run_root: Path, fault: str, extra: list[str],
                                                                  cause: str, phase: str) -> None:
    lines, took = hang(run_root, fault, *extra)
    assert lines[0].startswith(f"{cause} hung in {phase} "), lines
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.0f}s after the rank hung"


@pytest.mark.full
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("fault", "phase"), [("hang:2:sync_recv", SYNC), ("hang:2:generate", GENERATE)],
                         ids=["adapter-sync", "generation"])
def test_a_tensor_parallel_vllm_peer_that_hangs_ends_the_run_naming_it(run_root: Path, fault: str, phase: str) -> None:
    """In the sync, the sender and the other peer wait in the sync group's broadcast, which times
    out too (and then names the hung peer). In generation the other peer waits inside vLLM's own
    collective, which has no deadline: both peers are named, neither having failed."""
    lines, took = hang(run_root, fault, *VLLM_TP, timeout=540)
    assert any(ln.startswith(f"rank 2 (actor_infer[0]; GPU rank 2, node 0) hung in {phase} ") for ln in lines), lines
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.0f}s after the rank hung"


@pytest.mark.full
def test_a_trainer_rank_that_hangs_ends_its_peers_collective_within_the_timeout(run_root: Path) -> None:
    """Once the engines are built every group of a rank times out after cluster.timeout_s: rank 0's
    FSDP collective, whose peer (rank 1) hangs as the train phase starts, fails on rank 0 too,
    naming the role's group, instead of waiting torch's default 30 minutes."""
    run = run_root / "run"
    out = launch(["roles=colocated", "steps=1", f"cluster.timeout_s={TIMEOUT_S}", "algo.prompts_per_step=8",
                  "algo.samples_per_prompt=4", f"run_dir={run}"], run_root, env={"RLBATCH_FAULT": "hang:1:train"},
                 timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    report = out.stderr[out.stderr.find("the run failed"):]
    assert "rank 1 (actor_train[1]" in report and "hung in phase 'train'" in report, report
    assert "process groups now time out after 20s" in rank_logs(run)
    # rank 0 gave up waiting in FSDP's collective: secondary, naming rank 1
    assert "rank 0 (actor_train[0]" in report and "CollectiveError: phase 'train' of actor_train" in report, report
    assert "a collective timed out on rank 0 after at most 20s waiting for ranks [1]" in report, report
