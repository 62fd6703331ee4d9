"""Hostile code against the sandbox: each snippet gets its expected outcome, and afterwards the
host is as it was (a sentinel file and directory untouched, no process left, no scratch left).

The machine that runs ``make test`` allows user namespaces (as root or unprivileged), so the
strict isolation is what is tested; a node without them gets the ``process`` mode (its own tests
below), and the log says so.
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile
import textwrap

import pytest

from rlbatch.sandbox.limits import Limits
from rlbatch.sandbox.runner import Job, Outcome, Sandbox

SENTINEL_DIR = "/var/tmp/rlbatch-sandbox-sentinel"
SENTINEL = os.path.join(SENTINEL_DIR, "keep.txt")
SECRET = "sentinel-secret-4711"
# Timeouts leave a loaded 2-core machine room: only the looping snippets reach them. A loop ends at
# its test's alarm (5 s of wall time) or, on an idle machine, possibly at the CPU limit: both are
# accepted for the loops (LOOPS), and the CPU limit is set above the alarm so the alarm usually wins.
LIMITS = Limits(timeout_s=20.0, test_timeout_s=5.0, cpu_s=10, memory_mb=256, file_mb=4, tmp_mb=8, processes=16,
                open_files=32, output_kb=4)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    os.makedirs(SENTINEL_DIR, exist_ok=True)
    os.chmod(SENTINEL_DIR, 0o755)
    with open(SENTINEL, "w") as f:
        f.write(SECRET)
    os.chmod(SENTINEL, 0o644)
    box = Sandbox(LIMITS, isolation_mode="auto")
    assert box.mode == "namespaces", "this machine allows user namespaces: the strict mode must be chosen"
    return box


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
                                ["assert True"], "error: OSError", 0),
    "tries the network (dns)": ("import socket\nsocket.getaddrinfo('pypi.org', 443)", ["assert True"], "error", 0),
    "tries loopback": ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))", ["assert True"],
                       "error: OSError", 0),
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
    "kills its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", ["assert True"], "ok", 1),
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
                      "    except OSError: pass\nos._exit(0)", ["assert f(1) == 2"], "no result", 0),
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


LOOPS = ("never returns", "loops at import", "loops in one test only")
LOOP_ENDS = ("timeout", "cpu time limit")


@pytest.fixture(scope="module")
def outcomes(sandbox: Sandbox) -> dict[str, Outcome]:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbatch-sandbox-*")))
    names = list(HOSTILE)
    results = sandbox.run_many([Job(HOSTILE[n][0], HOSTILE[n][1]) for n in names])
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlbatch-sandbox-*")))
    assert after <= before, f"scratch directories left behind: {sorted(after - before)}"
    return dict(zip(names, results, strict=True))


def test_enough_hostile_snippets() -> None:
    assert len(HOSTILE) >= 30


@pytest.mark.parametrize("name", list(HOSTILE))
def test_outcome(outcomes: dict[str, Outcome], name: str) -> None:
    code, tests, reason, passed = HOSTILE[name]
    got = outcomes[name]
    assert got.passed == passed, (got, got.output)
    assert got.total == len(tests)
    ends = LOOP_ENDS if name in LOOPS else (reason,)
    assert got.reason.startswith(ends), (got.reason, got.tests, got.output)
    if passed < len(tests):
        assert got.reason != "ok"


def test_host_unchanged(outcomes: dict[str, Outcome]) -> None:
    with open(SENTINEL) as f:
        assert f.read() == SECRET
    assert oct(os.stat(SENTINEL).st_mode & 0o777) == oct(0o644)
    assert not os.path.exists("/etc/rlbatch-owned")
    left = subprocess.run(["pgrep", "-f", "rlbatch-sandbox|import sys\nfor _|os.fork"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left running: {left.stdout}"


def test_output_is_capped(outcomes: dict[str, Outcome]) -> None:
    out = outcomes["prints a gigabyte"].output
    assert 0 < len(out) <= LIMITS.output_kb << 10


def test_worker_keeps_serving(sandbox: Sandbox, outcomes: dict[str, Outcome]) -> None:
    [again] = sandbox.run_many([Job(GOOD, ["assert f(41) == 42"])])
    assert (again.passed, again.reason) == (1, "ok")


def test_process_mode_contains_what_it_can() -> None:
    """Without namespaces: limits, timeout, crash and syntax still give reward 0 and a reason."""
    box = Sandbox(LIMITS, isolation_mode="process")
    cases = {"never returns": LOOP_ENDS, "allocates all memory": ("error: MemoryError",),
             "segfaults": ("crashed (SIGSEGV)",), "does not parse": ("syntax",), "good code still works": ("ok",),
             "exits early": ("no result",)}
    got = box.run_many([Job(HOSTILE[n][0], HOSTILE[n][1]) for n in cases])
    for (name, reasons), outcome in zip(cases.items(), got, strict=True):
        assert outcome.reason.startswith(reasons), (name, outcome)


def test_refuses_bad_limits() -> None:
    with pytest.raises(ValueError, match=r"sandbox.memory_mb.*got 16"):
        Sandbox(Limits(memory_mb=16))
    with pytest.raises(ValueError, match=r"sandbox.timeout_s must be > 0, got 0"):
        Sandbox(Limits(timeout_s=0))
    with pytest.raises(ValueError, match=r"isolation must be auto, namespaces or process, got 'docker'"):
        Sandbox(isolation_mode="docker")
