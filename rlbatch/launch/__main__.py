"""Start an rlbatch run: ``python -m rlbatch.launch [hydra overrides]``.

    python -m rlbatch.launch                              # the default experiment, on this machine
    python -m rlbatch.launch dry_run=true cluster=slurm   # print placement + sbatch script, start nothing
    python -m rlbatch.launch cluster=slurm cluster.partition=gpu roles=areal_16gpu
    python -m rlbatch.launch -m cluster=slurm algo.lr=1e-6,3e-6   # one Slurm job per point

Exit codes (``rlbatch.errors.ExitCode``; the README's "Exit codes" table): 0 finished, 1 failed,
2 bad configuration (problems printed, nothing started), 3 preempted and 4 interrupted (stopped
after saving a checkpoint: launch again to resume), 130 stopped at once by a second Ctrl-C.
Ctrl-C stops a local run after the step in progress, with a checkpoint; a second Ctrl-C at once.
Heavy libraries are imported only after the config is valid, so errors and dry runs are instant.
"""

from __future__ import annotations

import signal
import sys

from rlbatch.errors import ConfigError, ExitCode, report_config_error


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly, like any CLI
    try:
        return _launch(argv)
    except KeyboardInterrupt:  # before a local run starts (it handles Ctrl-C itself), or while submitting
        print("\nrlbatch: interrupted (Ctrl-C)", file=sys.stderr)
        return int(ExitCode.STOPPED_NOW)


def _launch(argv: list[str]) -> int:
    from rlbatch.config.compose import compose, needs_hydra_cli

    if "-h" in argv or "--help" in argv:
        from rlbatch.launch.usage import usage

        print(usage(), end="")
        return int(ExitCode.FINISHED)
    if needs_hydra_cli(argv):
        from rlbatch.launch.sweep import hydra_cli

        return hydra_cli(argv)
    from rlbatch.checks.validate import check
    from rlbatch.launch.run import launch

    try:
        cfg = compose(argv)
        placement = check(cfg)
    except ConfigError as e:
        return report_config_error(e)
    return launch(cfg, placement)


if __name__ == "__main__":
    sys.exit(main())
