"""The planner's command line: argument parsing and the four subcommands.

``hardware=<name>`` and ``hardware.<field>=<value>`` look like Hydra overrides but are taken
out before the rest go to Hydra: the planner loads the profile itself (a name or a .yaml path).
Options start with ``--``; everything else is a Hydra override (predict, search) or a run directory (calibrate, report).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from rlbatch.config.hardware import Hardware, available, load_hardware
from rlbatch.config.schema import RLBatchConfig
from rlbatch.errors import ConfigError
from rlbatch.placement import Placement
from rlbatch.plan.coefficients import Coefficients, load_coefficients

SUBCOMMANDS = ("predict", "search", "calibrate", "report")
DEFAULT_GPU_PROFILE = "h100_sxm"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlbatch.plan",
        description="Will it fit, how long will a step take, where does the time go, which placement is fastest.",
        epilog=f"hardware profiles: {', '.join(available())} (hardware=<name> or hardware=<file.yaml>)",
    )
    p.add_argument("command", choices=SUBCOMMANDS, help="predict (default), search, calibrate or report")
    p.add_argument("args", nargs="*", help="Hydra overrides (predict, search) or run directories (calibrate, report)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--profile", help="calibrated coefficients from `calibrate` (YAML)")
    p.add_argument("--prompt-len", type=float, help="mean prompt tokens (default: 5 for the synthetic task, else 512)")
    p.add_argument("--response-mean", type=float,
                   help="mean response tokens, or a fraction of max_new_tokens when <= 1 (default 0.6)")
    p.add_argument("--zero-variance-frac", type=float,
                   help="dynamic sampling: assumed share of groups whose rewards are all equal, which sets the "
                        "expected generation rounds per step (default 0.5; a run's sampling/zero_variance_frac)")
    p.add_argument("--turns", type=float, help="env.name: mean policy turns per trajectory (default: env.max_turns)")
    p.add_argument("--observation-tokens", type=float, dest="observation_len",
                   help="env.name: mean tokens of an observation between turns (default 16)")
    p.add_argument("--env-step-s", type=float, help="env.name: seconds an environment takes per step (default 0)")
    p.add_argument("--overlap", action="store_true",
                   help="let phases that do not depend on each other run together (an overlapping controller)")
    p.add_argument("--gpus", type=int, help="search: GPUs to place on (default: the config's)")
    p.add_argument("--top", type=int, default=5, help="search: how many placements to print")
    p.add_argument("-o", "--output", default="plan-profile.yaml", help="calibrate: where to write the coefficients")
    p.add_argument("--skip", type=int, default=1, help="calibrate, report: warm-up steps to ignore per run")
    return p


@dataclass
class Args:
    command: str
    rest: list[str]
    hardware: str | None
    hw_overrides: dict[str, Any]
    ns: argparse.Namespace


def parse(argv: list[str]) -> Args:
    if not argv or argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["predict", *argv]
    ap = parser()
    ns = ap.parse_intermixed_args(argv)
    if ns.zero_variance_frac is not None and not 0.0 <= ns.zero_variance_frac <= 1.0:
        ap.error(f"--zero-variance-frac is a share of groups, in [0, 1]; got {ns.zero_variance_frac:g}")
    rest, hardware, hw_over = [], None, {}
    for a in ns.args:
        key, eq, val = a.partition("=")
        if eq and key == "hardware":
            hardware = val
        elif eq and key.startswith("hardware."):
            hw_over[key.split(".", 1)[1]] = val
        else:
            rest.append(a)
    return Args(ns.command, rest, hardware, hw_over, ns)


def pick_hardware(args: Args, cfg: RLBatchConfig, on_cpu: bool = False) -> Hardware:
    """The profile named on the command line, else cpu for CPU configs or runs, else h100_sxm."""
    name = args.hardware or ("cpu" if on_cpu or cfg.cluster.device == "cpu" else DEFAULT_GPU_PROFILE)
    return load_hardware(name, args.hw_overrides)


def coefficients(args: Args, hw: Hardware) -> Coefficients:
    if not args.ns.profile:
        return Coefficients()
    coef = load_coefficients(args.ns.profile)
    if coef.hardware and coef.hardware != hw.name:
        print(f"warning: {args.ns.profile} was fitted on hardware {coef.hardware!r}, predicting for {hw.name!r}",
              file=sys.stderr)
    return coef


def emit(args: Args, data: Any, text: str) -> None:
    print(json.dumps(data, indent=1, default=float) if args.ns.json else text)


def episodes(args: Args) -> dict[str, float | None]:
    """A multi-turn rollout's turns, observation tokens and env seconds from the command line."""
    return {"turns": args.ns.turns, "observation_len": args.ns.observation_len, "env_step_s": args.ns.env_step_s}


