"""The env role's request routing and failure handling (``rlbatch.envs.host``, ``rlbatch.envs.client``),
over an in-process stand-in for the MPI communicator: each rank an inbox, ``send`` / ``improbe`` as
mpi4py's (pickled messages, matched by source and tag, in order).

What a real job adds (mpiexec, a worker killed with SIGKILL) is tests/dist/test_env_role.py's."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from mpi4py import MPI

from rlbatch.config.parse import parse
from rlbatch.engines.base import Generation, SamplingParams, TurnRequest
from rlbatch.envs.base import StepResult
from rlbatch.envs.chat import PlainText
from rlbatch.envs.client import EnvClient, EnvWorkerError, worker_of
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.host import EnvHost
from rlbatch.envs.rollout import Rollout, Start
from rlbatch.envs.trajectories import MultiTurn, summary, trajectory_stats


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def recv(self) -> Any:
        return pickle.loads(self.data)


class Net:
    """Ranks' inboxes: (source, tag, pickled message), in arrival order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inbox: dict[int, list[tuple[int, int, bytes]]] = {}

    def comm(self, rank: int) -> Comm:
        self.inbox.setdefault(rank, [])
        return Comm(self, rank)


class Comm:
    def __init__(self, net: Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def send(self, obj: Any, dest: int, tag: int) -> None:
        data = pickle.dumps(obj)  # what MPI carries: a pickle, so unpicklable replies fail here too
        with self.net.lock:
            self.net.inbox[dest].append((self.rank, tag, data))

    def improbe(self, source: int, tag: int, status: Any = None) -> _Msg | None:
        with self.net.lock:
            box = self.net.inbox[self.rank]
            for i, (src, t, data) in enumerate(box):
                if t == tag and source in (MPI.ANY_SOURCE, src):
                    del box[i]
                    if status is not None:
                        status.Set_source(src)
                    return _Msg(data)
        return None


class Echo:
    """Each turn shows the turn number; the episode ends after ``turns`` actions, reward 1 each.
    ``mode`` makes it fail: 'raise' in step, 'hang' in step, 'garbage' (a step returns a list)."""

    def __init__(self, turns: int = 2, mode: str = "") -> None:
        self.turns, self.mode, self.n = turns, mode, 0

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.seed = seed
        return f"<{seed}>"

    def step(self, action: str) -> StepResult:
        self.n += 1
        if self.mode == "raise":
            raise ValueError("the env broke")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "garbage":
            return [action]  # type: ignore[return-value]
        return StepResult(f"[{self.n}]", 1.0, self.n >= self.turns, {"unpicklable": threading.Lock()})


def _hosts(net: Net, ranks: list[int], limits: EpisodeLimits, mode_of: dict[int, str] | None = None,
           **kw: Any) -> list[EnvHost]:
    hosts = []
    for r in ranks:
        mode = (mode_of or {}).get(r, "")
        hosts.append(EnvHost(net.comm(r), lambda mode=mode: Episode(lambda: Echo(2, mode), limits), f"env[{r}]",
                             **kw).start())
    return hosts


@pytest.fixture
def net() -> Net:
    return Net()


def test_episodes_go_to_the_worker_their_sample_id_picks_and_come_back_with_their_summary(net: Net) -> None:
    hosts = _hosts(net, [1, 2, 3], EpisodeLimits(max_turns=5, step_timeout_s=5))
    client = EnvClient(net.comm(0), [1, 2, 3], timeout_s=10)
    try:
        ids = list(range(10, 22))
        episodes = {sid: client.episode(worker_of(sid, client.size)) for sid in ids}
        firsts = {sid: ep.start({}, sid) for sid, ep in episodes.items()}
        assert [firsts[sid].observation for sid in ids] == [f"<{sid}>" for sid in ids]
        assert sum(len(h.episodes) for h in hosts) == 12
        for h, rank in zip(hosts, (1, 2, 3), strict=True):  # sample id 10 -> worker 1 (rank 2), ...
            w = rank - 1
            assert sorted(h.episodes) == sorted((0, episodes[sid].eid) for sid in ids if sid % 3 == w)
        second = {sid: ep.step("a") for sid, ep in episodes.items()}
        assert all(s.observation == "[1]" and not s.done for s in second.values())
        assert all(s.info == {} for s in second.values()), "only the keys the rollout reads travel"
        last = {sid: ep.step("b") for sid, ep in episodes.items()}
        assert all(s.done and s.end == "done" and s.reward == 1.0 for s in last.values())
        assert all(not h.episodes for h in hosts), "an ended episode is closed and forgotten on its worker"
        for sid, ep in episodes.items():
            assert ep.summary() == {"turns": 2, "end": "done", "reward": 2.0, "env_seconds": pytest.approx(
                ep.summary()["env_seconds"]), "tool_calls": {}, "detail": "", "worker": sid % 3}
        assert [h.counts["episodes"] for h in hosts] == [4, 4, 4] and [h.counts["steps"] for h in hosts] == [8, 8, 8]
    finally:
        for h in hosts:
            h.close()


def test_a_failing_or_hanging_env_on_a_worker_ends_only_its_trajectory(net: Net) -> None:
    """The worker's Episode guards the env as in the rank: raise -> 'error', hang -> 'timeout',
    garbage -> 'invalid'; the other trajectories on the same worker go on."""
    limits = EpisodeLimits(max_turns=5, step_timeout_s=0.5)
    modes = ["raise", "hang", "garbage", ""]
    hosts = [EnvHost(net.comm(1), lambda: Episode(lambda: Echo(2, modes.pop(0)), limits), "env[0]").start()]
    client = EnvClient(net.comm(0), [1], timeout_s=10)
    try:
        eps = [client.episode(0) for _ in range(4)]
        for k, ep in enumerate(eps):
            ep.start({}, k)
        start = time.monotonic()
        steps = [ep.step("x") for ep in eps]
        assert time.monotonic() - start < 5, "a hung env is abandoned at the step timeout"
        assert [s.end for s in steps] == ["error", "timeout", "invalid", None]
        assert "ValueError: the env broke" in steps[0].info["detail"]
        assert [ep.summary()["end"] for ep in eps[:3]] == ["error", "timeout", "invalid"]
        assert eps[3].step("y").end == "done"
    finally:
        hosts[0].close()


def test_a_worker_that_cannot_run_a_request_fails_the_rollout_naming_it(net: Net) -> None:
    hosts = _hosts(net, [5], EpisodeLimits(), on_request=lambda op: 1 / 0 if op == "step" else None)
    client = EnvClient(net.comm(0), [5], timeout_s=10)
    try:
        ep = client.episode(0)
        ep.start({}, 1)
        with pytest.raises(EnvWorkerError, match=r"env\[0\] \(rank 5\) failed on 'step':(.|\n)*ZeroDivisionError"):
            ep.step("x")
    finally:
        hosts[0].close()


def test_a_silent_worker_is_named_when_its_answer_is_overdue(net: Net) -> None:
    net.comm(4)  # a rank that never answers (its host is stuck, not dead: the launcher sees a death)
    client = EnvClient(net.comm(0), [3, 4], timeout_s=0.3)
    with pytest.raises(EnvWorkerError, match=r"env\[1\] \(rank 4\) did not answer 'start' within 0s"):
        client.episode(1).start({}, 0)
    assert not client._pending, "the abandoned request is forgotten; its late reply would be dropped"


class _Scripted:
    """Turns whose every generation is the token 7 (``Rollout``'s engine side)."""

    def __init__(self) -> None:
        self.queue: list[TurnRequest] = []

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self.queue += requests

    def in_flight(self) -> int:
        return len(self.queue)

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out = [(r.key, Generation([7], [-0.5])) for r in self.queue]
        self.queue = []
        return out


class _Tok:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in tokens)


