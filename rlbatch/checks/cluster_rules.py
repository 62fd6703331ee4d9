"""What ``cluster=slurm`` writes into a shell script, checked before anything starts.

The sbatch script has three parts that read config values differently:

- the ``#SBATCH`` header, one line per option. submitit quotes each value for the shell, but a
  newline ends the line anyway (the rest becomes a directive of its own, or a shell command),
  and sbatch reads a backslash as an escape even inside quotes. Names Slurm knows
  (partition, account, QOS, constraint, MPI plugin) are held to the characters Slurm uses for
  them; free text (job name, ``sbatch_args`` values, paths in ``--output``) to printable
  characters without a backslash. ``sbatch_args`` keys are option names that rlbatch does not
  set itself.
- the srun command line and the ``export`` lines (also ``rank_env.sh``): every value is one
  shell word, quoted; only control characters are refused there.
- ``cluster.setup``: shell the user wrote, run as written. It may not carry an ``#SBATCH`` (or
  ``#PBS``) line, which sbatch would read as a directive, and it must be complete shell on its own
  (``bash -n``), so that an open quote, block or heredoc cannot swallow the lines after it.

``cluster_problems`` checks a config (from ``rlbatch.checks.validate.check``);
``parameter_problems`` checks the parameters the script writer is about to render, a second
line of defence for values that do not come from the config as given (a resolved run directory).
Numbers (time, memory, counts) are checked with the rest of the schema.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from collections.abc import Mapping
from typing import Any

from rlbatch.config.schema import RLBatchConfig

NAME = "A-Za-z0-9_.+-"  # a character class; '-' last, so extra characters go in front of it
SLURM_NAMES: dict[str, tuple[re.Pattern[str], str, str]] = {
    "partition": (re.compile(rf"[{NAME}]+(,[{NAME}]+)*"), "," + NAME,
                  "partition names (letters, digits, '_', '.', '+', '-'), several separated by ','"),
    "account": (re.compile(f"[{NAME}]+"), NAME, "one account name (letters, digits, '_', '.', '+', '-')"),
    "qos": (re.compile(f"[{NAME}]+"), NAME, "one QOS name (letters, digits, '_', '.', '+', '-')"),
    "constraint": (re.compile(rf"[:=&|,*\[\]()!{NAME}]+"), rf":=&|,*\[\]()!{NAME}",
                   "node features joined by Slurm's operators &, |, ',', *N, [ ] and ( )"),
    "mpi": (re.compile(r"[a-z0-9_]+"), "a-z0-9_", "one srun MPI plugin name such as 'pmi2' or 'pmix'"),
}
"""Fields that name something Slurm knows, and the characters those names are made of."""

OPTION = re.compile(r"[a-z][a-z0-9_-]*")
"""An sbatch long option as ``sbatch_args`` spells it (submitit turns '_' into '-')."""
OWNED_OPTIONS: dict[str, str] = {
    "job-name": "cluster.job_name", "partition": "cluster.partition", "account": "cluster.account",
    "qos": "cluster.qos", "constraint": "cluster.constraint", "time": "cluster.time_min",
    "mem": "cluster.mem_gb", "signal": "cluster.preempt_signal and cluster.signal_delay_s",
    "requeue": "preemption (the job requeues itself)", "nodes": "the placement",
    "ntasks-per-node": "the placement", "ntasks": "the placement", "cpus-per-task": "cluster.cpus_per_task",
    "gres": "the placement", "gpus": "the placement", "gpus-per-node": "the placement",
    "gpus-per-task": "the placement", "output": "run_dir (the job log the launcher reads)",
    "error": "run_dir (the job log the launcher reads)", "open-mode": "submitit (the log is appended to on requeue)",
    "array": "the run (one job per run directory)", "wrap": "the script rlbatch writes",
    "parsable": "submitit (it reads sbatch's 'Submitted batch job N')", "wait": "wait=true",
}
"""sbatch options rlbatch writes or relies on, and what sets them instead of ``sbatch_args``."""

DIRECTIVE = re.compile(r"^[ \t]*#(SBATCH|PBS)", re.MULTILINE)
"""A line sbatch may read as a directive while it is still reading the header (it reads
'#SBATCH' and '#PBS' at the start of a line; indented ones are refused too, as they only mislead)."""


def bad_char(value: str, *, also: str = "", allowed: str = "") -> str | None:
    """The first control or line-separator character of ``value`` (or one of ``also``) that is
    not in ``allowed``; None when there is none."""
    for ch in value:
        if ch not in allowed and (unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in also):
            return ch
    return None


def _why(ch: str) -> str:
    if ch == "\\":
        return "a backslash (sbatch reads it as an escape, even inside quotes)"
    if ch == "%":
        return "'%' (Slurm expands it in log file names: %j is the job id)"
    return f"the control character {ch!r}, which would end the line in the script"


def _text_problem(field: str, value: Any, *, also: str = "", allowed: str = "") -> str | None:
    if not isinstance(value, str):
        return f"{field}: expected a string, got {type(value).__name__} {value!r}"[:300]
    ch = bad_char(value, also=also, allowed=allowed)
    return None if ch is None else f"{field}: {value!r} contains {_why(ch)}"[:400]


def _name_problem(key: str, value: Any) -> str | None:
    pattern, chars, what = SLURM_NAMES[key]
    if (problem := _text_problem(f"cluster.{key}", value, also="\\")) is not None:
        return problem
    if pattern.fullmatch(value):
        return None
    odd = "".join(sorted({ch for ch in value if not re.fullmatch(f"[{chars}]", ch)}))
    return f"cluster.{key}: expected {what}, got {value!r}" + (f" ({odd!r} not allowed)" if odd else "")


def _option_problem(field: str, key: Any, value: Any) -> str | None:
    """One ``#SBATCH --key=value`` line: an option name, and a value sbatch reads back as written
    (True writes the bare flag)."""
    if not OPTION.fullmatch(str(key)):
        return (f"{field}: {str(key)!r} is not an sbatch option name (lower-case letters, digits, '-' and '_', "
                f"as in mail_type or exclusive)")[:400]
    if value is True:
        return None
    if value is None or value is False or not isinstance(value, (str, int, float)):
        return (f"{field}.{key}: expected a string, a number or true (a bare --{str(key).replace('_', '-')}), "
                f"got {value!r}; to leave the option out, remove the key")[:400]
    return _text_problem(f"{field}.{key}", str(value), also="\\")


def option_problems(field: str, options: Mapping[Any, Any]) -> list[str]:
    """``cluster.sbatch_args``: lines of options that rlbatch does not write itself."""
    problems = []
    for key, value in options.items():
        if (problem := _option_problem(field, key, value)) is not None:
            problems.append(problem)
            continue
        name = str(key).replace("_", "-")
        owner = next((o for o in OWNED_OPTIONS if o.startswith(name)), None)  # sbatch takes abbreviations
        if owner is not None:
            problems.append(f"{field}.{key}: rlbatch writes --{owner} itself (from {OWNED_OPTIONS[owner]}); "
                            f"leave it out of {field}")
    return problems


def setup_problems(lines: Any) -> list[str]:
    """``cluster.setup`` runs as written, as the user's own shell; what keeps it from reaching past
    its own lines: no directive line, no control character but tab and newline, and complete
    shell by itself (bash -n; a trailing backslash would join the next line of the script)."""
    if not isinstance(lines, list) or not all(isinstance(ln, str) for ln in lines):
        return [f"cluster.setup: expected a list of shell lines, got {lines!r}"[:300]]
    problems = []
    for i, line in enumerate(lines):
        if (problem := _text_problem(f"cluster.setup[{i}]", line, allowed="\t\n")) is not None:
            problems.append(problem)
        if (m := DIRECTIVE.search(line)) is not None:
            problems.append(f"cluster.setup[{i}]: {line!r} has a line starting with '#{m.group(1)}', which sbatch "
                            f"would read as a directive; put sbatch options in cluster.sbatch_args"[:400])
    if problems or not lines:
        return problems
    text = "\n".join(lines)
    if re.search(r"(?<!\\)(\\\\)*\\\Z", text):
        return [f"cluster.setup: the last line {lines[-1]!r} ends in a backslash, which would join it to the "
                f"script's next line"[:400]]
    bash = shutil.which("bash")
    if bash is None:  # the login node has no bash: the compute node's will report it
        return []
    try:
        out = subprocess.run([bash, "-n", "-c", text], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode or out.stderr.strip():
        why = out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"exit code {out.returncode}"
        return [f"cluster.setup: is not complete shell by itself ({why.removeprefix('bash: ')}); an open quote, "
                f"block or heredoc would swallow the lines after it"[:400]]
    return []


def run_dir_problem(run_dir: Any) -> str | None:
    """The run directory names the job's log files in the header: no '%', no backslash."""
    return _text_problem("run_dir", str(run_dir), also="\\%")


