"""What the launcher refuses about the ``eval`` section (``eval_problems``; docs/eval.md).

``program=eval`` (``program_eval_problems``): something to evaluate (``eval.checkpoint`` or
``model.path``), a held-out set, scoring roles, a checkpoint that loads into this config's model
and placement, and a run directory of its own (never a training run's). Evaluation is scored by
the run's own scoring roles, which were built with ``data.reward_fn`` and
``data.reward_fns``: the held-out data must be of the training data's kind, and it cannot bring
reward functions of its own. Its data section is checked as the training one is
(``rlbatch.checks.data_rules``), each problem naming ``eval.data.<field>``. No torch.
"""

from __future__ import annotations

import dataclasses
import re

from rlbatch.config.schema import DataConfig, RLBatchConfig

_FIELDS = "|".join(f.name for f in dataclasses.fields(DataConfig))
_DATA_FIELD = re.compile(rf"(?<![\w./\\-])data\.(?=(?:{_FIELDS})\b)")
"""``data.<field>`` in a problem's text (not a file name such as /srv/data.jsonl)."""


def _renamed(problem: str) -> str:
    """A problem of the data section's checks, about ``eval.data`` instead."""
    return _DATA_FIELD.sub("eval.data.", problem)


def enabled(cfg: RLBatchConfig) -> bool:
    """Whether the config evaluates at all (eval.every > 0, eval.at_start, or program=eval)."""
    return cfg.eval.every > 0 or cfg.eval.at_start or cfg.program == "eval"


def eval_problems(cfg: RLBatchConfig, runnable: bool) -> list[str]:
    """One line per problem of the eval section; with ``runnable``, its file is read as the run
    would read it. Nothing is checked while evaluation is off. Types and ranges: the parse's."""
    problems = program_eval_problems(cfg, runnable)
    if not enabled(cfg):
        return problems
    ev, data, eval_data = cfg.eval, cfg.data, cfg.eval.data
    if ev.samples_per_prompt > 1 and ev.temperature == 0:
        problems.append(f"eval.samples_per_prompt: {ev.samples_per_prompt} samples per prompt at "
                        f"eval.temperature=0 are one greedy response repeated, so pass@{ev.samples_per_prompt} "
                        f"would equal pass@1; set eval.temperature > 0 (e.g. 0.6) or eval.samples_per_prompt=1")
    name, train_name = eval_data.name, data.name
    if name != train_name:
        problems.append(f"eval.data.name: {name!r} differs from data.name={train_name!r}: evaluation is scored by the "
                        f"run's scoring roles, which score data.name's kind of task; give eval.data.name={train_name}"
                        + (" and eval.data.path=<the held-out file>" if train_name in ("file", "code_file") else ""))
    for key, default, own, train in (("reward_fn", DataConfig.reward_fn, eval_data.reward_fn, data.reward_fn),
                                     ("reward_fns", {}, eval_data.reward_fns, data.reward_fns)):
        if own not in (default, train):
            problems.append(f"eval.data.{key}: {own!r} differs from data.{key}={train!r}: evaluation is scored with the "
                            f"training data's reward functions (data.reward_fn, routed by data source through "
                            f"data.reward_fns); set them there and leave eval.data.{key} unset"[:600])
    if ev.holdout:
        if eval_data.path:
            problems.append(f"eval.holdout: {ev.holdout} held-out training problems and eval.data.path="
                            f"{eval_data.path!r} are two held-out sets; set one")
        if problems or not runnable:
            return problems  # the held-out problems are the training data's, checked as data
        return _holdout_problem(cfg, ev.holdout)
    if name in ("file", "code_file") and not eval_data.path:
        problems.append(f"eval.data.path: eval.data.name={name} needs the held-out jsonl or parquet file")
    if problems or not runnable:
        return problems
    if name == "file" and eval_data.path and eval_data.check_path:
        from rlbatch.checks.runnable import _data_file_problem

        if (problem := _data_file_problem(eval_data.path)) is not None:
            return [_renamed(problem)]
    from rlbatch.checks.data_rules import data_problems

    return [_renamed(p) for p in data_problems(eval_data, cfg.model, reward_role=False)]


def _holdout_problem(cfg: RLBatchConfig, n: int) -> list[str]:
    """eval.holdout against the size of the training data, read as the run reads it."""
    from rlbatch.data.source import problems_of, split_holdout
    from rlbatch.errors import ConfigError

    try:
        problems = problems_of(cfg.data, cfg.model)
    except ConfigError:
        return []  # the data section's own checks report it
    try:
        split_holdout(problems, n, 0)  # the run's rule (which problems it draws does not matter here)
    except ConfigError as e:
        return list(e.problems)
    return []


EVAL_RUN_FILES = ("metrics.jsonl", "checkpoints")
"""What marks a run directory as a training run's: ``program=eval`` writes none of them, and refuses
a run directory that has one (its config.yaml, placement and logs would be replaced)."""