def test_a_rollout_on_env_workers_gives_the_trajectories_of_a_rollout_on_the_rank(net: Net, monkeypatch) -> None:
    """MultiTurn with a client: the same tokens, masks and rewards as with envs on the rank's threads,
    and each trajectory's summary names the worker that hosted it."""
    limits = EpisodeLimits(max_turns=5, step_timeout_s=5)
    hosts = _hosts(net, [1, 2], limits)
    plain = {"env": {"name": "running_sum", "max_turns": 5}, "model": {}}
    try:
        local = MultiTurn(parse(plain).config, _Tok())
        monkeypatch.setattr(local.setup, "episode", lambda: Episode(lambda: Echo(2), limits))
        remote = MultiTurn(parse(plain).config, _Tok(), client=EnvClient(net.comm(0), [1, 2], timeout_s=10))
        assert remote.setup is None, "the workers build the envs, not the rank"
        args = ([[1]] * 6, [{}] * 6, [11, 11, 11, 12, 12, 12])
        with monkeypatch.context() as m:
            m.setattr("rlbatch.envs.trajectories.turns_of", lambda engine: _Scripted())
            a = local(None, args[0], SamplingParams(max_new_tokens=1), args[1], args[2], 0)
            b = remote(None, args[0], SamplingParams(max_new_tokens=1), args[1], args[2], 0, ids=[40, 41, 42, 43, 44, 45])
        assert [(t.prompt, t.response, t.loss_mask, t.rewards, t.end) for t in a] == \
               [(t.prompt, t.response, t.loss_mask, t.rewards, t.end) for t in b]
        assert b[0].response == [7, *map(ord, "[1]"), 7] and b[0].loss_mask == [1, 0, 0, 0, 1]
        assert [summary(t)["worker"] for t in b] == [0, 1, 0, 1, 0, 1]
        assert [summary(t)["worker"] for t in a] == [None] * 6
        stats = trajectory_stats({i: summary(t) for i, t in enumerate(b)})
        assert (stats["env/hosted_frac"], stats["env/hosts"]) == (1.0, 2.0)
        assert "env/hosted_frac" not in trajectory_stats({i: summary(t) for i, t in enumerate(a)})
        assert [h.counts["episodes"] for h in hosts] == [3, 3]
    finally:
        for h in hosts:
            h.close()