def cluster_problems(cfg: RLBatchConfig) -> list[str]:
    """Every problem with what a ``cluster=slurm`` config writes into the sbatch script, the
    srun command line and ``rank_env.sh``, each naming its field and the character (types: the
    parse's)."""
    cluster = cfg.cluster
    if cluster.name != "slurm":
        return []
    names = {"partition": cluster.partition, "account": cluster.account, "qos": cluster.qos,
             "constraint": cluster.constraint, "mpi": cluster.mpi}
    problems = [p for key, value in names.items() if value is not None and (p := _name_problem(key, value)) is not None]
    if (p := _text_problem("cluster.job_name", cluster.job_name, also="\\")) is not None:
        problems.append(p)
    if (p := run_dir_problem(cfg.run_dir)) is not None:
        problems.append(p)
    problems.extend(option_problems("cluster.sbatch_args", cluster.sbatch_args))
    for key, value in (("container_image", cluster.container_image), ("container_mounts", cluster.container_mounts)):
        if value is not None and (p := _text_problem(f"cluster.{key}", value)) is not None:
            problems.append(p)
    problems.extend(p for i, a in enumerate(cluster.srun_args)
                    if (p := _text_problem(f"cluster.srun_args[{i}]", str(a))) is not None)
    problems.extend(p for k, v in cluster.env.items() if (p := _text_problem(f"cluster.env.{k}", str(v))) is not None)
    problems.extend(setup_problems(cluster.setup))
    return problems


