"""``python -m rlbatch.launch --help``: rlbatch's own usage, built from the config directory without
importing Hydra (Hydra's help stays at ``--hydra-help``, the composed config at ``--cfg job``)."""

from __future__ import annotations

from rlbatch.config import CONF_DIR

USAGE = """\
usage: python -m rlbatch.launch [-m] [KEY=VALUE | GROUP=PRESET]...

Start an rlbatch run (RL post-training as one batch job) from Hydra overrides: on this machine
(cluster=local), as one Slurm job (cluster=slurm), or as a sweep (-m, one job per point).
The configuration is checked before anything starts; bad values are refused naming the field.

examples:
  python -m rlbatch.launch                                  # the default experiment, here
  python -m rlbatch.launch experiment=gsm8k steps=20        # a preset and a field
  python -m rlbatch.launch dry_run=true cluster=slurm       # placement + sbatch script, start nothing
  python -m rlbatch.launch -m cluster=slurm algo.lr=1e-6,3e-6
  python -m rlbatch.plan roles=areal_16gpu                  # memory and step time before submitting

options:
  -h, --help       this text
  -m, --multirun   a sweep: comma-separated values give one run (one Slurm job) per point
  --cfg job        print the composed configuration and exit
  --hydra-help     Hydra's own help

exit codes: 0 finished, 1 failed, 2 bad configuration (nothing started), 3 preempted and
4 interrupted (a checkpoint was saved: launch again to resume), 130 stopped at once.
"""

FOOTER = """\
Every field, its default and its bounds: rlbatch/config/schema.py; the guides: README.md and docs/."""


def groups() -> dict[str, list[str]]:
    """Each config group under rlbatch/conf and its presets (file names without .yaml)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(CONF_DIR.iterdir()) if d.is_dir() and any(d.glob("*.yaml"))}


def usage() -> str:
    lines = [USAGE, "config groups (GROUP=PRESET):"]
    lines += [f"  {name + ':':<12} {', '.join(presets)}" for name, presets in groups().items()]
    return "\n".join(lines) + "\n\n" + FOOTER + "\n"
