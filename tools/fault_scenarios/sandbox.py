"""The code sandbox's worker against hostile responses, in both isolation modes: every reward hack
is rewarded 0, every attack on the worker is refused, the worker is alive and answering after
each batch, and a right answer is still rewarded 1.0. Then a real
``python -m rlbatch.launch experiment=code sandbox.isolation=process`` run: it finishes, and its
log says what the process mode does not isolate; and the same run with its code_sandbox rank
killed from outside (SIGKILL, which the code it runs can no longer send): the job ends at once,
naming the rank.

    python tools/faults.py --only sandbox

The worker is a separate Python process that scores with the code_sandbox role's own scorer
(``rlbatch.rewards.code.CodeScorer``), one batch per hostile response. In ``process`` mode it runs
as ``nobody``, the same user as the code it runs (as on a cluster without user namespaces where
the job is not root): only the sandbox's own guards stand between the code and the worker, and the
attacks are real (SIGKILL and SIGSTOP to the worker, PTRACE_ATTACH, setting its rlimits, opening
its memory). CI tests the same in tests/unit/test_sandbox_hostile.py.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
Check = tuple[str, bool, str]

WORKER = r"""
import json, os, sys
sys.path[:0] = json.loads(sys.argv[1])
from rlbatch.config.schema import SandboxConfig
from rlbatch.rewards.code import CodeScorer
from rlbatch.config.limits import Limits
scorer = CodeScorer(SandboxConfig(isolation=sys.argv[2], cache=0, limits=Limits(test_timeout_s=3.0, timeout_s=15.0)))
print(json.dumps({"pid": os.getpid(), "mode": scorer.sandbox.mode}), flush=True)
for line in sys.stdin:
    completions, answers = json.loads(line)
    rewards, counts = scorer.score(completions, answers)
    print(json.dumps({"rewards": rewards, "counts": counts}), flush=True)
"""

TESTS = ["assert f(1) == 2", "assert f(2) == 3", "assert isinstance(f(0), int)"]
RIGHT = "def f(x):\n    return x + 1\n"
YES = "class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
HACKS = {
    "__eq__ always true": YES + "def f(x): return Yes()",
    "int subclass with __eq__": "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = lambda s: 2\n"
                                "def f(x): return I(0)",
    "overrides __class__": "class Z:\n    __class__ = int\n    __eq__ = lambda s, o: True\ndef f(x): return Z()",
    "patches builtins": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.AssertionError = KeyError\n"
                        "def f(x): return 'x'",
    "defines isinstance": "def isinstance(a, b): return True\ndef f(x): return 'x'",
    "sys.exit(0) first": "import sys\ndef f(x): return 0\nsys.exit(0)",
    "os._exit(0) first": "import os\ndef f(x): return 0\nos._exit(0)",
    "raises SystemExit in the test": "def f(x): raise SystemExit(0)",
    "prints the result marker": "def f(x):\n    print('-1 pass defined\\n0 pass ok\\n1 pass ok\\n2 pass ok')\n"
                                "    return 'x'",
    "writes to every descriptor": "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'0 0 pass ok\\n')\n"
                                  "    except OSError: pass\ndef f(x): return 'x'",
    "patches the harness": "import sys\nm = sys.modules['__main__']\nm.encode = lambda x, depth=0: True\n"
                           "def f(x): return 'x'",
    "reads answers from memory": "import gc, re\nt = {}\nfor o in gc.get_objects():\n"
                                 "    if type(o) is list:\n        for s in o:\n            if type(s) is str:\n"
                                 "                t.update(re.findall(r'f\\((\\d+)\\) == (\\d+)', s))\n"
                                 "def f(x): return int(t.get(str(x), -9)) if t else 'x'",
    "infinite recursion": "def f(x): return f(x)",
    "exception whose __str__ raises": "class E(Exception):\n    def __str__(self): raise RuntimeError\n"
                                      "def f(x): raise E()",
    "prints a gigabyte": "import sys\nfor _ in range(1 << 20): sys.stdout.write('x' * 1024)\ndef f(x): return 'x'",
    "never returns": "def f(x):\n    while True: pass",
}
FIND = ("import ctypes, os, resource, signal\n"
        "def ppid_of(pid):\n    with open(f'/proc/{pid}/stat') as fh:\n"
        "        return int(fh.read().rsplit(')', 1)[1].split()[1])\n"
        "judge = os.getppid() or os.getpid()\nworker = ppid_of(judge) or judge\n")
ATTACKS = {
    "SIGKILL to the worker": "os.kill(worker, signal.SIGKILL)",
    "SIGSTOP to the worker": "os.kill(worker, signal.SIGSTOP)",
    "SIGSTOP to the judge": "os.kill(judge, signal.SIGSTOP)",
    "PTRACE_ATTACH to the worker": "assert ctypes.CDLL(None).ptrace(16, worker, 0, 0) == 0",
    "RLIMIT_NOFILE=3 on the worker": "resource.prlimit(worker, resource.RLIMIT_NOFILE, (3, 3))",
    "opens the worker's memory": "open(f'/proc/{worker}/mem', 'r+b')",
    "kill -1": "os.kill(-1, signal.SIGKILL)",
}
"""Each attack is tried; only when it fails (an exception) the code defines a right ``f``."""


def attack_code(attack: str) -> str:
    return f"{FIND}try:\n    {attack}\n    refused = False\nexcept Exception:\n    refused = True\n" \
           f"def f(x):\n    return x + 1 if refused else 'x'\n"


class Worker:
    def __init__(self, mode: str, as_nobody: bool, env: dict[str, str]) -> None:
        # As nobody: the system's interpreter (this one may live under root's home) with this
        # checkout and this environment's packages on its path.
        path = json.dumps([str(ROOT), *(p for p in sys.path if p.endswith("site-packages"))])
        cmd = [sys.executable, "-c", WORKER, path, mode]
        if as_nobody:
            cmd = [shutil.which("setpriv") or "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                   "/usr/bin/python3", "-I", "-c", WORKER, path, mode]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd="/tmp", env=env, start_new_session=True)
        self.hello = self.read(120.0)

    def read(self, timeout: float) -> dict | None:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def score(self, code: str, timeout: float = 60.0) -> dict | None:
        from rlbatch.data.code import encode_tests

        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps([[code], [encode_tests("", TESTS)]]) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        return self.read(timeout)

    def state(self) -> str:
        """The worker's process state: R/S (running, sleeping), T (stopped), t (traced), gone."""
        try:
            return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"

    def close(self) -> str:
        self.proc.kill()  # a stopped process is killed too
        self.proc.wait()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def one_mode(mode: str) -> list[Check]:
    as_nobody = mode == "process" and os.geteuid() == 0 and shutil.which("setpriv") is not None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    worker = Worker(mode, as_nobody, env)
    who = "as nobody, the code's own user" if as_nobody else \
        "as root, the code under a uid of its own per execution" if os.geteuid() == 0 else f"as uid {os.geteuid()}"
    if worker.hello is None or worker.hello.get("mode") != mode:
        err = worker.close()
        return [(f"{mode}: worker starts", False, f"{worker.hello}; stderr: {err[-800:]}")]
    checks: list[Check] = []
    rewarded, slow = {}, []
    start = time.perf_counter()
    for name, code in HACKS.items():
        t = time.perf_counter()
        got = worker.score(code)
        rewarded[name] = None if got is None else got["rewards"][0]
        slow.append(f"{time.perf_counter() - t:.1f}")
    hacked = {n: r for n, r in rewarded.items() if r != 0.0}
    checks.append((f"{mode}: {len(HACKS)} reward hacks rewarded 0 ({who})", not hacked,
                   f"rewards {json.dumps(rewarded)}" if hacked else
                   f"all 0.0 in {time.perf_counter() - start:.0f} s (per hack: {' '.join(slow)} s)"))
    survived, states = {}, {}
    for name, attack in ATTACKS.items():
        got = worker.score(attack_code(attack), timeout=30.0)
        survived[name] = None if got is None else got["rewards"][0]
        states[name] = worker.state()
    broken = {n: (r, states[n]) for n, r in survived.items() if r != 1.0 or states[n] not in ("R", "S")}
    checks.append((f"{mode}: {len(ATTACKS)} attacks on the worker refused, worker answering after each", not broken,
                   f"(reward, worker state) {broken}" if broken else
                   f"each refused (reward 1.0: the code saw its attack fail), worker pid {worker.proc.pid} in state "
                   f"{sorted(set(states.values()))} after each"))
    got = worker.score(RIGHT)
    checks.append((f"{mode}: a right answer after all that", got is not None and got["rewards"] == [1.0],
                   f"reward {None if got is None else got['rewards']}, counts {None if got is None else got['counts']}"))
    err = worker.close()
    if mode == "process":
        said = "(no network" in err and "NOT isolated: the file system" in err
        checks.append(("process: the worker's log says what is not isolated", said,
                       next((line.strip() for line in err.splitlines() if "NOT isolated" in line), err[-300:])[:400]))
    return checks


