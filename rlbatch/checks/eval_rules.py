"""What the launcher refuses about the ``eval`` section (``eval_problems``; docs/eval.md).

Evaluation is scored by the run's own scoring roles, which were built with ``data.reward_fn`` and
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
    """Whether the config evaluates at all (eval.every > 0 or eval.at_start)."""
    return cfg.eval.every > 0 or cfg.eval.at_start


def eval_problems(cfg: RLBatchConfig, runnable: bool) -> list[str]:
    """One line per problem of the eval section; with ``runnable``, its file is read as the run
    would read it. Nothing is checked while evaluation is off. Types and ranges: the parse's."""
    if not enabled(cfg):
        return []
    ev, data, eval_data = cfg.eval, cfg.data, cfg.eval.data
    problems = []
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
