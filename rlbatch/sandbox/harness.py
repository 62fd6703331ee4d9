"""The child side of one sandboxed execution: standard library only, its source run as ``python -I -S -c``.

Two processes, so that nothing the tested code does can decide a test's outcome:

- the *judge* (this process) reads the job from stdin in two frames: first the code and the
  limits, then, only after it has forked the subject, the nonce, the result descriptor and the
  tests. It runs the tests itself, in a namespace the tested code never touches, and writes one
  line per test to the result descriptor: ``<nonce> <index> pass|fail <reason>``, flushed after
  each test so tests done before a crash are kept.
- the *subject* (forked before the judge knows the tests) runs the code. The judge's namespace
  holds, for each name the tests use that the code defines, a stand-in: calling it sends the
  arguments to the subject, which calls the real function and sends back its result as plain data
  (``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bool``, ``None`` and ``list``, ``tuple``,
  ``dict``, ``set``, ``frozenset`` of those, checked by exact type: a subclass is refused). The
  judge decodes the reply into its own objects and compares them with its own operators, so a
  result that overrides ``__eq__``, a patched builtin, a patched harness or an early exit in the
  subject cannot make a test pass; the subject never holds an expected value to copy.

Before the subject runs any code: with ``isolate_fs`` (inside fresh user, mount, pid and network
namespaces), every mount is remounted read-only and private tmpfs mounts cover ``/tmp``,
``/var/tmp`` and ``/dev/shm``; with ``drop_caps``, no capabilities; always, where the kernel has
Landlock, a file system limited to its own directory, the scratch places, the device files and,
read-only, the system's and the interpreter's directories (``limit_files``), then resource limits
and a seccomp filter that refuses (EPERM) the system calls that act on another process (signals,
ptrace, process_vm_*, pidfd_*, another process's rlimits, priority or affinity), leaving the
process group (so killing the group ends every process the code started), and the network:
``socket`` and ``socketpair`` for any family but AF_UNIX, and io_uring. The judge is not
dumpable: the subject can neither trace it nor open its ``/proc/<pid>/mem`` or ``fd``.
"""

import builtins
import ctypes
import marshal
import os
import resource
import select
import signal
import stat
import struct
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 4, 22, 38, 24

