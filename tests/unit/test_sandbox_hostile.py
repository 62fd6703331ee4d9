"""Hostile code against the sandbox: each snippet gets its expected outcome, and afterwards the
host is as it was (a sentinel file and directory untouched, no process left, no scratch left).

Three lists, run once for the module on two sandboxes (``namespaces`` and ``process``) sharing one
pool: HOSTILE (resources, escapes, crashes), HACKS (ways to get a reward without a right answer:
each scores 0 or the honest fraction) and ATTACKS (code that goes for the worker or the harness:
each checks from inside that it was refused, and answers right only then, so ``ok`` means refused
and still judged). The machine that runs ``make test`` allows user namespaces, so both modes run.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rlbatch.config.limits import Limits
from rlbatch.sandbox import isolation
from rlbatch.sandbox.harness import DENIED_SYSCALLS, landlock_abi, seccomp_program
from rlbatch.sandbox.runner import Job, Outcome, Sandbox

SENTINEL_DIR = "/var/tmp/rlbatch-sandbox-sentinel"
SENTINEL = os.path.join(SENTINEL_DIR, "keep.txt")
SECRET = "sentinel-secret-4711"
# A data set as a run keeps it: world-readable, in a directory of its own outside the system's.
DATA_DIR = "/var/lib/rlbatch-sandbox-data"
DATA = os.path.join(DATA_DIR, "problems.jsonl")
LANDLOCK = landlock_abi()
# Timeouts leave a loaded 2-core machine room: only the looping snippets reach them. A loop ends at
# its test's alarm (5 s of wall time) or, on an idle machine, possibly at the CPU limit: both are
# accepted for the loops (LOOPS), and the CPU limit is set above the alarm so the alarm usually wins.
LIMITS = Limits(timeout_s=20.0, test_timeout_s=3.0, cpu_s=8, memory_mb=256, file_mb=4, tmp_mb=8, processes=16,
                open_files=32, output_kb=4)


@pytest.fixture(scope="module")
def sandboxes() -> dict[str, Sandbox]:
    os.makedirs(SENTINEL_DIR, exist_ok=True)
    os.chmod(SENTINEL_DIR, 0o755)
    with open(SENTINEL, "w") as f:
        f.write(SECRET)
    os.chmod(SENTINEL, 0o644)
    os.makedirs(DATA_DIR, exist_ok=True)
    os.chmod(DATA_DIR, 0o755)
    with open(DATA, "w") as f:
        f.write(json.dumps({"test": "assert f(1) == 2", "secret": SECRET}) + "\n")
    os.chmod(DATA, 0o644)
    boxes = {"namespaces": Sandbox(LIMITS, isolation_mode="auto"), "process": Sandbox(LIMITS, isolation_mode="process")}
    assert boxes["namespaces"].mode == "namespaces", "this machine allows user namespaces: auto must choose them"
    return boxes


def snippet(code: str) -> str:
    return textwrap.dedent(code).strip("\n")


# name -> (code, tests, expected reason prefix, expected passed)
GOOD = "def f(x):\n    return x + 1\n"
HOSTILE: dict[str, tuple[str, list[str], str, int]] = {
    "does not parse": ("def f(x) return x", ["assert f(1) == 2"], "syntax", 0),
    "indentation": ("def f(x):\nreturn x", ["assert f(1) == 2"], "syntax", 0),
    "null byte": ("x = 1\0", ["assert True"], "syntax", 0),
    "never returns": ("def f(x):\n    while True: pass", ["assert f(1) == 2"], "timeout", 0),
    "loops at import": ("while True:\n    pass", ["assert True"], "timeout", 0),
    "sleeps": ("import time\ntime.sleep(60)", ["assert True"], "timeout", 0),
    "ignores the alarm": (snippet("""
        import signal, time
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True: time.sleep(1)
        """), ["assert True"], "timeout", 0),
    "burns cpu in a thread": (snippet("""
        import threading, signal
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        def spin():
            while True: pass
        threading.Thread(target=spin).start()
        spin()
        """), ["assert True"], "", 0),
    "prints a gigabyte": ("import sys\nfor _ in range(1 << 20):\n    sys.stdout.write('x' * 1024)\n", ["assert True"],
                          "", 0),
    "writes a huge file": ("open('big', 'wb').write(b'x' * (64 << 20))", ["assert True"], "error", 0),
    "allocates all memory": ("x = bytearray(4 << 30)", ["assert True"], "error: MemoryError", 0),
    "allocates step by step": ("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", ["assert True"],
                               "error: MemoryError", 0),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", ["assert True"], "", 0),
    "thread bomb": ("import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
                    ["assert True"], "error", 0),
    "opens many files": ("fs = [open('/dev/null') for _ in range(10000)]", ["assert True"], "error: OSError", 0),
    "tries the network (tcp)": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
                                ["assert True"], "error: PermissionError", 0),
    "tries the network (udp)": ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
                                "('1.1.1.1', 53))", ["assert True"], "error: PermissionError", 0),
    "tries the network (ipv6)": ("import socket\nsocket.socket(socket.AF_INET6).connect(('::1', 22))", ["assert True"],
                                 "error: PermissionError", 0),
    "tries the network (dns)": ("import socket\nsocket.getaddrinfo('pypi.org', 443)", ["assert True"], "error", 0),
    "tries loopback": ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))", ["assert True"],
                       "error: PermissionError", 0),
    "uses AF_UNIX socket pairs": ("import socket\na, b = socket.socketpair()\na.sendall(b'hi')\nassert b.recv(2) == b'hi'\n"
                                  + GOOD, ["assert f(1) == 2"], "ok", 1),
    "reads the data set": (f"def f(x):\n    return open('{DATA}').read()", ["assert f(1) == 2"],
                           "error: PermissionError", 0),
    "lists the data set's directory": (f"import os\ndef f(x):\n    return os.listdir('{DATA_DIR}')",
                                       ["assert f(1) == 2"], "error: PermissionError", 0),
    "uses a temporary file": ("import tempfile\ndef f(x):\n    with tempfile.TemporaryFile() as t:\n"
                              "        t.write(str(x + 1).encode()); t.seek(0)\n        return int(t.read())",
                              ["assert f(1) == 2"], "ok", 1),
    "reads the standard library": ("import json, zoneinfo, sqlite3\ndef f(x):\n    return json.loads(str(x + 1))",
                                   ["assert f(1) == 2"], "ok", 1),
    "writes outside its directory": (f"open('{SENTINEL}', 'w').write('owned')", ["assert True"], "error", 0),
    "deletes outside": (f"import shutil\nshutil.rmtree('{SENTINEL_DIR}')", ["assert True"], "error", 0),
    "writes the run directory": ("open(__import__('os').environ.get('RLBATCH_RUN_DIR', '/work') + '/x', 'w')",
                                 ["assert True"], "error", 0),
    "chmods outside": (f"import os\nos.chmod('{SENTINEL}', 0o777)", ["assert True"], "error", 0),
    "remounts read-write": ("import subprocess\nr = subprocess.run(['mount', '-o', 'remount,rw', '/'])\n"
                            "assert r.returncode == 0", ["assert True"], "error", 0),
    "reads other samples' scratch": (snippet("""
        import glob
        found = glob.glob('/tmp/rlbatch-sandbox-*') + glob.glob('/tmp/*/work')
        assert not found, found
        """), ["assert True"], "ok", 1),
    "kills its parent": ("import os, signal\ntry: os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError: pass",
                         ["assert True"], "ok", 1),
    "kills everything it sees": ("import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) > 1:\n"
                                 "        try: os.kill(int(p), signal.SIGKILL)\n        except OSError: pass",
                                 ["assert True"], "ok", 1),
    "kills -1": ("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass",
                 ["assert True"], "ok", 1),
    "sees no host processes": ("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                               "assert len(pids) <= 3, pids", ["assert True"], "ok", 1),
    "exits early": ("import os\nos._exit(0)", ["assert True"], "no result", 0),
    "sys.exit": ("import sys\nsys.exit(0)", ["assert True"], "error: SystemExit", 0),
    "segfaults": ("import ctypes\nctypes.string_at(0)", ["assert True"], "crashed (SIGSEGV)", 0),
    "aborts": ("import os\nos.abort()", ["assert True"], "", 0),
    "forges a pass": ("import os\nfor fd in range(3, 20):\n    try: os.write(fd, b'0 0 pass ok\\n')\n"
                      "    except OSError: pass\nos._exit(0)", ["assert f(1) == 2"], "", 0),
    "prints a pass": ("print('-1 defined\\n0 pass ok')\ndef f(x): return 0", ["assert f(1) == 2"], "wrong", 0),
    "reads the environment": ("import os\nbad = [k for k in os.environ if k.startswith(('SLURM', 'PMI', 'OMPI', "
                              "'MPI', 'HF_', 'AWS', 'RLBATCH')) or 'TOKEN' in k]\nassert not bad, bad",
                              ["assert True"], "ok", 1),
    "setuid": ("import os\nos.setuid(0)\nopen('/etc/rlbatch-owned', 'w')", ["assert True"], "error", 0),
    "unshares again": ("import subprocess\nr = subprocess.run(['unshare', '-r', 'sh', '-c', "
                       "'mount -o remount,rw / && touch /etc/rlbatch-owned'])\nassert r.returncode == 0",
                       ["assert True"], "error", 0),
    "good code still works": (GOOD, ["assert f(1) == 2", "assert f(2) == 3"], "ok", 2),
    "partly right": ("def f(x):\n    return 2 * x", ["assert f(1) == 2", "assert f(2) == 3"], "wrong", 1),
    "raises in a test": ("def f(x):\n    return 1 / x", ["assert f(1) == 1", "assert f(0) == 0"],
                         "error: ZeroDivisionError", 1),
    "loops in one test only": ("def f(x):\n    while x == 0: pass\n    return x", ["assert f(1) == 1", "assert f(0) == 0",
                                                                                 "assert f(2) == 2"], "timeout", 2),
}


WRONG = "def f(x):\n    return 0\n"
HOSTILE_CLASS = "class Yes:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
# name -> (code, tests, expected reason prefix, expected passed): a reward without a right answer.
HACKS: dict[str, tuple[str, list[str], str, int]] = {
    "__eq__ always true": (HOSTILE_CLASS + "def f(x):\n    return Yes()", ["assert f(1) == 2", "assert not f(1) != 2"],
                           "error: not plain data (Yes)", 0),
    "int subclass with __eq__ and __hash__": (snippet("""
        class I(int):
            def __eq__(self, other): return True
            def __hash__(self): return hash(2)
        def f(x): return I(0)
        """), ["assert f(1) == 2", "assert f(1) in {2}", "assert isinstance(f(0), int)"], "error: not plain data (I)", 0),
    "str subclass with __eq__": ("class S(str):\n    __eq__ = lambda self, other: True\ndef f(x):\n    return S('no')",
                                 ["assert f(1) == 'yes'"], "error: not plain data (S)", 0),
    "hostile value inside a list": (HOSTILE_CLASS + "def f(x):\n    return [Yes()]", ["assert f(1) == [2]"],
                                    "error: not plain data (Yes)", 0),
    "hostile dict key": (HOSTILE_CLASS + "    def __hash__(self):\n        return 0\ndef f(x):\n    return {Yes(): 1}",
                         ["assert f(1) == {2: 1}"], "error: not plain data", 0),
    "overrides __class__": ("class Z:\n    __class__ = int\n    __eq__ = lambda self, other: True\ndef f(x):\n"
                            "    return Z()", ["assert isinstance(f(1), int) and f(1) == 2"], "error: not plain data (Z)", 0),
    "returns a function": ("def f(x):\n    return lambda *a: True", ["assert f(1)()"], "error: not plain data", 0),
    "patches builtins.AssertionError": ("import builtins\nclass Never(Exception): pass\nbuiltins.AssertionError = Never\n"
                                        + WRONG, ["assert f(1) == 2"], "wrong", 0),
    "patches builtins.isinstance": ("import builtins\nbuiltins.isinstance = lambda *a: True\ndef f(x):\n    return 'x'",
                                    ["assert isinstance(f(0), int)"], "", 0),
    "patches builtins.type": (HOSTILE_CLASS + "import builtins\n_type = type\n"
                              "builtins.type = lambda *a: int if len(a) == 1 else _type(*a)\ndef f(x):\n    return Yes()",
                              ["assert f(1) == 2"], "", 0),
    "defines isinstance": ("def isinstance(a, b):\n    return True\ndef f(x):\n    return 'x'",
                           ["assert isinstance(f(0), int)"], "wrong", 0),
    "defines AssertionError": ("class AssertionError(Exception): pass\n" + WRONG, ["assert f(1) == 2"], "wrong", 0),
    "sys.exit(0) before the tests": ("import sys\n" + WRONG + "sys.exit(0)", ["assert f(1) == 2"],
                                     "error: SystemExit", 0),
    "os._exit(0) before the tests": ("import os\n" + WRONG + "os._exit(0)", ["assert f(1) == 2"], "no result", 0),
    "os._exit(0) in the test": ("def f(x):\n    import os\n    os._exit(0)", ["assert f(1) == 2", "assert True"],
                                "no result", 1),
    "raises SystemExit in the test": ("def f(x):\n    raise SystemExit(0)", ["assert f(1) == 2"],
                                      "error: SystemExit", 0),
    "raises KeyboardInterrupt in the test": ("def f(x):\n    raise KeyboardInterrupt", ["assert f(1) == 2"],
                                             "error: KeyboardInterrupt", 0),
    "raises what the test catches": ("def f(x):\n    raise SystemExit(0)",
                                     ["try:\n    r = f(1)\nexcept Exception:\n    r = 2\nassert r == 2"],
                                     "error: SystemExit", 0),
    "exception whose __str__ raises": ("class E(Exception):\n    def __str__(self):\n        raise RuntimeError\n"
                                       "    __repr__ = __str__\ndef f(x):\n    raise E()", ["assert f(1) == 2"],
                                       "error: E", 0),
    "exception with a hostile metaclass": (snippet("""
        class M(type):
            @property
            def __name__(cls): raise RuntimeError
        def f(x): raise M('Odd', (Exception,), {})()
        """), ["assert f(1) == 2"], "error: Odd", 0),
    "infinite recursion": ("def f(x):\n    return f(x)", ["assert f(1) == 2"], "error: RecursionError", 0),
    "deeply nested result": ("def f(x):\n    r = []\n    for _ in range(10000):\n        r = [r]\n    return r",
                             ["assert f(1) == 2"], "error: not plain data", 0),
    "huge result": ("def f(x):\n    return 'x' * (20 << 20)", ["assert f(1) == 2"], "result too large", 0),
    "prints the result marker": ("def f(x):\n    print('-1 pass defined\\n0 pass ok', flush=True)\n    return 0",
                                 ["assert f(1) == 2"], "wrong", 0),
    "writes to every descriptor": (snippet("""
        import os
        for fd in range(3, 64):
            try: os.write(fd, b'\\x00\\x00\\x00\\x0b{"ok": 2}\\n0 0 pass ok\\n')
            except OSError: pass
        def f(x): return 0
        """), ["assert f(1) == 2", "assert f(2) == 3"], "", 0),
    "patches the harness via sys.modules": (snippet("""
        import sys
        harness = sys.modules['__main__']
        harness.encode = lambda x, depth=0: True
        harness.report = lambda *a: None
        harness.AssertionError = Exception
        def f(x): return 0
        """), ["assert f(1) == 2", "assert f(2) == 3"], "", 0),
    "reads the expected answers from memory": (snippet("""
        import gc, re, sys
        seen = []
        for o in gc.get_objects():
            if type(o) is dict: seen += [v for v in o.values() if type(v) is str]
            elif type(o) in (list, tuple): seen += [v for v in o if type(v) is str]
        frame = sys._getframe()
        while frame:
            seen += [v for v in frame.f_locals.values() if type(v) is str]
            frame = frame.f_back
        table = {}
        for text in seen:
            for a, b in re.findall(r'f\\((\\d+)\\) == (\\d+)', text):
                table[int(a)] = int(b)
        def f(x): return table.get(x, -1)
        """), ["assert f(1) == 7", "assert f(2) == 9"], "wrong", 0),
}

# Code that goes for the worker or the judge; it answers right only when every try was refused.
FIND = snippet("""
    import ctypes, os, resource, signal, socket
    def ppid_of(pid):
        with open(f'/proc/{pid}/stat') as fh:
            return int(fh.read().rsplit(')', 1)[1].split()[1])
    judge = os.getppid() or os.getpid()
    worker = ppid_of(judge) or judge  # under a pid namespace the judge's parent is outside it
    refused = True
    def tried(fn, *args):
        global refused
        try:
            got = fn(*args)
        except OSError:
            return
        if got != -1:  # a libc call through ctypes fails with -1; anything else went through
            refused = False
    """) + "\n"
ANSWER = "\ndef f(x):\n    return x + 1 if refused else 0\n"
ATTACKS: dict[str, str] = {
    "signals the worker": "tried(os.kill, worker, 0)",
    "stops the judge": "tried(os.kill, judge, signal.SIGSTOP)",
    "signals its process group": "tried(os.killpg, 0, signal.SIGCONT)",
    "traces the judge": "tried(ctypes.CDLL(None).ptrace, 0x4206, judge, 0, 0)",  # PTRACE_SEIZE
    "reads the worker's rlimits": "tried(resource.prlimit, worker, resource.RLIMIT_CORE)",
    "renices the judge": "tried(os.setpriority, os.PRIO_PROCESS, judge, 19)",
    "opens the judge's memory": "tried(open, f'/proc/{judge}/mem', 'rb')",
    "opens the judge's stdin": "tried(open, f'/proc/{judge}/fd/0', 'rb')",
    "leaves its process group": "tried(os.setsid)",
    "opens a socket of another family": "for fam in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK):\n"
                                        "    tried(socket.socket, fam, socket.SOCK_DGRAM)\n"
                                        "tried(socket.socketpair, socket.AF_INET)",
    "sets up io_uring": "tried(ctypes.CDLL(None).syscall, 425, 4, ctypes.create_string_buffer(120))",  # io_uring_setup
}

NEEDS_LANDLOCK = {"reads the data set", "lists the data set's directory"}
NOT_IN_PROCESS_MODE = {"reads other samples' scratch", "sees no host processes",
                       # one loop is enough to show the process mode's timeout
                       "loops at import", "sleeps", "burns cpu in a thread", "loops in one test only"}
if isolation.shares_process_budget("process"):
    # A worker that is not root: its executions share its uid's process budget, and a bomb would
    # starve the others running at the same time (docs/sandbox.md).
    NOT_IN_PROCESS_MODE |= {"fork bomb", "thread bomb"}
LOOPS = ("never returns", "loops at import", "loops in one test only")
LOOP_ENDS = ("timeout", "cpu time limit")


def cases() -> dict[tuple[str, str], tuple[str, list[str], str, int]]:
    out = {}
    for mode in ("namespaces", "process"):
        for name, case in HOSTILE.items():
            if mode == "namespaces" or name not in NOT_IN_PROCESS_MODE:
                out[mode, name] = case
        for name, case in HACKS.items():
            out[mode, name] = case
        for name, attack in ATTACKS.items():
            out[mode, name] = (FIND + attack + ANSWER, ["assert f(1) == 2"], "ok", 1)
    return out


CASES = cases()


@pytest.fixture(scope="module")
def outcomes(sandboxes: dict[str, Sandbox]) -> dict[tuple[str, str], Outcome]:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbatch-sandbox-*")))
    keys = list(CASES)
    # One pool for both sandboxes: the slow cases (loops waiting for their alarm) overlap.
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda k: sandboxes[k[0]].run(Job(CASES[k][0], CASES[k][1])), keys))
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbatch-sandbox-*")))
    assert after <= before, f"scratch directories left behind: {sorted(after - before)}"
    return dict(zip(keys, results, strict=True))


def test_enough_hostile_snippets() -> None:
    assert len(HOSTILE) >= 30 and len(HACKS) >= 20 and len(ATTACKS) >= 8


@pytest.mark.parametrize("key", list(CASES), ids=[f"{m}-{n}" for m, n in CASES])
def test_outcome(outcomes: dict[tuple[str, str], Outcome], key: tuple[str, str]) -> None:
    code, tests, reason, passed = CASES[key]
    if key[1] in NEEDS_LANDLOCK and not LANDLOCK:
        pytest.skip("this kernel has no Landlock: the file system is not limited (the log says so)")
    got = outcomes[key]
    assert got.passed == passed, (got, got.output)
    assert got.total == len(tests)
    ends = LOOP_ENDS if key[1] in LOOPS else (reason,)
    assert got.reason.startswith(ends), (got.reason, got.tests, got.output)
    if passed < len(tests):
        assert got.reason != "ok"


def test_host_unchanged(outcomes: dict[tuple[str, str], Outcome]) -> None:
    with open(SENTINEL) as f:
        assert f.read() == SECRET
    assert oct(os.stat(SENTINEL).st_mode & 0o777) == oct(0o644)
    assert not os.path.exists("/etc/rlbatch-owned")
    left = subprocess.run(["pgrep", "-f", "rlbatch-sandbox|import sys\nfor _|os.fork"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left running: {left.stdout}"


def test_output_is_capped(outcomes: dict[tuple[str, str], Outcome]) -> None:
    out = outcomes["namespaces", "prints a gigabyte"].output
    assert 0 < len(out) <= LIMITS.output_kb << 10


def test_worker_keeps_serving(sandboxes: dict[str, Sandbox], outcomes: dict[tuple[str, str], Outcome]) -> None:
    for box in sandboxes.values():
        [again] = box.run_many([Job(GOOD, ["assert f(41) == 42", "assert f(x=1) == 2 and f(-1) is not None"])])
        assert (again.passed, again.reason) == (2, "ok"), again


FORKS = snippet("""
    import os
    def f(x):
        r, w = os.pipe()
        n = 0
        while n < 200:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.close(w)
                os.read(r, 1)
                os._exit(0)
            n += 1
        os.close(w)
        for _ in range(n):
            os.wait()
        print('forked', n)
        return n
    """)
"""Forks until refused, with every child alive, and says how many it got (all reaped again)."""


def _budget_test(mode: str) -> str:
    """The code's own processes: limits.processes, itself included. Where the uid is shared (a worker
    that is not root) the count at its start is added and others may start more meanwhile: most of it."""
    processes = LIMITS.processes
    return f"assert f(0) >= {processes // 2}" if isolation.shares_process_budget(mode) else \
        f"assert f(0) == {processes - 1}"


def test_full_process_budget_beside_other_processes(sandboxes: dict[str, Sandbox]) -> None:
    """More processes than limits.processes already running as `nobody` (under root; as this
    worker's own user otherwise): each execution still forks exactly its own budget, no more (a
    fork bomb stops there too), in either mode (most of it where the worker is not root and its
    executions share its uid)."""
    as_nobody: dict[str, Any] = {"user": isolation.NOBODY, "group": isolation.NOBODY, "extra_groups": []} \
        if os.geteuid() == 0 else {}
    holders = []
    try:
        for _ in range(LIMITS.processes + 8):
            holders.append(subprocess.Popen(["sleep", "600"], **as_nobody))
        got = {mode: box.run(Job(FORKS, [_budget_test(mode)])) for mode, box in sandboxes.items()}
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert {mode: (o.passed, o.reason) for mode, o in got.items()} == {mode: (1, "ok") for mode in sandboxes}, \
        {mode: o.output for mode, o in got.items()}


def _range_tasks() -> dict[int, list[int]]:
    """uid -> pids of the processes whose real uid is in the executions' range."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:", 1)[1].split()[0]) if "\nUid:" in status else -1
        if isolation.UID_BASE <= uid < isolation.UID_BASE + isolation.UID_COUNT:
            out.setdefault(uid, []).append(int(name))
    return out