def _context(args: Args) -> tuple[RLBatchConfig, Placement, dict[str, Any]]:
    """The composed config, typed and as plain mappings (what the search writes candidates from), and its placement."""
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.config.parse import parsed
    from rlbatch.config.plain import to_plain

    cfg = compose(args.rest)
    placement = check(cfg, runnable=False)  # the planner models engines and programs this build does not run
    plain = to_plain(cfg)
    return parsed(plain), placement, plain


def cmd_predict(args: Args) -> int:
    from rlbatch.plan.fit import predict_config
    from rlbatch.plan.render import report

    cfg, placement, _ = _context(args)
    hw = pick_hardware(args, cfg)
    p = predict_config(cfg, placement, hw, args.ns.prompt_len, args.ns.response_mean, coefficients(args, hw),
                       args.ns.overlap, args.ns.zero_variance_frac, **episodes(args))
    emit(args, p.to_dict(), report(p))
    return 0 if p.fits else 1


def cmd_search(args: Args) -> int:
    from rlbatch.models.shape import shape_from_config
    from rlbatch.plan.fit import mem_limit
    from rlbatch.plan.render import secs, size, table
    from rlbatch.plan.search import search
    from rlbatch.plan.workload import workload_from_config

    cfg, placement, plain = _context(args)
    hw = pick_hardware(args, cfg)
    gpus = args.ns.gpus or placement.num_gpus
    shape = shape_from_config(cfg.model)
    w = workload_from_config(cfg, args.ns.prompt_len, args.ns.response_mean, args.ns.zero_variance_frac,
                             **episodes(args))
    best, stats = search(plain, gpus, placement.gpus_per_node, shape, w, hw, coefficients(args, hw),
                         cfg.model.dtype, args.ns.top, cfg.cluster.cpus_per_task, mem_limit(cfg), args.ns.overlap)
    data = {"stats": stats, "gpus": gpus, "hardware": hw.name, "top": [
        {"rank": i + 1, "label": c.label, "mode": c.mode, "step_s": c.prediction.step_s if c.prediction else None,
         "max_tokens_per_micro_batch": c.budget or None, "lora_rank": c.lora or None, "overrides": c.overrides}
        for i, c in enumerate(best)]}
    rows = [("#", "step", "mode", "placement", "peak memory")]
    for i, c in enumerate(best):
        assert c.prediction is not None
        peak = max((g.peak()[1] for g in c.prediction.gpus), default=0.0)
        rows.append((str(i + 1), secs(c.prediction.step_s), c.mode, c.label.split(": ", 1)[1], size(peak)))
    lines = [f"searched {stats['candidates']} placements of {gpus} x {hw.name}: {stats['fit']} fit, "
             f"{stats['oom']} do not fit, {stats['invalid']} of the best failed validation", table(rows), ""]
    if stats.get("lora"):
        lines.insert(1, f"none fits with every weight trained: placements with LoRA adapters of rank "
                        f"{stats['lora']} (model.lora.rank={stats['lora']}, docs/lora.md) searched too")
    lines += [f"# {i + 1}: {secs(c.prediction.step_s if c.prediction else 0)}\n" + " ".join(c.overrides)
              for i, c in enumerate(best)]
    emit(args, data, "\n".join(lines))
    return 0 if best else 1


def _models(args: Args) -> tuple[list[Any], Hardware]:
    from rlbatch.plan.runs import RunModel, load_run

    if not args.rest:
        raise ConfigError(f"{args.command}: give one or more run directories")
    runs = [load_run(p) for p in args.rest]
    hw = pick_hardware(args, runs[0].cfg, on_cpu=runs[0].measured_on_cpu())
    return [RunModel(r, hw) for r in runs], hw


def cmd_calibrate(args: Args) -> int:
    from rlbatch.plan.calibrate import calibrate

    models, hw = _models(args)
    coef = calibrate(models, args.ns.skip, hw.name)
    coef.save(args.ns.output)
    text = "\n".join(f"  {k}: " + ", ".join(f"{f}={v:.4g}" for f, v in fs.items()) for k, fs in coef.values.items())
    emit(args, coef.to_dict() | {"output": args.ns.output},
         f"fitted on {len(models)} run(s), hardware {hw.name}; wrote {args.ns.output}\n{text}")
    return 0


def cmd_report(args: Args) -> int:
    from rlbatch.plan.report import compare, overall_step_mape, render

    models, hw = _models(args)
    coef = coefficients(args, hw)
    reports = [compare(m.predict_steps(coef, args.ns.skip)) for m in models]
    emit(args, {"runs": [r.to_dict() for r in reports], "step_mape": overall_step_mape(reports)}, render(reports))
    return 0


COMMANDS = {"predict": cmd_predict, "search": cmd_search, "calibrate": cmd_calibrate, "report": cmd_report}