# System calls the subject may not make, per architecture: (audit arch, always refused, refused
# unless their first argument, a pid, is 0 = the caller, refused unless their first argument, an
# address family, is AF_UNIX). Numbers from the kernel's syscall tables. io_uring is refused
# whole: its requests (IORING_OP_SOCKET, IORING_OP_CONNECT...) would reach the network without a
# socket() call the filter sees. (socketcall, i386's way to open a socket, is refused with the
# rest of that ABI.)
DENIED_SYSCALLS = {
    "x86_64": (0xC000003E,
               {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
                "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
                "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "process_madvise": 440,
                "setpriority": 141, "ioprio_set": 251, "migrate_pages": 256, "move_pages": 279,
                "setsid": 112, "setpgid": 109,
                "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427},
               {"prlimit64": 302, "sched_setaffinity": 203, "sched_setscheduler": 144, "sched_setparam": 142,
                "sched_setattr": 314},
               {"socket": 41, "socketpair": 53}),
    "aarch64": (0xC00000B7,
                {"kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
                 "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
                 "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "process_madvise": 440,
                 "setpriority": 140, "ioprio_set": 30, "migrate_pages": 238, "move_pages": 239,
                 "setsid": 157, "setpgid": 154,
                 "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427},
                {"prlimit64": 261, "sched_setaffinity": 122, "sched_setscheduler": 119, "sched_setparam": 118,
                 "sched_setattr": 274},
                {"socket": 198, "socketpair": 199}),
}
AF_UNIX = 1
# Landlock (Linux >= 5.13, where enabled): the same system call numbers on x86_64 and aarch64.
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_ABI1 = (1 << 13) - 1  # the rights of ABI 1: the four above, remove and make (dir, file, fifo, socket...)
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3 and 5
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The rights a rule on a file (not a directory) may grant."""
SCOPE_ABSTRACT_UNIX_SOCKET = 1  # ABI 6: no connecting to abstract sockets bound outside the domain
READ_ONLY_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Beneath these (and the interpreter's own directories) the subject may read and execute; beneath
``/proc`` and ``/sys`` read; beneath ``/dev`` read and write device files; beneath ``OWN_DIRS``
anything. Nothing else on the file system can be opened, listed, written or executed."""
OWN_DIRS = (".", "/tmp", "/var/tmp", "/dev/shm")
"""Its working directory and the usual scratch places (private tmpfs under namespaces; the node's
own in process mode, where ``tempfile`` falls back to ``/tmp`` for another user than root)."""
MAX_REPLY = 8 << 20
"""Largest reply the judge reads from the subject (a result bigger than this fails its test)."""
GRACE_S = 2.0
"""Seconds past a test's timeout the judge waits for the subject's own alarm before killing it."""
_EXITS = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(src, target, fstype, flags, data):
    libc = _libc()
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
    libc = _libc()
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


def landlock_abi():
    """The kernel's Landlock ABI version; 0 where it has none (older than 5.13, or not enabled)."""
    abi = _libc().syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(abi, 0)


def _file_rules():
    """(path, rights) for ``limit_files``: see ``READ_ONLY_DIRS``."""
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    interpreter = {os.path.dirname(os.path.realpath(sys.executable)), *sys.path,
                   *(os.path.join(prefix, "lib") for prefix in (sys.base_prefix, sys.base_exec_prefix))}
    rules = [(path, read) for path in (*READ_ONLY_DIRS, *sorted(interpreter))]
    rules += [("/proc", FS_READ_FILE | FS_READ_DIR), ("/sys", FS_READ_FILE | FS_READ_DIR),
              ("/dev", FS_READ_FILE | FS_WRITE_FILE | FS_READ_DIR | FS_TRUNCATE | FS_IOCTL_DEV)]
    return rules + [(path, -1) for path in OWN_DIRS]


def limit_files():
    """With Landlock, from here on this process and every process it starts open files only where
    ``READ_ONLY_DIRS`` says, and (ABI >= 6) connect to no abstract socket bound outside. Returns
    the ABI in force, 0 where the kernel has no Landlock (then nothing is limited)."""
    abi = landlock_abi()
    if abi == 0:
        return 0
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    handled = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    # struct landlock_ruleset_attr: handled_access_fs, handled_access_net (ABI 4), scoped (ABI 6).
    attr = (ctypes.c_uint64 * 3)(handled, 0, SCOPE_ABSTRACT_UNIX_SOCKET if abi >= 6 else 0)
    ruleset = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), ctypes.byref(attr),
                           ctypes.c_size_t(8 if abi < 4 else 16 if abi < 6 else 24), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr (packed)
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        for path, rights in _file_rules():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this node
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    rights &= FS_FILE_RIGHTS
                rule = PathBeneath(rights & handled, fd)
                if libc.syscall(ctypes.c_long(LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(1),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.syscall(ctypes.c_long(LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def seccomp_program(machine):
    """The BPF filter (a list of (code, jt, jf, k)) that refuses ``DENIED_SYSCALLS[machine]``."""
    arch, always, self_only, unix_only = DENIED_SYSCALLS[machine]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    prog = [(ld_abs, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny),  # another ABI (i386 via int 0x80)
            (ld_abs, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # x32 numbers
    for nr in always.values():
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
    # nr matches: load the low 32 bits of args[0] (a pid_t, an int family: the kernel reads no
    # more) and allow only the one value: 0 is the caller itself; AF_UNIX stays on this host.
    for nr, only in [*((nr, 0) for nr in self_only.values()), *((nr, AF_UNIX) for nr in unix_only.values())]:
        prog += [(jeq, 0, 4, nr), (ld_abs, 0, 0, 16), (jeq, 0, 1, only), (ret, 0, 0, allow), (ret, 0, 0, deny)]
    return prog + [(ret, 0, 0, allow)]


def deny_other_processes():
    """Install ``seccomp_program`` for this process and every process it starts."""
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    prog = seccomp_program(os.uname().machine)

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(prog))(*[Insn(*i) for i in prog])
    fprog = Prog(len(prog), insns)
    if libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


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
    # ``nproc``, from the worker: limits.processes for the code plus the tasks of this uid that are
    # not the code's (the judge, unshare; where the uid is shared, those running at the start).
    cap(resource.RLIMIT_NPROC, int(lim["nproc"]))


# -- plain data: the only values that cross from the subject to the judge ------------------------

class _NotPlain(Exception):
    pass


_CONTAINERS = {list: b"L", tuple: b"U", set: b"E", frozenset: b"Z"}
_MAKE = {b"L": list, b"U": tuple, b"E": set, b"Z": frozenset}


def encode(x, out=None, depth=0):
    """``x`` as bytes, by exact type only (no method of ``x`` is called); ``_NotPlain`` for anything
    else. A format of its own: json would cost the harness the import of ``re`` and ``enum`` (as
    much as the rest of its start), and ``marshal`` is not safe to load from an untrusted writer."""
    top = out is None
    out = [] if top else out
    t = type(x)
    if x is None or t is bool:
        out.append(b"N" if x is None else b"T" if x else b"F")
    elif t is int:
        digits = str(x).encode()  # ValueError past the interpreter's digit limit
        out.append(b"I" + struct.pack(">I", len(digits)) + digits)
    elif t is float:
        out.append(b"D" + struct.pack(">d", x))
    elif t is complex:
        out.append(b"C" + struct.pack(">dd", x.real, x.imag))
    elif t is str or t is bytes:
        data = x.encode("utf-8", "surrogatepass") if t is str else x
        out.append((b"S" if t is str else b"B") + struct.pack(">I", len(data)) + data)
    elif depth >= 100:
        raise _NotPlain("nested more than 100 deep")
    elif t in _CONTAINERS:
        out.append(_CONTAINERS[t] + struct.pack(">I", len(x)))
        for v in x:
            encode(v, out, depth + 1)
    elif t is dict:
        out.append(b"M" + struct.pack(">I", len(x)))
        for k, v in x.items():
            encode(k, out, depth + 1)
            encode(v, out, depth + 1)
    else:
        raise _NotPlain(_type_name(t))
    return b"".join(out) if top else b""


def decode(data):
    """The judge's own objects from ``encode``'s bytes; ValueError for anything else."""
    try:
        value, end = _decode(data, 0, 0)
    except (TypeError, struct.error) as exc:  # an unhashable key, a short buffer
        raise ValueError(str(exc)) from None
    if end != len(data):
        raise ValueError("trailing bytes")
    return value


def _decode(data, at, depth):
    tag = data[at:at + 1]
    at += 1
    if tag in (b"N", b"T", b"F"):
        return {b"N": None, b"T": True, b"F": False}[tag], at
    if tag == b"D":
        return struct.unpack_from(">d", data, at)[0], at + 8
    if tag == b"C":
        re_, im = struct.unpack_from(">dd", data, at)
        return complex(re_, im), at + 16
    if depth >= 100 or len(data) < at + 4:
        raise ValueError("malformed")
    [n] = struct.unpack_from(">I", data, at)
    at += 4
    if tag in (b"I", b"S", b"B"):
        if len(data) < at + n:
            raise ValueError("malformed")
        raw = data[at:at + n]
        value = int(raw.decode("ascii")) if tag == b"I" else raw.decode("utf-8", "surrogatepass") if tag == b"S" else raw
        return value, at + n
    if tag in _MAKE or tag == b"M":
        if n > len(data):
            raise ValueError("malformed")
        items = []
        for _ in range(n * 2 if tag == b"M" else n):
            item, at = _decode(data, at, depth + 1)
            items.append(item)
        if tag == b"M":
            return dict(zip(items[::2], items[1::2], strict=True)), at
        return _MAKE[tag](items), at
    raise ValueError("malformed")


def _type_name(t):
    try:
        name = type.__dict__["__name__"].__get__(t)  # not a metaclass's own __name__
    except Exception:  # noqa: BLE001
        return "?"
    return name if isinstance(name, str) and name.isidentifier() and len(name) <= 64 else "?"


def _send(fd, kind, value):
    """One message: ``(kind, value)``, plain data (``_NotPlain`` or ValueError if ``value`` is not)."""
    data = encode((kind, value))
    msg = struct.pack(">I", len(data)) + data
    while msg:
        msg = msg[os.write(fd, msg):]


def _read_exactly(fd, n, deadline=None):
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError()
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# -- the subject: runs the code, answers calls -------------------------------------------------

class _TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _TestTimeout()


def _quit():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (the code may have replaced or closed it)
            pass
    os._exit(0)


def _subject(code, lim, req, rep):
    keep = {1, 2, req, rep}
    for fd in range(max(keep)):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    os.closerange(max(keep) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    try:
        os.open("/dev/null", os.O_RDONLY)  # fd 0: reads of stdin see its end
    except OSError:
        pass
    limit_files()
    set_limits(lim)
    deny_other_processes()
    signal.signal(signal.SIGALRM, _alarm)
    timeout = float(lim["test_timeout_s"])

    def timed(seconds, fn, *args, **kwargs):
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        compiled = compile(code, "<solution>", "exec")
    except (SyntaxError, ValueError) as exc:
        _send(rep, "syntax", _type_name(type(exc)))
        _quit()
    del code
    try:
        timed(timeout, exec, compiled, namespace)
    except _TestTimeout:
        _send(rep, "timeout", None)
        _quit()
    except BaseException as exc:  # noqa: BLE001 (the code's own failure, whatever it is)
        _send(rep, "error", _type_name(type(exc)))
        _quit()
    defined = []
    for name, value in list(namespace.items()):
        if type(name) is str and name.isidentifier() and not name.startswith("__"):
            if callable(value):
                defined.append((name, "call", None))
            else:
                try:
                    encode(value)
                    defined.append((name, "value", value))
                except (_NotPlain, ValueError):
                    pass
    _send(rep, "defined", defined)
    while True:
        try:
            [size] = struct.unpack(">I", _read_exactly(req, 4))
            _, (name, args, kwargs, seconds) = decode(_read_exactly(req, size))
        except EOFError:
            _quit()
        try:
            result = timed(seconds, namespace[name], *args, **kwargs)
            kind, value = "ok", result
        except _TestTimeout:
            kind, value = "timeout", None
        except BaseException as exc:  # noqa: BLE001
            kind, value = "raise", _type_name(type(exc))
        try:
            _send(rep, kind, value)
        except _NotPlain as exc:
            _send(rep, "not_plain", exc.args[0])
        except ValueError:  # an int past the interpreter's digit limit
            _send(rep, "not_plain", "int")


# -- the judge: runs the tests, stand-ins for the code's names ----------------------------------

class _RemoteGone(BaseException):
    """The subject is no longer there (the reason is the test's outcome)."""


class _RemoteTimeout(BaseException):
    pass


class RemoteError(Exception):
    """An exception the subject's code raised that has no builtin class of that name."""


class NotPlainResult(Exception):
    """The code returned something other than plain data."""


class RemoteExit(BaseException):
    """SystemExit, KeyboardInterrupt or GeneratorExit raised by the code: the test fails with it."""


_SIGNAL_REASONS = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit",
                   signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGBUS: "crashed (SIGBUS)",
                   signal.SIGABRT: "crashed (SIGABRT)", signal.SIGKILL: "killed"}


class _Subject:
    def __init__(self, pid, req, rep):
        self.pid, self.req, self.rep = pid, req, rep
        self.gone = ""
        self.deadline = 0.0

    def _end(self, reason):
        """Stop the subject (if still there), remember why it is gone, and say so to the test."""
        if not self.gone:
            status = None
            if not reason:  # its channel closed: an exit of its own says how, once it is reaped
                for _ in range(500):
                    done, st = os.waitpid(self.pid, os.WNOHANG)
                    if done:
                        status = st
                        break
                    time.sleep(0.002)
            if status is None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(self.pid, 0)
            elif os.WIFSIGNALED(status):
                reason = _SIGNAL_REASONS.get(os.WTERMSIG(status), f"signal {os.WTERMSIG(status)}")
            self.gone = reason or "no result"
        raise _RemoteGone(self.gone)

    def receive(self, deadline):
        if self.gone:
            raise _RemoteGone(self.gone)
        try:
            [size] = struct.unpack(">I", _read_exactly(self.rep, 4, deadline))
            if size > MAX_REPLY:
                self._end("result too large")
            reply = decode(_read_exactly(self.rep, size, deadline))
        except TimeoutError:
            self._end("timeout")
        except EOFError:
            self._end("")
        except ValueError:
            self._end("malformed reply")
        if type(reply) is not tuple or len(reply) != 2 or type(reply[0]) is not str:
            self._end("malformed reply")
        return reply

    def call(self, name, args, kwargs):
        if self.gone:
            raise _RemoteGone(self.gone)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _RemoteTimeout()
        try:
            _send(self.req, "call", (name, list(args), kwargs, left))
        except (_NotPlain, ValueError) as exc:
            raise TypeError(f"an argument of {name}() is not plain data ({exc.args[0]})") from None
        except OSError:
            self._end("")
        kind, value = self.receive(self.deadline + GRACE_S)
        if kind == "ok":
            return value
        if kind == "timeout":
            raise _RemoteTimeout()
        if kind == "not_plain":
            raise NotPlainResult(value if isinstance(value, str) and value.isidentifier() else "?")
        if kind == "raise" and isinstance(value, str) and value.isidentifier():
            if value in _EXITS:
                raise RemoteExit(value)
            cls = getattr(builtins, value, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls()
            raise type(value, (RemoteError,), {})()
        self._end("malformed reply")


def _stand_in(subject, name):
    def call(*args, **kwargs):
        return subject.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _names_used(tests):
    """Every name the tests' code looks up (attribute names too: a superset is harmless)."""
    names, todo = set(), []
    for index, test in enumerate(tests):
        try:
            todo.append(compile(test, f"<test {index}>", "exec"))
        except (SyntaxError, ValueError):
            continue
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo.extend(c for c in code.co_consts if type(c) is type(code))
    return names


def _read_frame(fd):
    [size] = struct.unpack(">Q", _read_exactly(fd, 8))
    return marshal.loads(_read_exactly(fd, size))


def main():
    job = _read_frame(0)
    lim = job["limits"]
    if job["isolate_fs"]:
        # A session of its own inside the pid namespace: kill(0, ...) then reaches nothing outside
        # (the launcher that started the namespace shares the caller's process group otherwise).
        os.setsid()
        isolate_filesystem(lim["tmp_mb"])
    if job["drop_caps"]:
        drop_capabilities()
    if _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _subject(job["code"], lim, req_r, rep_w)
        except BaseException:  # the harness's own set-up failed (the code's failures are answers)
            import traceback

            traceback.print_exc()
        finally:
            _quit()
    os.close(req_r)
    os.close(rep_w)
    del job
    # Only now the tests: the subject was forked without them.
    secret = _read_frame(0)
    nonce, tests = secret["nonce"], secret["tests"]
    results = os.fdopen(secret["result_fd"], "w", buffering=1)
    del secret
    set_limits(lim)
    timeout = float(lim["test_timeout_s"])
    subject = _Subject(pid, req_w, rep_r)

    def report(index, ok, reason):
        results.write(f"{nonce} {index} {'pass' if ok else 'fail'} {reason}\n")

    try:
        _judge(subject, tests, timeout, report)
    finally:
        if not subject.gone:  # its requests end: it flushes its output and exits (else it is killed)
            os.close(req_w)
            try:
                subject.receive(time.monotonic() + 1.0)
            except _RemoteGone:
                pass


def _judge(subject, tests, timeout, report):
    try:
        kind, value = subject.receive(time.monotonic() + timeout + GRACE_S)
    except _RemoteGone as exc:
        report(-1, False, exc.args[0])
        return
    if kind != "defined" or type(value) is not list:
        text = value if isinstance(value, str) and value.isidentifier() else "?"
        report(-1, False, {"syntax": f"syntax: {text}", "timeout": "timeout", "error": f"error: {text}"}.get(
            kind, "malformed reply"))
        return
    report(-1, True, "defined")
    # Stand-ins only for names the tests use and the builtins do not provide: the code cannot
    # replace `isinstance` or `AssertionError` for the tests by defining one.
    wanted = _names_used(tests) - set(dir(builtins))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for item in value:
        if type(item) is not tuple or len(item) != 3 or type(item[0]) is not str or item[0] not in wanted:
            continue
        name, what, data = item
        if what == "call":
            namespace[name] = _stand_in(subject, name)
        elif what == "value":
            namespace[name] = data
    for index, test in enumerate(tests):
        subject.deadline = time.monotonic() + timeout
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            report(index, True, "ok")
        except AssertionError:
            report(index, False, "wrong")
        except _RemoteTimeout:
            report(index, False, "timeout")
        except _RemoteGone as exc:
            report(index, False, exc.args[0])
        except RemoteExit as exc:
            report(index, False, f"error: {exc.args[0]}")
        except NotPlainResult as exc:
            report(index, False, f"error: not plain data ({exc.args[0]})")
        except BaseException as exc:  # noqa: BLE001
            report(index, False, f"error: {type(exc).__name__}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
