"""Plan an rlbatch run before submitting it: ``python -m rlbatch.plan [subcommand] [overrides]``.

    python -m rlbatch.plan                                    # predict the default experiment
    python -m rlbatch.plan roles=roll_colocated_8gpu model.path=/models/qwen2.5-7b hardware=h100_sxm
    python -m rlbatch.plan search roles=areal_16gpu model.path=/models/qwen2.5-7b --gpus 16 --top 5
    python -m rlbatch.plan calibrate runs/a -o plan-profile.yaml      # fit the time model to runs
    python -m rlbatch.plan report runs/b runs/c --profile plan-profile.yaml
    python -m rlbatch.plan predict --json ...                 # machine-readable

Takes the same Hydra overrides as ``python -m rlbatch.launch``, plus ``hardware=<profile>`` (a
file in rlbatch/conf/hardware/) and ``hardware.<field>=<value>``. Pure arithmetic: no torch import.
Exit codes: 0 success, 1 the placement does not fit (predict) or nothing fits (search),
2 bad configuration or arguments (problems printed).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from rlbatch.errors import ConfigError, report_config_error
    from rlbatch.plan.cli import COMMANDS, parse

    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        return report_config_error(e)


if __name__ == "__main__":
    sys.exit(main())