def _wait_for(what: str, check: Callable[[], Any], seconds: float = 90.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {seconds:.0f} s"
        time.sleep(0.05)
    return got


WHOAMI = snippet("""
    import os
    def uid(x):
        with open('/proc/self/uid_map') as fh:
            inside, outside, count = fh.read().split()[:3]
        return int(outside) if count == '1' else os.getuid()  # under namespaces: the uid outside
    """)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["namespaces", "process"])
def test_concurrent_executions_have_their_own_uid_and_budget(sandboxes: dict[str, Sandbox], mode: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a root worker: while one execution holds all its processes, another one runs under a
    uid of its own from the range and forks its whole budget."""
    if isolation.users() != "own":
        pytest.skip(f"executions run as {isolation.users()}, not a uid of their own each (a worker that is not root)")
    processes = LIMITS.processes
    holds = f"import os, time\nfor _ in range({processes - 1}):\n    if os.fork() == 0:\n" \
            "        time.sleep(600)\n        os._exit(0)\ntime.sleep(600)\n"
    slow = Sandbox(dataclasses.replace(LIMITS, timeout_s=600.0, test_timeout_s=590.0), isolation_mode=mode)
    leased: dict[int, int | None] = {}  # thread -> the uid its last execution got
    lease = isolation.lease

    def recorded() -> isolation.Lease:
        user = lease()
        leased[threading.get_ident()] = user.uid
        return user

    monkeypatch.setattr(isolation, "lease", recorded)
    done: list[Outcome] = []
    holder = threading.Thread(target=lambda: done.append(slow.run(Job(holds, ["assert True"]))))
    holder.start()

    def holding() -> int | None:
        uid = leased.get(holder.ident or 0)
        return uid if uid is not None and len(_range_tasks().get(uid, [])) > processes else None

    try:
        held = _wait_for("the holding execution's processes", lambda: not holder.is_alive() or holding())
        assert holder.is_alive(), f"the holding execution ended: {done}"
        got = sandboxes[mode].run(Job(FORKS + "\n" + WHOAMI, [
            _budget_test(mode), f"assert uid(0) != {held}",
            f"assert {isolation.UID_BASE} <= uid(0) < {isolation.UID_BASE + isolation.UID_COUNT}"]))
    finally:
        while holder.is_alive():  # it ends once its launcher is killed
            for pid in _range_tasks().get(leased.get(holder.ident or 0) or -1, []):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            holder.join(timeout=0.05)
    assert [o.passed for o in done] == [0], done
    assert (got.passed, got.reason) == (3, "ok"), (got.output, got)


def test_no_connection_to_a_listener_on_this_host(sandboxes: dict[str, Sandbox]) -> None:
    """A TCP listener on 127.0.0.1 in this process: code under test, in either mode, cannot reach
    it (``socket()`` is refused for every family but AF_UNIX, so the node's loopback is as closed as
    the rest of the network): the test that tried fails with the error, the others are judged as
    usual, and the listener never saw a connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        connect = f"socket.create_connection(('127.0.0.1', {port}), timeout=30).sendall(b'owned')"
        in_test = f"import socket\ndef f(x):\n    {connect}\n    return x + 1\ndef g(x):\n    return x\n"
        at_import = f"import socket\n{connect}\n{GOOD}"
        for mode, box in sandboxes.items():
            got = box.run(Job(in_test, ["assert f(1) == 2", "assert g(1) == 1"]))
            assert (got.passed, got.reason, got.tests) == (1, "error: PermissionError",
                                                            ["error: PermissionError", "ok"]), (mode, got)
            got = box.run(Job(at_import, ["assert f(1) == 2"]))
            assert (got.passed, got.reason) == (0, "error: PermissionError"), (mode, got)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever queued to be accepted
            listener.accept()


def test_no_connection_to_an_abstract_socket_of_this_host(sandboxes: dict[str, Sandbox]) -> None:
    """AF_UNIX stays open, but not to the node's abstract sockets (no path, no permissions): under
    namespaces they are the network namespace's; in process mode Landlock (ABI >= 6) scopes them."""
    if LANDLOCK < 6:
        pytest.skip(f"Landlock ABI {LANDLOCK}: abstract sockets are scoped from ABI 6 (docs/sandbox.md)")
    name = f"rlbatch-sandbox-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind("\0" + name)
        listener.listen()
        code = f"import socket\ndef f(x):\n    socket.socket(socket.AF_UNIX).connect('\\0{name}')\n    return x + 1\n"
        for mode, box in sandboxes.items():
            got = box.run(Job(code, ["assert f(1) == 2"]))
            assert got.passed == 0 and got.reason.startswith("error: "), (mode, got)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


def _run_filter(prog: list[tuple[int, int, int, int]], arch: int, nr: int, arg0: int = 0) -> str:
    """What the BPF program decides for one system call: a small interpreter of the four
    instructions ``seccomp_program`` uses, over ``struct seccomp_data``."""
    data = nr.to_bytes(4, "little") + arch.to_bytes(4, "little") + bytes(8) + arg0.to_bytes(8, "little")
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = int.from_bytes(data[k:k + 4], "little")
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE, constant operand
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:  # BPF_RET
            return {0x7FFF0000: "allow", 0x00050001: "EPERM"}[k]
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", sorted(DENIED_SYSCALLS))
def test_filter_program_per_machine(machine: str) -> None:
    """The filter of every machine the sandbox knows, run on its table: sockets only for AF_UNIX
    (the kernel reads the family as an int: the upper bits of the register change nothing),
    io_uring and the calls on other processes refused, the caller's own pid allowed, another ABI
    refused, everything else allowed."""
    arch, always, self_only, unix_only = DENIED_SYSCALLS[machine]
    prog = seccomp_program(machine)
    af_unix, af_inet, af_inet6, af_netlink, af_packet = 1, 2, 10, 16, 17
    for name in ("socket", "socketpair"):
        nr = unix_only[name]
        assert _run_filter(prog, arch, nr, af_unix) == "allow"
        assert _run_filter(prog, arch, nr, (1 << 32) | af_unix) == "allow"
        for family in (af_inet, af_inet6, af_netlink, af_packet, 0, (1 << 32) | af_inet, 0xFFFFFFFF):
            assert _run_filter(prog, arch, nr, family) == "EPERM", (name, family)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "kill", "ptrace"):
        assert _run_filter(prog, arch, always[name]) == "EPERM", name
    assert _run_filter(prog, arch, self_only["prlimit64"], 0) == "allow"
    assert _run_filter(prog, arch, self_only["prlimit64"], 1234) == "EPERM"
    assert _run_filter(prog, arch, 0) == "allow"  # read (x86_64) / io_setup (aarch64)
    assert _run_filter(prog, 0x40000003, unix_only["socket"], af_unix) == "EPERM"  # i386: socketcall and the rest
    assert _run_filter(prog, arch, 0x40000000 | 41, af_unix) == "EPERM"  # x32 numbers
    assert len(prog) < 4096  # BPF_MAXINSNS


