"""Inputs that used to pass the launcher and then end in a traceback after start (or write where
they should not) are refused before anything starts, with the field and the reason.

Unit cases call ``check(cfg)`` on the default experiment as a plain dict; the launcher cases run
``python -m rlbatch.launch`` (not a dry run) and assert what a user sees: exit code 2, the message,
no traceback, nothing created. Those launches set ``cluster.mpiexec=/bin/false``, so that a
regression that lets one through ends at once instead of starting a run.
"""

from __future__ import annotations

import copy
import math
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch import ConfigError
from rlbatch.checkpoint.store import CheckpointStore
from rlbatch.checks.validate import check
from rlbatch.placement import place
from rlbatch.rewards.rules import RewardError, reward_value, rule_scorer
from tests.unit.configs import problems, set_

REPO_ROOT = Path(__file__).resolve().parents[2]




# ------------------------------------------------------------------------------ data.reward_fn

REWARDS = '''
import asyncio

def good(completion, answer):
    return 1.0

def good_with_options(completion, answer, *, scale=1.0):
    return scale

def good_varargs(*args):
    return 0.0

class Scorer:
    def __call__(self, completion, answer):
        return 1.0

scorer = Scorer()

def one_arg(completion):
    return 1.0

def three_args(completion, answer, tokenizer):
    return 1.0

def keyword_only(*, completion, answer):
    return 1.0

async def asynchronous(completion, answer):
    return 1.0

def generator(completion, answer):
    yield 1.0

def returns_none(completion, answer):
    return None

def returns_text(completion, answer):
    return "1.0"

def returns_nan(completion, answer):
    return float("nan")

def returns_inf(completion, answer):
    return -float("inf")

def raises(completion, answer):
    raise ValueError("no such answer\\nsecond line")

def wrong_on_third(completion, answer):
    return None if completion == "c" else 0.5
'''


