"""A full disk: the run directory on a real tmpfs with a size limit (mounted here; needs root).

1. Room for one checkpoint (1.9 MiB) and not two: the run saves step 0, then refuses to start step
   1's checkpoint (the last one's size against the free space), exits 1 within seconds, naming the
   path, the bytes needed and free; step 0's checkpoint verifies and exports to a transformers model.
2. Room for less than one: the check before the first save passes on the model's estimate (a lower
   bound), the ranks' writes run out of space half-way; the job still exits at once, naming the disk.
3. Room for almost nothing: the launcher refuses before anything starts (exit 2), writing nothing.

    python tools/faults.py --only disk_full

Before the fix the ranks failed inside the checkpoint write, their error handlers failed again on
the status files, and the job never exited. CI tests the same with an injected ENOSPC instead of a
mount: tests/dist/test_disk_full.py, tests/unit/test_checkpoint_space.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

RUN = ["steps=3", "save_every=1", "cluster.timeout_s=120"]
BOUND_S = 60.0
"""From the moment the disk is found full to the launcher's exit: the ranks abort within seconds
(DiskFull, MPI_Abort); 60 s allows for a loaded 2-core machine and stays below the control
plane's timeout (120 s here), which a rank that never answered would have had to wait out."""

Check = tuple[str, bool, str]


def mount(where: Path, size: str) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def launch(run_dir: Path, *extra: str, mark: str = "") -> tuple[int, str, float]:
    """Run a launch to its end; return its exit code, its console, and the seconds from the first
    console line containing ``mark`` (or from the start) to its exit."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", f"run_dir={run_dir}", *RUN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines, seen = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if mark and seen is None and mark in line:
                seen = time.monotonic()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines), time.monotonic() - (seen or start)


def named(console: str) -> str:
    m = re.search(r"DiskFull: (.*?(mounted at \S+ has [\d.]+ MiB \(\d+ bytes\) free).*?)(\(traceback|$)", console, re.M)
    return m.group(1)[:400] if m else ""


def scenario(work: Path) -> list[Check]:
    checks: list[Check] = []
    fs = work / "fullfs"
    umount(fs)

    # 1. one checkpoint fits, the second does not
    if problem := mount(fs, "3m"):
        return [("mount a 3 MiB tmpfs", False, problem)]
    try:
        code, console, since = launch(fs / "run", mark="step_000000 (save_every)")
        message = named(console)
        checks.append(("one fits, not two: exit 1", code == 1, f"exit code {code}"))
        checks.append((f"... within {BOUND_S:.0f} s of the first checkpoint", since < BOUND_S, f"{since:.1f} s"))
        checks.append(("... names the path, the bytes needed and free", "step 1 needs about" in message
                       and "checkpoints" in message, message))
        from rlbatch.checkpoint import open_checkpoint

        previous = open_checkpoint(fs / "run")
        checks.append(("... step 0's checkpoint verifies (sizes, sha256)", previous.step == 0, str(previous.path)))
        out = work / "exported"
        subprocess.run(["rm", "-rf", str(out)])
        done = subprocess.run([sys.executable, "-m", "rlbatch.export", str(fs / "run"), str(out)], capture_output=True,
                              text=True, timeout=300)
        load = subprocess.run([sys.executable, "-c", "import sys; from transformers import AutoModelForCausalLM; "
                               "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))",
                               str(out)], capture_output=True, text=True, timeout=300)
        checks.append(("... and loads (export, from_pretrained)", done.returncode == 0 and load.returncode == 0,
                       f"{load.stdout.strip()} parameters" if load.returncode == 0 else (done.stderr + load.stderr)[-400:]))
    finally:
        umount(fs)

    # 2. the write itself runs out of space
    if problem := mount(fs, "1700k"):
        return [*checks, ("mount a 1.7 MiB tmpfs", False, problem)]
    try:
        code, console, since = launch(fs / "run", mark="starting fresh")
        message = named(console)
        checks.append(("a write that runs out: exit 1", code == 1, f"exit code {code}"))
        checks.append((f"... within {BOUND_S:.0f} s of the start of the loop", since < BOUND_S, f"{since:.1f} s"))
        checks.append(("... names the disk and its free space", "no space left writing the checkpoint" in message, message))
    finally:
        umount(fs)

    # 3. refused at launch
    if problem := mount(fs, "512k"):
        return [*checks, ("mount a 0.5 MiB tmpfs", False, problem)]
    try:
        code, console, since = launch(fs / "run")
        refusal = next((ln.strip() for ln in console.splitlines() if "needs about" in ln), "")
        checks.append(("no room for one: refused before start, exit 2", code == 2, f"exit code {code}, {since:.1f} s"))
        checks.append(("... naming the bytes needed and free", "free" in refusal, refusal))
        checks.append(("... nothing written", not (fs / "run" / "config.yaml").exists(),
                       f"run_dir holds {sorted(p.name for p in (fs / 'run').iterdir())}"))
    finally:
        umount(fs)
    return checks