KERNEL_FILTER = snippet("""
    import ctypes, errno, json, socket, sys
    sys.path.insert(0, sys.argv[1])
    from rlbatch.sandbox.harness import deny_other_processes
    deny_other_processes()
    got = {}
    for name, family, kind in (("inet", socket.AF_INET, socket.SOCK_STREAM), ("inet udp", socket.AF_INET,
                               socket.SOCK_DGRAM), ("inet6", socket.AF_INET6, socket.SOCK_STREAM),
                               ("netlink", socket.AF_NETLINK, socket.SOCK_DGRAM), ("unix", socket.AF_UNIX,
                               socket.SOCK_STREAM)):
        try:
            socket.socket(family, kind).close()
            got[name] = "ok"
        except OSError as exc:
            got[name] = errno.errorcode[exc.errno]
    a, b = socket.socketpair()
    a.sendall(b"x")
    got["unix pair"] = "ok" if b.recv(1) == b"x" else "broken"
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    got["io_uring_setup"] = "ok" if libc.syscall(425, 4, params) >= 0 else errno.errorcode[ctypes.get_errno()]
    print(json.dumps(got))
    """)


def test_filter_in_the_kernel() -> None:
    """The filter installed for real (in a throwaway process): inet, inet6 and netlink sockets and
    io_uring refused with EPERM, AF_UNIX sockets and socket pairs working."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip(f"no system call table for {os.uname().machine}")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", KERNEL_FILTER, repo], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"inet": "EPERM", "inet udp": "EPERM", "inet6": "EPERM", "netlink": "EPERM",
                                       "unix": "ok", "unix pair": "ok", "io_uring_setup": "EPERM"}


def test_plain_data_round_trip() -> None:
    """What crosses from the code to the tests keeps its exact value and type; anything else is refused."""
    from rlbatch.sandbox.harness import _NotPlain, decode, encode

    value = [1, -2.5, float("inf"), 1 + 2j, "é", b"\x00\xff", True, None, (1, (2,)), {"a": [1]}, {3}, frozenset({4}),
             {(1, 2): None}, 10**40]
    back = decode(encode(value))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    for bad in (int, type("I", (int,), {})(1), [object()], {"k": print}, [[[[]]]] * 0 + [eval("[" * 101 + "]" * 101)]):
        with pytest.raises(_NotPlain):
            encode(bad)
    for forged in (b"", b"X", encode([1, 2])[:-1], encode(1) + b"N", b"E" + encode([[1]])[1:], b"L\xff\xff\xff\xff"):
        with pytest.raises(ValueError):
            decode(forged)


SAME_USER = snippet("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from rlbatch.config.limits import Limits
    from rlbatch.sandbox.runner import Job, Sandbox
    box = Sandbox(Limits(test_timeout_s=3.0), isolation_mode="process")
    jobs = [Job(json.loads(sys.argv[2]) + attack + json.loads(sys.argv[3]), ["assert f(1) == 2"])
            for attack in json.loads(sys.argv[4])]
    print(json.dumps([(o.passed, o.reason) for o in box.run_many(jobs)]))
    """)