@pytest.fixture
def rewards_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of reward functions on sys.path, imported fresh by each test."""
    d = tmp_path / "mods"
    d.mkdir()
    (d / "rlbatch_test_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(d))
    yield "rlbatch_test_rewards"
    sys.modules.pop("rlbatch_test_rewards", None)


@pytest.mark.parametrize(("name", "reason"), [
    ("one_arg", "has the signature (completion), but rewards are called as fn(completion, answer) "
                "(too many positional arguments)"),
    ("three_args", "has the signature (completion, answer, tokenizer), but rewards are called as fn(completion, "
                   "answer) (missing a required argument: 'tokenizer')"),
    ("keyword_only", "has the signature (*, completion, answer), but rewards are called as fn(completion, answer)"),
    ("Scorer", "is the class Scorer: calling it makes an instance, not a reward"),
    ("asynchronous", "is an async function"),
    ("generator", "is a generator function"),
])
def test_a_reward_fn_that_cannot_be_called_as_a_reward_is_refused_at_launch(
        cfg: dict[str, Any], rewards_module: str, name: str, reason: str) -> None:
    path = f"{rewards_module}:{name}"
    (line,) = problems(set_(cfg, data__reward_fn=path))
    assert line.startswith(f"data.reward_fn: reward function {path!r} {reason}"), line


@pytest.mark.parametrize("name", ["good", "good_with_options", "good_varargs", "scorer"])
def test_a_reward_fn_callable_as_completion_answer_passes(cfg: dict[str, Any], rewards_module: str,
                                                          name: str) -> None:
    check(set_(cfg, data__reward_fn=f"{rewards_module}:{name}"))


def scorer(module: str, name: str) -> Any:
    return rule_scorer(SimpleNamespace(data=SimpleNamespace(reward_fn=f"{module}:{name}")))


@pytest.mark.parametrize(("name", "what"), [
    ("returns_none", "returned None (NoneType), not a finite number"),
    ("returns_text", "returned '1.0' (str), not a finite number"),
    ("returns_nan", "returned nan (float), not a finite number"),
    ("returns_inf", "returned -inf (float), not a finite number"),
    ("raises", "raised ValueError: no such answer second line"),
])
def test_a_reward_that_is_not_a_finite_number_ends_the_run_naming_the_sample(rewards_module: str, name: str,
                                                                              what: str) -> None:
    with pytest.raises(RewardError) as e:
        scorer(rewards_module, name)(["a<eos>", "b"], ["7", "8"])
    assert e.value.index == 0
    # The rank runtime names the run's sample id (rank_runtime._score: for_sample).
    text = str(e.value.for_sample(40))
    assert text == (f"data.reward_fn '{rewards_module}:{name}' on sample 40 (answer '7', completion 'a<eos>') "
                    f"{what}")
    assert "\n" not in text  # the rank's console line shows the error's last line only


def test_the_rank_runtime_names_the_sample_id_of_the_failing_response(rewards_module: str) -> None:
    from rlbatch.loop.rank_runtime import RankRuntime
    from rlbatch.phases import PHASES
    from rlbatch.runtime.dataplane import SampleStore

    class Decode:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    import torch

    rt = RankRuntime.__new__(RankRuntime)
    rt.store, rt.tokenizer = SampleStore(), Decode()
    rt.scorers = {"reward": scorer(rewards_module, "wrong_on_third")}
    for sid, token in zip([17, 18, 19], [0, 1, 2], strict=True):
        rt.store.put(sid, "response", torch.tensor([token]))
    spec = next(p for p in PHASES.values() if p.op == "score" and p.role == "reward")
    with pytest.raises(RewardError, match=r"on sample 19 \(answer 'z', completion 'c'\) returned None"):
        rt._score(spec, [17, 18, 19], ["x", "y", "z"])
    rt.scorers = {"reward": scorer(rewards_module, "good")}
    assert rt._score(spec, [17, 18], ["x", "y"])["rewards"] == {17: 1.0, 18: 1.0}


def test_numbers_of_any_real_type_are_rewards() -> None:
    import numpy as np
    import torch

    assert [reward_value(v) for v in (True, 0, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.75))] == \
        [1.0, 0.0, 0.5, 0.25, 2.0, 0.75]
    for bad in (None, "1", b"1", float("nan"), math.inf, 10**400, torch.tensor([1.0, 2.0]), [1.0], object()):
        assert reward_value(bad) is None, bad


# ------------------------------------------------------------------------------------ run_dir


def test_an_empty_run_dir_is_refused_instead_of_writing_into_the_current_directory(cfg: dict[str, Any]) -> None:
    for empty in ("", "  "):
        (line,) = problems(set_(cfg, run_dir=empty))
        assert line.startswith(f"run_dir: {empty!r} is empty: the run would write its config, logs and "
                               f"checkpoints into the current directory ({Path.cwd()})")


def test_a_run_dir_that_is_a_file_or_under_one_is_refused(cfg: dict[str, Any], tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    assert problems(set_(cfg, run_dir=str(f))) == [
        f"run_dir: {f} is a regular file, not a directory; give a directory (or a path to create)"]
    assert problems(set_(cfg, run_dir=str(f / "runs" / "a"))) == [
        f"run_dir: {f / 'runs' / 'a'} cannot be created: {f} is a regular file, not a directory"]


def test_a_run_dir_on_a_kernel_filesystem_is_refused(cfg: dict[str, Any]) -> None:
    assert problems(set_(cfg, run_dir="/proc/rlbatch-run")) == [
        "run_dir: /proc/rlbatch-run is under /proc, a proc filesystem the kernel provides, where nothing of a run "
        "can be written; put run_dir on a disk (home, project or scratch)"]
    (line,) = problems(set_(cfg, run_dir="/sys/rlbatch-run"))
    assert line.startswith("run_dir: /sys/rlbatch-run is under /sys, a sysfs filesystem")


def test_a_run_dir_this_user_cannot_write_is_refused(cfg: dict[str, Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:  # root passes every permission check: see the directory as a user does
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p) != locked)
    assert problems(set_(cfg, run_dir=str(locked / "run"))) == [
        f"run_dir: {locked / 'run'} cannot be created: {locked} is not writable by this user"]
    assert problems(set_(cfg, run_dir=str(locked))) == [f"run_dir: {locked} is not writable by this user"]


# ----------------------------------------------------------------------------- cluster.mpiexec


def test_an_mpiexec_that_is_not_there_is_refused_for_local_runs(cfg: dict[str, Any], tmp_path: Path) -> None:
    plain = tmp_path / "mpiexec.txt"
    plain.write_text("#!/bin/sh\n")
    for given, why in [("/nonexistent/mpiexec", "does not exist"), (str(tmp_path), "is a directory"),
                       (str(plain), "is not executable"), ("rlbatch-no-such-mpiexec", "is not on PATH")]:
        (line,) = problems(set_(cfg, cluster__mpiexec=given))
        assert line.startswith(f"cluster.mpiexec: {given!r} {why}; give the path of an mpiexec, or leave it empty "
                               f"to use "), line
    check(set_(cfg, cluster__mpiexec="/nonexistent/mpiexec", cluster__name="slurm",
               run_dir=str(REPO_ROOT / ".test-runs" / "refusals-slurm")))  # srun starts a Slurm job's ranks
    check(set_(cfg, cluster__mpiexec=""))  # the mpich wheel's, beside this Python


def test_an_mpich_whose_mpi_init_hangs_under_slurms_pmi2_is_refused_before_submit(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    real = metadata.version
    installed = {"mpich": "4.3.2"}

    def version(name: str) -> str:
        if name != "mpich":
            return real(name)
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    slurm = set_(cfg, cluster__name="slurm", run_dir=str(REPO_ROOT / ".test-runs" / "refusals-slurm"))
    check(slurm)
    installed["mpich"] = "5.0.2"
    assert problems(slurm) == [
        f"cluster.mpi: 'pmi2' with MPICH 5.0.2 (the mpich wheel in {sys.prefix}): its ranks hang or abort in MPI_Init "
        f"under srun --mpi=pmi2 (Slurm's PMI server rejects the addresses it sends); pip install 'mpich<5', or use "
        f"your site's MPI (README, \"MPI\")"]
    check(set_(slurm, cluster__mpi="pmix"))  # another PMI: not this bug
    check(set_(cfg, cluster__mpiexec=""))  # local runs start ranks with mpiexec, not srun's pmi2
    del installed["mpich"]
    check(slurm)  # mpi4py on the site's MPI


# ------------------------------------------------------------------------------------ resume


def committed(store: CheckpointStore, step: int, payload: bytes) -> Path:
    (store.begin(step) / "state.bin").write_bytes(payload)
    return store.commit(step)


def corrupt(checkpoint: Path) -> None:
    """Change a byte of a committed file, keeping its size (only the checksum can tell)."""
    f = checkpoint / "state.bin"
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))


def test_an_explicit_checkpoint_that_fails_its_checksums_is_refused_with_what_to_do(
        cfg: dict[str, Any], tmp_path: Path) -> None:
    run = Path(cfg["run_dir"])
    store = CheckpointStore(run / "checkpoints", keep=5)
    for step in (2, 4, 6):
        committed(store, step, b"state %d" % step)
    bad = run / "checkpoints" / "step_000006"
    check(set_(cfg, resume=str(bad)))
    corrupt(bad)
    for resume in (str(bad), "step_000006"):
        assert problems(set_(cfg, resume=resume)) == [
            f"resume: {bad}: state.bin does not match its sha256 checksum (corrupted or changed); resume=auto "
            f"resumes from this run's newest checkpoint that passes these checks; or name an older one, e.g. "
            f"resume={run / 'checkpoints' / 'step_000004'} (older complete checkpoints in {run / 'checkpoints'}: "
            f"step_000004, step_000002); resume=never starts fresh"]
    # From another run: resume=auto would not look there.
    (line,) = problems(set_(cfg, run_dir=str(tmp_path / "other"), resume=str(bad)))
    assert "resume=auto" not in line and f"e.g. resume={run / 'checkpoints' / 'step_000004'}" in line
    # A run directory resumes from its newest checkpoint that passes, as resume=auto does.
    check(set_(cfg, resume=str(run)))


def test_a_failing_checkpoint_with_nothing_older_says_so(cfg: dict[str, Any]) -> None:
    run = Path(cfg["run_dir"])
    only = committed(CheckpointStore(run / "checkpoints"), 3, b"state")
    corrupt(only)
    (line,) = problems(set_(cfg, resume=str(only)))
    assert line.endswith(f"no older complete checkpoint is in {run / 'checkpoints'}; resume=never starts fresh")
    (line,) = problems(set_(cfg, resume=str(run)))  # nothing in the run passes
    assert line.startswith(f"resume: {run}: no complete checkpoint in {run / 'checkpoints'}\n  skipped {only}: "
                           f"state.bin does not match its sha256 checksum")


# -------------------------------------------------------------------------------- device_mapping


BASE = {"roles": {"actor_train": {"device_mapping": [0, 1], "backend": "fsdp:d2"},
                  "actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"},
                  "reference": {"device_mapping": [0, 1], "backend": ""},
                  "critic": {"enabled": True}}}  # no device_mapping: actor_train's


def place_problems(**roles: Any) -> list[str]:
    cfg = copy.deepcopy(BASE)
    for name, over in roles.items():
        if name == "cluster":
            cfg["cluster"] = over
        else:
            cfg["roles"][name].update(over)
    with pytest.raises(ConfigError) as e:
        place(cfg)
    return e.value.problems


def test_a_huge_gpu_rank_is_reported_on_its_role_with_the_gpus_it_implies() -> None:
    assert place_problems(actor_train={"device_mapping": [0, 1000]}) == [
        "roles.actor_train.device_mapping: GPU rank 1000 leaves GPU ranks 2..999 (998 GPUs) in no role's "
        "device_mapping: GPU ranks number the job's GPUs from 0 without gaps, so the job would take 1001 GPUs "
        "(126 nodes of cluster.gpus_per_node=8) for 3 in use; set cluster.nodes to check GPU ranks against the "
        "cluster's size"]  # once: the critic inherits the mapping, and is not named


def test_with_cluster_nodes_a_huge_rank_is_beyond_the_cluster_and_nothing_else() -> None:
    assert place_problems(actor_infer={"device_mapping": [0, 1000]}, cluster={"nodes": 1}) == [
        "roles.actor_infer.device_mapping: GPU ranks [1000] are beyond the cluster: nodes=1 x gpus_per_node=8 = "
        "8 GPUs (ranks 0..7)"]
    assert place_problems(actor_infer={"device_mapping": [3, 4]}, cluster={"nodes": 1}) == [
        "roles.actor_infer.device_mapping: GPU ranks 3..4 leave GPU rank 2 (1 GPU) in no role's device_mapping: "
        "GPU ranks number the job's GPUs from 0 without gaps (the cluster has nodes=1 x gpus_per_node=8 = 8 GPUs "
        "(ranks 0..7))"]


# ------------------------------------------------------------------------- what a user sees


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "rlbatch.launch", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", ["empty", "under-a-file", "proc", "mpiexec", "resume"])
def test_the_launcher_refuses_before_anything_is_created(tmp_path: Path, case: str) -> None:
    (tmp_path / "notes.txt").write_text("x")
    args = ["cluster.mpiexec=/bin/false"]
    if case == "empty":
        args, expect = [*args, "run_dir="], "run_dir: '' is empty"
    elif case == "under-a-file":
        args, expect = [*args, "run_dir=notes.txt/run"], "is a regular file, not a directory"
    elif case == "proc":
        args, expect = [*args, "run_dir=/proc/rlbatch-run"], "a proc filesystem the kernel provides"
    elif case == "mpiexec":
        args, expect = ["cluster.mpiexec=/nonexistent/mpiexec", "run_dir=run"], "cluster.mpiexec: '/nonexistent/"
    else:
        bad = committed(CheckpointStore(tmp_path / "old" / "checkpoints"), 1, b"state")
        corrupt(bad)
        args, expect = [*args, "run_dir=run", f"resume={bad}"], "state.bin does not match its sha256 checksum"
    before = tree(tmp_path)
    proc = launch(args, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert expect in proc.stderr and "nothing was started." in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert tree(tmp_path) == before
