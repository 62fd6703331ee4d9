"""The child side of one sandboxed execution: standard library only, its source run as ``python -I -S -c``.

It reads one job (a ``marshal``-ed dict: a built-in module, nothing to import) from stdin, then, before any of the job's code runs:

1. with ``isolate_fs`` (inside fresh user, mount, pid and network namespaces): every mount is
   remounted read-only, private empty tmpfs mounts cover ``/tmp``, ``/var/tmp`` and ``/dev/shm``,
   and the working directory is ``/tmp/work``;
2. with ``drop_caps``: no new privileges, the capability bounding set and all capabilities
   dropped (the namespaces' root can then neither remount nor unmount anything);
3. resource limits: CPU seconds, address space, file size, processes, open files, no core dumps.

It runs the job's code, then each test, in one namespace, and writes one line per test to the
result descriptor: ``<nonce> <index> pass|fail <reason>``, flushed after each test so tests done
before a crash are kept. Outcomes are judged by the parent from these lines and the exit status.
"""

import marshal
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


def _libc():
    import ctypes  # only under namespaces: importing it costs as much as starting the interpreter

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _mount(src, target, fstype, flags, data):
    ctypes, libc = _libc()
    enc = [x.encode() if isinstance(x, str) else x for x in (src, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points():
    """Mount points with their per-mount flags, parents before children (mountinfo order)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= _FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def isolate_filesystem(tmp_mb):
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    for point, flags in _mount_points():
        if point.startswith("/proc"):
            continue  # the pid namespace's own /proc (read-only remount of it is refused)
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)
        except OSError:
            if point == "/":
                raise
    for point in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(point):
            _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    os.makedirs("/tmp/work", exist_ok=True)
    os.chdir("/tmp/work")


def drop_capabilities():
    ctypes, libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the kernel's last capability

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def set_limits(lim):
    def cap(kind, value):
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    # SIGXCPU at the soft limit (a "cpu time limit" outcome); SIGKILL only a second later, at the
    # hard one (SIGKILL would also make util-linux unshare exit 1 instead of passing the signal on).
    resource.setrlimit(resource.RLIMIT_CPU, (int(lim["cpu_s"]), int(lim["cpu_s"]) + 1))
    cap(resource.RLIMIT_AS, int(lim["memory_mb"]) << 20)
    cap(resource.RLIMIT_FSIZE, int(lim["file_mb"]) << 20)
    cap(resource.RLIMIT_NOFILE, int(lim["open_files"]))
    cap(resource.RLIMIT_NPROC, int(lim["processes"]))


class _TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _TestTimeout()


def main():
    job = marshal.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    nonce, result_fd = job.pop("nonce"), job.pop("result_fd")
    results = os.fdopen(result_fd, "w", buffering=1)
    if job["isolate_fs"]:
        # A session of its own inside the pid namespace: kill(0, ...) then reaches nothing outside
        # (the launcher that started the namespace shares the caller's process group otherwise).
        os.setsid()
        isolate_filesystem(job["limits"]["tmp_mb"])
    if job["drop_caps"]:
        drop_capabilities()
    set_limits(job["limits"])
    signal.signal(signal.SIGALRM, _alarm)
    test_timeout = float(job["limits"]["test_timeout_s"])

    def report(index, ok, reason):
        results.write(f"{nonce} {index} {'pass' if ok else 'fail'} {reason}\n")

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    code, tests = job["code"], job["tests"]
    del job
    try:
        compiled = compile(code, "<solution>", "exec")
    except (SyntaxError, ValueError) as exc:
        report(-1, False, f"syntax: {type(exc).__name__}")
        return
    try:
        signal.setitimer(signal.ITIMER_REAL, test_timeout)
        exec(compiled, namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _TestTimeout:
        report(-1, False, "timeout")
        return
    except BaseException as exc:  # noqa: BLE001 (the solution's own failure, whatever it is)
        signal.setitimer(signal.ITIMER_REAL, 0)
        report(-1, False, f"error: {type(exc).__name__}")
        return
    report(-1, True, "defined")
    for index, test in enumerate(tests):
        try:
            signal.setitimer(signal.ITIMER_REAL, test_timeout)
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(index, True, "ok")
        except _TestTimeout:
            report(index, False, "timeout")
        except AssertionError:
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(index, False, "wrong")
        except BaseException as exc:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(index, False, f"error: {type(exc).__name__}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