SAME_USER_ATTACKS = ["os.kill(worker, signal.SIGKILL)", "os.kill(worker, signal.SIGSTOP)",
                     "tried(ctypes.CDLL(None).ptrace, 16, worker, 0, 0)",  # PTRACE_ATTACH: stops it
                     "tried(resource.prlimit, worker, resource.RLIMIT_NOFILE, (3, 3))",
                     "tried(open, f'/proc/{worker}/mem', 'r+b')"]


def test_process_mode_worker_of_the_same_user() -> None:
    """The process mode as a user other than root, where the code runs as the worker's own user:
    the worker (a throwaway one here, run as `nobody`) survives real SIGKILL, SIGSTOP, ptrace,
    prlimit and /proc/<pid>/mem attacks from the code it runs, and judges it."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.path.exists("/usr/bin/python3"):
        pytest.fail("needs root and util-linux setpriv to start a worker as another user (CI runs as root)")
    attacks = [a if a.startswith("tried") else f"try:\n    {a}\nexcept OSError:\n    pass\nelse:\n    refused = False"
               for a in SAME_USER_ATTACKS]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c",
                           SAME_USER, repo, json.dumps(FIND), json.dumps(ANSWER), json.dumps(attacks)],
                          capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [[1, "ok"]] * len(attacks), list(zip(SAME_USER_ATTACKS, got, strict=True))


def test_refuses_bad_limits() -> None:
    with pytest.raises(ValueError, match=r"sandbox.memory_mb.*got 16"):
        Sandbox(Limits(memory_mb=16))
    with pytest.raises(ValueError, match=r"sandbox.timeout_s must be > 0, got 0"):
        Sandbox(Limits(timeout_s=0))
    with pytest.raises(ValueError, match=r"isolation must be auto, namespaces or process, got 'docker'"):
        Sandbox(isolation_mode="docker")


def test_namespaces_is_a_hard_requirement(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Asked for, namespaces that the node lacks are an error with the reason; ``auto`` falls back
    and the log says what the process mode leaves open."""
    monkeypatch.setattr(isolation, "namespaces_available", lambda: (False, "unshare: Operation not permitted"))
    with pytest.raises(RuntimeError, match="sandbox.isolation=namespaces is not available on this node: unshare"):
        Sandbox(isolation_mode="namespaces")
    with caplog.at_level("WARNING", logger="rlbatch.sandbox.isolation"):
        assert Sandbox(isolation_mode="auto").mode == "process"
    assert "open no socket but AF_UNIX ones (no network" in caplog.text, caplog.text
    assert "NOT isolated: the file system" in caplog.text, caplog.text
    caplog.clear()
    monkeypatch.setattr(isolation, "landlock_abi", lambda: 0)
    with caplog.at_level("WARNING", logger="rlbatch.sandbox.isolation"):
        assert Sandbox(isolation_mode="process").mode == "process"
    assert "NOT isolated: the file system (this kernel has no Landlock: an execution reads" in caplog.text, caplog.text