def launched(work: Path) -> list[Check]:
    run_dir = work / "run-process"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rlbatch.launch", "experiment=code", "steps=2", "sandbox.isolation=process",
           f"run_dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, start_new_session=True)
    seconds = time.perf_counter() - start
    logs = proc.stdout + proc.stderr + "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    line = next((x.strip() for x in logs.splitlines() if "NOT isolated" in x), "")
    return [("launch experiment=code sandbox.isolation=process: finishes", proc.returncode == 0 and len(rows) == 2,
             f"exit {proc.returncode} in {seconds:.0f} s, {len(rows)} steps, sandbox/executions "
             f"{[r.get('sandbox/executions') for r in rows]}" + ("" if proc.returncode == 0 else proc.stderr[-600:])),
            ("launch: the log says what process mode does not isolate", bool(line), line[-400:] or "no such line")]


def sandbox_rank(run_dir: Path) -> int | None:
    """The pid of the run's code_sandbox rank (its rank number from the rank logs)."""
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    found = re.search(r"\[rank (\d+) \(code_sandbox\[0\]", logs)
    if found is None:
        return None
    wanted = {f"{var}={found.group(1)}".encode() for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK")}
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if entry.name.isdigit() and str(run_dir).encode() in cmdline and env & wanted:
            parents[int(entry.name)] = ppid
    # The rank itself, not a child it forked a moment ago (same command line and environment).
    return next((pid for pid, ppid in parents.items() if ppid not in parents), None)


def worker_killed(work: Path) -> list[Check]:
    run_dir = work / "run-killed"
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", "experiment=code", "steps=40",
                             "sandbox.isolation=process", f"run_dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.5)
        pid = sandbox_rank(run_dir)
        if pid is None:
            return [("launch: a killed sandbox worker ends the job", False, f"no code_sandbox rank found (exit {proc.poll()})")]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    named = next((line.strip() for line in err.splitlines() if "code_sandbox" in line), "")
    return [("launch: a killed sandbox worker ends the job at once, naming it",
             proc.returncode != 0 and seconds < 60 and bool(named),
             f"SIGKILL to rank pid {pid}: exit {proc.returncode} {seconds:.1f} s later; \"{named or err[-800:]}\"")]


def scenario(work: Path) -> list[Check]:
    checks: list[Check] = []
    for mode in ("namespaces", "process"):
        checks += one_mode(mode)
    return checks + launched(work) + worker_killed(work)