SHELL_PARTS = frozenset({"setup", "teardown", "srun_args", "additional_parameters", "stderr_to_stdout"})
"""submitit parameters that are not ``#SBATCH`` header lines."""


def parameter_problems(params: Mapping[str, Any], run_dir: Any) -> list[str]:
    """The parameters about to be rendered into an sbatch script: the same rules as
    ``cluster_problems``, applied to the final values (field names are the script's)."""
    header = {k: v for k, v in params.items() if k not in SHELL_PARTS}
    problems = [p for k, v in header.items()
                if (p := _text_problem(f"sbatch script: --{k}", str(v), also="\\")) is not None]
    problems += [f"sbatch script: {k!r} is not an sbatch option name" for k in header if not OPTION.fullmatch(k)]
    extra = params.get("additional_parameters") or {}
    problems += [p for k, v in extra.items() if (p := _option_problem("sbatch script: option", k, v)) is not None]
    problems += [p for i, a in enumerate(params.get("srun_args") or [])
                 if (p := _text_problem(f"sbatch script: srun argument {i}", str(a))) is not None]
    problems += [p.replace("cluster.setup", "sbatch script: setup") for p in setup_problems(params.get("setup") or [])]
    if (p := run_dir_problem(run_dir)) is not None:
        problems.append(p)
    return problems