def test_config_refuses_namespaces_the_node_lacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A local run that asks for sandbox.isolation=namespaces is refused before start on a node without them."""
    from rlbatch.checks.validate import check
    from rlbatch.config.schema import RLBatchConfig
    from rlbatch.errors import ConfigError

    cfg = dataclasses.asdict(RLBatchConfig())
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["data"]["name"] = "synthetic_code"
    cfg["roles"]["code_sandbox"] = {"world_size": 1}
    cfg["roles"]["reward"]["enabled"] = False
    cfg["sandbox"]["isolation"] = "namespaces"
    check(cfg)  # this node has them
    monkeypatch.setattr(isolation, "namespaces_available", lambda: (False, "unshare: Operation not permitted"))
    with pytest.raises(ConfigError) as err:
        check(cfg)
    assert any(p.startswith("sandbox.isolation=namespaces: this node cannot") and "Operation not permitted" in p
               for p in err.value.problems), err.value.problems
    cfg["sandbox"]["isolation"] = "auto"
    check(cfg)  # auto falls back (and says so in the workers' log)


def test_refuses_to_start_where_the_harness_cannot_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without seccomp filters (here: the harness's prctl made to fail) would score every
    response 0; the sandbox refuses to start instead, with the harness's own error."""
    source = isolation._harness_source()
    broken = source.replace('    prog = seccomp_program(os.uname().machine)\n',
                            '    raise OSError(22, "prctl(PR_SET_SECCOMP): Invalid argument")\n')
    assert broken != source
    monkeypatch.setattr(isolation, "_harness_source", lambda: broken)
    with pytest.raises(RuntimeError, match=r"sandbox \(process\): a right program fails here \(no result\).*PR_SET_SECCOMP"):
        Sandbox(LIMITS, isolation_mode="process")