def program_eval_problems(cfg: RLBatchConfig, runnable: bool) -> list[str]:
    """``eval.checkpoint`` and ``eval.all_checkpoints`` outside ``program=eval``; and for
    ``program=eval``: what it evaluates, on what, scored by whom, and where it writes."""
    ev = cfg.eval
    if cfg.program != "eval":
        return [f"eval.{k}: set, but program={cfg.program}: only program=eval reads it (a training run resumes "
                f"from a checkpoint with resume=<path>)" for k, v in (("checkpoint", ev.checkpoint),
                                                                      ("all_checkpoints", ev.all_checkpoints)) if v]
    problems = []
    if not ev.checkpoint and not cfg.model.path:
        problems.append("program=eval: nothing to evaluate: give eval.checkpoint=<a run directory or a checkpoint> or "
                        "model.path=<a model directory> (a random-initialised model is not worth an evaluation)")
    if ev.all_checkpoints and not ev.checkpoint:
        problems.append("eval.all_checkpoints: true, but eval.checkpoint is empty: give the run directory whose "
                        "checkpoints to evaluate")
    if not ev.holdout and ev.data.name == "none":
        problems.append("eval.data.name: 'none' has no prompts, so program=eval has no eval set: give eval.data "
                        "(e.g. eval.data.name=file eval.data.path=<held-out file>) or eval.holdout=N")
    if not cfg.enabled("reward") and not cfg.enabled("code_sandbox"):
        problems.append("roles.reward: program=eval scores every response with data.reward_fn on the reward role's "
                        "CPU workers; enable it, e.g. roles.reward.world_size=1")
    if not runnable:
        return problems
    problems += _run_dir_problems(str(cfg.run_dir), str(ev.checkpoint))
    if ev.checkpoint:
        problems += _checkpoint_problems(cfg)
    from rlbatch.checks.runnable import engine_problems, files_problems, role_engines

    return problems + engine_problems(role_engines(cfg)) + [p for p in files_problems(cfg) if not p.startswith("resume")]


def _run_dir_problems(run_dir: str, checkpoint: str) -> list[str]:
    """program=eval's run directory holds no training run: its files would be replaced."""
    from pathlib import Path

    path = Path(run_dir).expanduser()
    found = [name for name in EVAL_RUN_FILES if (path / name).exists()]
    config = path / "config.yaml"
    try:
        other = config.is_file() and not re.search(r"^program: eval$", config.read_text(), re.M)
    except OSError:
        other = True
    if other:
        found.append("a config.yaml of a program other than eval")
    if not found:
        return []
    hint = f"eval.checkpoint={run_dir} " if not checkpoint else ""
    return [f"run_dir: {run_dir} holds a training run ({', '.join(found)}): program=eval would replace its "
            f"config.yaml, placement and logs; give program=eval a run_dir of its own, e.g. "
            f"{hint}run_dir={path.as_posix().rstrip('/')}-eval (it reads the checkpoints where they are)"]


def _checkpoint_problems(cfg: RLBatchConfig) -> list[str]:
    """eval.checkpoint is a complete checkpoint (or a run with one), written for this config's model
    (its config.yaml's model section), with a directory for each trainable role placed here."""
    from pathlib import Path

    from rlbatch.checkpoint.files import CONFIG
    from rlbatch.checkpoint.store import CheckpointError, open_checkpoint
    from rlbatch.config.schema import TRAINABLE_ROLES

    where = str(cfg.eval.checkpoint)
    try:
        ckpt = open_checkpoint(Path(where))
    except CheckpointError as e:
        return [f"eval.checkpoint: {e}"[:800]]
    except (OSError, ValueError) as e:
        return [f"eval.checkpoint: {where}: {e}"[:400]]
    problems = [f"eval.checkpoint: {ckpt.path} has no {role}/ (it was written by a run without {role}); "
                f"{'disable ' + role + ' (roles.' + role + '.enabled=false)' if role != 'actor_train' else 'give a checkpoint of a policy'}"
                for role in TRAINABLE_ROLES if cfg.enabled(role) and not (ckpt.path / role).is_dir()]
    saved = ckpt.path / CONFIG
    if not saved.is_file():
        return problems
    from omegaconf import OmegaConf

    from rlbatch.config.parse import parse

    try:
        theirs = parse(OmegaConf.to_container(OmegaConf.load(saved), resolve=False)).config.model
    except Exception as e:  # a config of another rlbatch version: its model is compared where it parses
        return problems + [f"eval.checkpoint: {saved} cannot be read: {type(e).__name__}: {e}"[:400]]
    differ = _model_differences(theirs, cfg.model)
    if differ:
        shown = ", ".join(f"model.{k}={a!r} there, {b!r} here" for k, a, b in differ[:6])
        problems.append(f"eval.checkpoint: {ckpt.path} was written for another model ({shown}); give the training "
                        f"run's model settings (the model section of {saved})"[:800])
    return problems


def _model_differences(theirs: object, ours: object) -> list[tuple[str, object, object]]:
    """The fields of two ``ModelConfig`` that shape the weights and differ (check_path does not)."""
    import dataclasses

    assert dataclasses.is_dataclass(theirs) and dataclasses.is_dataclass(ours)
    return [(f.name, getattr(theirs, f.name), getattr(ours, f.name)) for f in dataclasses.fields(ours)
            if f.name != "check_path" and getattr(theirs, f.name) != getattr(ours, f.name)]
