"""Run untrusted code against its tests: one fresh, contained process per execution, many at once.

    sandbox = Sandbox(Limits(), isolation="auto")
    [outcome] = sandbox.run_many([Job(code="def f(x):\\n    return x + 1", tests=["assert f(1) == 2"])])
    outcome.passed, outcome.total, outcome.reason

Whatever the code does (loops, forks, allocates, prints, crashes, exits, tries the network or
the file system), the caller gets an ``Outcome`` and keeps serving: the execution's process tree
is killed at its wall-clock timeout, its scratch files are removed, and its result is read only
from the harness's per-test lines (tagged with a random nonce), never from the code's output.
"""

from __future__ import annotations

import marshal
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rlbatch.config.limits import Limits
from rlbatch.sandbox import isolation

_SIGNAL_REASONS = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit",
                   signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGBUS: "crashed (SIGBUS)",
                   signal.SIGABRT: "crashed (SIGABRT)", signal.SIGKILL: "killed"}


@dataclass(frozen=True)
class Job:
    code: str
    tests: tuple[str, ...] | list[str]


@dataclass
class Outcome:
    passed: int
    total: int
    reason: str
    """``ok`` when every test passed; else why not (``syntax: ...``, ``wrong``, ``timeout``,
    ``error: ZeroDivisionError``, ``error: not plain data (<type>)``, ``file size limit``,
    ``crashed (SIGSEGV)``, ``result too large``, ``no result``...)."""
    tests: list[str] = field(default_factory=list)
    """Per-test outcome: ``ok``, ``wrong``, ``timeout``, ``error: <Exception>``, ``not run``."""
    output: str = ""
    """The first ``Limits.output_kb`` of stdout+stderr."""
    seconds: float = 0.0

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class Sandbox:
    def __init__(self, limits: Limits | None = None, isolation_mode: str = "auto", workers: int = 0) -> None:
        self.limits = limits or Limits()
        self.limits.check()
        self.mode = isolation.resolve(isolation_mode)
        if self.mode == "process":
            isolation.guard_worker()
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        # A node where the harness cannot set itself up (no seccomp, an interpreter the execution's
        # user cannot run...) would score every response 0: refuse to start instead, with why.
        probe = self.run(Job("def f():\n    return 1\n", ["assert f() == 1"]))
        if probe.reason != "ok":
            raise RuntimeError(f"sandbox ({self.mode}): a right program fails here ({probe.reason}); "
                               f"its output: {probe.output[-1500:]!r}")

    def run_many(self, jobs: Iterable[Job], on_done: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
        """Every job, ``workers`` at a time; ``on_done(index, outcome)`` as each finishes."""
        jobs = list(jobs)
        out: list[Outcome | None] = [None] * len(jobs)

        def one(i: int) -> None:
            out[i] = self.run(jobs[i])
            if on_done is not None:
                on_done(i, out[i])  # type: ignore[arg-type]

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(one, range(len(jobs))))
        return out  # type: ignore[return-value]

    def run(self, job: Job) -> Outcome:
        start = time.perf_counter()
        user = isolation.lease()
        group = None
        try:
            scratch = tempfile.mkdtemp(prefix="rlbatch-sandbox-")
            try:
                outcome, group = self._run(job, scratch, start, user)
                return outcome
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            user.release(group)

    def _run(self, job: Job, scratch: str, start: float, user: isolation.Lease) -> tuple[Outcome, int]:
        """The outcome, and the execution's process group (killed; maybe not yet reaped)."""
        lim, nonce, tests = self.limits, secrets.token_hex(16), list(job.tests)
        namespaced = self.mode == "namespaces"
        work = os.path.join(scratch, "work")
        os.mkdir(work, 0o700)
        env = dict(isolation.SAFE_ENV, HOME="/tmp/work" if namespaced else work,
                   TMPDIR="/tmp/work" if namespaced else work)
        if not namespaced and user.uid is not None:
            os.chown(work, user.uid, user.uid)
        # The code's own processes and threads: the kernel counts every task of the uid.
        limits = dict(lim.as_dict(), nproc=isolation.nproc_limit(self.mode, lim.processes, user))
        # Unlinked files: the execution reaches them by no path (in process mode the scratch
        # directory is on its file system), only through the descriptors it is given.
        with tempfile.TemporaryFile(dir=scratch) as out, tempfile.TemporaryFile(dir=scratch) as res:
            # Two frames: the harness forks the process that runs the code after reading the first
            # and before reading the second, so that process never holds the tests or the nonce.
            public = {"code": job.code, "limits": limits, "isolate_fs": namespaced, "drop_caps": namespaced}
            secret = {"nonce": nonce, "tests": tests, "result_fd": res.fileno()}
            payload = b"".join(len(b).to_bytes(8, "big") + b for b in (marshal.dumps(public, 4), marshal.dumps(secret, 4)))
            proc = subprocess.Popen(isolation.command(self.mode), stdin=subprocess.PIPE, stdout=out, stderr=out,
                                    pass_fds=(res.fileno(),), cwd=work, env=env, start_new_session=True,
                                    **user.popen_kwargs())
            timed_out = False
            try:
                proc.communicate(payload, timeout=lim.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:
                pass
            _kill_tree(proc)
            out.seek(0)
            output = out.read(lim.output_kb << 10).decode(errors="replace")
            res.seek(0)
            lines = res.read(1 << 20).decode(errors="replace").splitlines()
        return (_judge(lines, nonce, len(tests), proc.returncode, timed_out, output, time.perf_counter() - start),
                proc.pid)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill the execution's session (under namespaces, ``--kill-child`` then ends its pid namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _judge(lines: list[str], nonce: str, total: int, returncode: int, timed_out: bool, output: str,
           seconds: float) -> Outcome:
    per_test = ["not run"] * total
    defined = None
    for line in lines:
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce:
            continue
        try:
            index = int(parts[1])
        except ValueError:
            continue
        reason = parts[3] if len(parts) > 3 else ""
        if index == -1:
            defined = reason
        elif 0 <= index < total:
            per_test[index] = reason
    passed = sum(t == "ok" for t in per_test)
    if timed_out:
        ended = "timeout"
    elif returncode < 0:
        ended = _SIGNAL_REASONS.get(signal.Signals(-returncode), f"signal {-returncode}")
    elif returncode > 128 and returncode - 128 in _SIGNAL_REASONS:  # a shell-style status from unshare
        ended = _SIGNAL_REASONS[signal.Signals(returncode - 128)]
    else:
        ended = ""
    if defined is None:
        reason = ended or "no result"
    elif defined != "defined":
        reason = defined
    elif passed == total:
        reason = "ok"
    else:
        reason = next((t for t in per_test if t not in ("ok", "not run")), "") or ended or "exited"
        if "not run" in per_test and ended:
            reason = ended
    return Outcome(passed, total, reason, per_test, output, seconds)
