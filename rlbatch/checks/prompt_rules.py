"""``data.max_prompt_tokens`` (and ``eval.data``'s) before anything starts: a prompt of that length
and a response of ``algo.max_new_tokens`` fit the inference role's context (``context_length``),
and, where this machine can read the data, the prompts counted as the ranks encode them with the
guard's policy applied (``rlbatch.data.prompt_length``)."""

from __future__ import annotations

import json
from pathlib import Path

from rlbatch.checks.eval_rules import enabled as eval_enabled
from rlbatch.config.schema import RLBatchConfig
from rlbatch.errors import ConfigError


def context_length(cfg: RLBatchConfig) -> tuple[int, str] | None:
    """The longest sequence (prompt and response) the inference role can hold, and where that
    number comes from: ``max_model_len`` of actor_infer's engine_args (vLLM, SGLang) when set,
    else the model's ``max_position_embeddings`` (``model.path``'s config.json, or the random-init
    model's field). None when it cannot be read here (a model directory this machine does not see)."""
    limits: list[tuple[int, str]] = []
    infer = cfg.roles.get("actor_infer")
    engine_len = infer.engine_args.get("max_model_len") if infer is not None else None
    if isinstance(engine_len, int) and not isinstance(engine_len, bool) and engine_len > 0:
        limits.append((engine_len, f"roles.actor_infer.engine_args.max_model_len={engine_len}"))
    if cfg.model.path:
        config = Path(str(cfg.model.path)).expanduser() / "config.json"
        try:
            positions = json.loads(config.read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            positions = None
        if isinstance(positions, int) and positions > 0:
            limits.append((positions, f"the model's max_position_embeddings={positions} ({config})"))
    else:
        n = int(cfg.model.max_position_embeddings)
        limits.append((n, f"model.max_position_embeddings={n}"))
    return min(limits) if limits else None


def prompt_length_problems(cfg: RLBatchConfig, runnable: bool) -> list[str]:
    """``data.max_prompt_tokens`` (and ``eval.data``'s): a prompt of that length and a response of
    ``algo.max_new_tokens`` fit the inference role's context; with ``runnable``, the prompts are
    encoded as the ranks encode them and the guard's policy applied (``refuse`` names the first
    prompt over the limit, ``drop`` must leave some). Nothing without a limit."""
    sections = [("data", cfg.data)]
    if eval_enabled(cfg) and not cfg.eval.holdout:
        sections.append(("eval.data", cfg.eval.data))
    sections = [(field, d) for field, d in sections if d.max_prompt_tokens]
    if not sections:
        return []
    problems = []
    context = context_length(cfg)
    new = int(cfg.algo.max_new_tokens)
    for field, d in sections:
        if context is not None and d.max_prompt_tokens + new > context[0]:
            problems.append(f"{field}.max_prompt_tokens: {d.max_prompt_tokens} prompt tokens + algo.max_new_tokens="
                            f"{new} = {d.max_prompt_tokens + new} > {context[1]}: the longest prompt and response do "
                            f"not fit; lower {field}.max_prompt_tokens to {max(context[0] - new, 0)} or "
                            f"algo.max_new_tokens")
    if problems or not runnable:
        return problems
    from rlbatch.data.source import guarded_problems

    for field, d in sections:
        if field == "data" and cfg.program == "eval" and not cfg.eval.holdout:
            continue  # program=eval reads only the held-out set
        try:
            guarded_problems(d, cfg.model, field)
        except ConfigError as e:
            problems += [p for p in e.problems if p.startswith(f"{field}.max_prompt_tokens")]
        except (OSError, ValueError) as e:  # a tokenizer that cannot be read: model.path's own check says so
            problems.append(f"{field}.max_prompt_tokens: the prompts could not be counted: {type(e).__name__}: {e}"[:400])
    return problems