def test_a_rollout_stopped_at_the_context_budget_ends_the_remote_episode(net: Net) -> None:
    """``Rollout`` ends a trajectory that outgrows max_context with ``Episode.stop``: on a worker
    too, and its summary then says so."""
    hosts = _hosts(net, [1], EpisodeLimits(max_turns=5, step_timeout_s=5))
    client = EnvClient(net.comm(0), [1], timeout_s=10)
    try:
        ep = client.episode(0)
        [t] = Rollout(_Scripted(), PlainText(lambda s: [ord(c) for c in s]), lambda t: "".join(map(chr, t)), SamplingParams(max_new_tokens=1),
                      max_context=6).run([Start(0, [1], ep, {}, 3)])
        assert t.end == "max_context" and ep.summary()["end"] == "max_context" and not hosts[0].episodes
    finally:
        hosts[0].close()


def test_the_env_role_is_checked_before_anything_starts(cfg: dict[str, Any]) -> None:
    from rlbatch.checks.validate import check
    from rlbatch.placement import ProcessKind
    from rlbatch.plan.layout import from_placement
    from tests.unit.configs import problems, set_

    assert problems(set_(cfg, roles__env={"world_size": 2})) == [
        "roles.env: hosts episodes of an environment (world_size=2), but env.name is not set: name one "
        "(e.g. env.name=running_sum) or remove the role"]
    env = set_(cfg, env__name="running_sum")
    trajectories = cfg["algo"]["prompts_per_step"] * cfg["algo"]["samples_per_prompt"]
    assert problems(set_(env, roles__env={"world_size": trajectories + 1})) == [
        f"roles.env.world_size: {trajectories + 1} env workers for {trajectories} trajectories a step "
        f"(algo.prompts_per_step={cfg['algo']['prompts_per_step']} x algo.samples_per_prompt="
        f"{cfg['algo']['samples_per_prompt']}): each worker hosts whole trajectories, so at most {trajectories} "
        f"workers have any"]
    assert problems(set_(env, roles__env={"world_size": 0})) == ["roles.env.world_size: must be between 1 and 4096, got 0"]
    assert problems(set_(env, roles__env={"world_size": 1, "device_mapping": [0]})) == [
        "roles.env: is a CPU role but asks for GPUs (device_mapping); give it only world_size"]
    without = check(env)
    # CPU processes of their own, spread over the nodes like the code sandbox's, each with its CPUs in
    # the Slurm request and in the planner's layout
    two_nodes = set_(env, cluster__nodes=2, cluster__cpus_per_task=3, cluster__gpus_per_node=2)
    p = check(set_(two_nodes, roles__env={"world_size": 3}))
    role = p.roles["env"]
    assert (role.world_size, role.is_gpu, set(role.nodes)) == (3, False, {0, 1})
    assert [p.processes[w[0]].kind for w in role.workers] == [ProcessKind.CPU] * 3
    assert p.world_size == without.world_size + 3 and p.slurm.cpus_per_task == 3
    assert from_placement(p, 3).roles["env"].world_size == 3
