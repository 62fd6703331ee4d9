"""Ranks forked from one process per node that has imported torch already, so that they share its
memory (``RLBATCH_FORKSERVER=1``; what ``tools/bench/scale.py`` runs its worlds with).

``import torch`` alone costs a process ~150 MB of private memory (its modules, its C++ operator
tables); a rank of a running job ~180-220 MB PSS. Forked from a process that has done that import,
a rank shares those pages with every other rank of the node until it writes to them (copy on
write; ``gc.freeze`` keeps the collector from touching them): ~23 MB private a rank, plus ~8 MB for
its stub, instead (measured with the sleep engines; ``docs/scale.md``).

mpiexec still starts every rank (run under MPICH's Hydra only so far, not under srun), as ``python -m rlbatch.worker <run_dir>``: with the
variable set, that process is a stub that imports neither torch nor MPI. The first stub of a run
on a node starts the node's zygote (``python -m rlbatch.runtime.zygote <socket> <run_dir>``, in a session
of its own); each stub then sends the zygote its argv, environment, working directory and
standard descriptors, and Hydra's PMI socket (``PMI_FD``) where there is one, over a Unix socket.
The zygote forks a child that takes them over, initialises MPI (which the zygote never does) and
runs the stub's entry point (``rlbatch.worker.main``): to MPI it is the rank. The stub forwards
SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 to the
child and exits with its exit code; a child whose stub dies kills itself. The zygote exits once
it has had no child for ``IDLE_EXIT_S``.
"""

from __future__ import annotations

import array
import fcntl
import gc
import hashlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

ENV = "RLBATCH_FORKSERVER"
"""Set to 1 in a run's environment: its ranks are forked from a zygote per node."""
IDLE_EXIT_S = 30.0
START_TIMEOUT_S = 600.0
"""How long a stub waits for its node's zygote to import torch and listen (a loaded machine)."""
PRELOAD = ("torch", "rlbatch.loop.program", "rlbatch.loop.rank_runtime", "rlbatch.runtime.world",
           "rlbatch.runtime.mpi_dataplane", "rlbatch.config.load", "rlbatch.plugins",
           "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_fast")
"""What the zygote imports before it forks (every rank imports them), and then the run's plugins. It
builds nothing: memory a child allocates lands in the free space of the zygote's heap, and each
page it writes there is copied (a tokenizer loaded here and dropped cost each rank ~25 MB more)."""
MAX_FDS = 4


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def socket_path(run_dir: str) -> str:
    key = hashlib.sha1(f"{os.path.abspath(run_dir)}:{os.getuid()}".encode()).hexdigest()[:16]
    return f"/tmp/rlbatch-zygote-{key}.sock"


def _send(conn: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj)
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise EOFError("the peer closed the connection")
        out += chunk
    return out


def _recv_int(conn: socket.socket) -> int:
    (n,) = struct.unpack("!I", _recv_exact(conn, 4))
    value = pickle.loads(_recv_exact(conn, n))
    if not isinstance(value, int):
        raise TypeError(f"the rank zygote sent {value!r}, not a process id or an exit code")
    return value


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def _zygote_connection(path: str, run_dir: str, log: str) -> socket.socket:
    """A connection to this node's zygote, started by the first stub to get the lock (its output to
    ``log``: not to the stub's, which mpiexec reads until every holder has closed it)."""
    if (s := _connect(path)) is not None:
        return s
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (s := _connect(path)) is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
            with open(log, "ab") as out:
                subprocess.Popen([sys.executable, "-m", "rlbatch.runtime.zygote", path, run_dir], env=env,
                                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            deadline = time.monotonic() + START_TIMEOUT_S
            while (s := _connect(path)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the rank zygote at {path} did not start in {START_TIMEOUT_S:.0f}s")
                time.sleep(0.2)
    return s


def stub(argv: list[str], entry: str) -> int:
    """This process's part as a stub: have the zygote fork the rank, which runs ``entry``
    ('module:function', called with the run directory, returning the exit code), and wait for its
    exit code."""
    conn = _zygote_connection(socket_path(argv[1]), argv[1], os.path.join(argv[1], f"zygote-{socket.gethostname()}.log"))
    fds = [0, 1, 2]
    pmi = os.environ.get("PMI_FD")
    if pmi is not None and pmi.isdigit():
        fds.append(int(pmi))
    request = pickle.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "entry": entry})
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], fds)
    child = _recv_int(conn)

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        code = _recv_int(conn)
    except (EOFError, OSError):
        code = 1  # the child died without a word (a signal, os._exit after MPI_Abort)
    return code


def _run_child(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the rank the stub stands for."""
    for target, fd in zip((0, 1, 2), fds[:3], strict=False):
        os.dup2(fd, target)
    env = dict(request["env"])
    if len(fds) > 3:
        os.set_inheritable(fds[3], True)
        env["PMI_FD"] = str(fds[3])
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    sys.argv = list(request["argv"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _send(conn, os.getpid())

    def watch_stub() -> None:  # the stub sends nothing more: end of file is its death
        try:
            conn.recv(1)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch_stub, daemon=True).start()
    code = 1
    try:
        from mpi4py import MPI

        MPI.Init_thread(MPI.THREAD_MULTIPLE)  # what mpi4py's import does where it initialises MPI
        import importlib

        module, _, function = str(request["entry"]).partition(":")
        code = int(getattr(importlib.import_module(module), function)(sys.argv[1]))
        MPI.Finalize()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _send(conn, code)  # then the stub exits, and this process with it
        except OSError:
            pass
    os._exit(code)


def preload(run_dir: str) -> None:
    """Import what every rank of the run imports (``PRELOAD``, the run's plugins)."""
    import importlib
    from pathlib import Path

    for module in PRELOAD:
        importlib.import_module(module)
    from rlbatch.config.load import load_config
    from rlbatch.plugins import import_plugins
    from rlbatch.runtime.rundir import RunDir

    import_plugins(list(load_config(RunDir(Path(run_dir).resolve()).config).plugins))


def serve(path: str, run_dir: str) -> None:
    """The zygote: import what every rank imports, then fork a rank for each stub that asks."""
    import mpi4py

    mpi4py.rc.initialize = False  # each child initialises MPI itself, with its own PMI identity
    mpi4py.rc.finalize = False
    preload(run_dir)
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path + ".tmp")
    listener.listen(1024)
    os.rename(path + ".tmp", path)  # stubs connect only once it listens
    listener.settimeout(1.0)
    children: set[int] = set()
    last = time.monotonic()
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                children = {pid for pid in children if _alive(pid)}
                if not children and time.monotonic() - last > IDLE_EXIT_S:
                    return
                continue
            last = time.monotonic()
            conn.settimeout(None)
            fds_arr = array.array("i")
            header = conn.recv(4, socket.MSG_PEEK)
            (n,) = struct.unpack("!I", header)
            msg, ancdata, _, _ = conn.recvmsg(4 + n, socket.CMSG_LEN(MAX_FDS * fds_arr.itemsize))
            msg += _recv_exact(conn, 4 + n - len(msg))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds_arr.frombytes(data[: len(data) - (len(data) % fds_arr.itemsize)])
            fds = list(fds_arr)
            request = pickle.loads(msg[4:])
            pid = os.fork()
            if pid == 0:
                try:
                    listener.close()
                    _run_child(conn, request, fds)
                finally:
                    os._exit(1)  # never back into the zygote's loop
            children.add(pid)
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        for leftover in (path, path + ".lock"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
    os._exit(0)  # without the interpreter's teardown of what it preloaded (nanobind's leak reports)
