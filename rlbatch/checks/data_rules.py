"""What the launcher refuses about the data section before anything starts (``data_problems``).

The layout is one the reader knows; the template fills with the question alone; a system prompt
comes with a chat template, a chat template with a model directory that has one (read from its
files: nothing is imported but the reward modules the config names); each ``data.reward_fns``
route names a function callable as ``fn(completion, answer)``; and the file (name=file, where
this machine sees it) has a usable record, with chat-message prompts only under a chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlbatch.config.plain import section
from rlbatch.data.records import LAYOUTS, SUFFIXES, fill_template
from rlbatch.errors import ConfigError


def _routes_problems(data: Mapping[str, Any], load: bool) -> list[str]:
    from rlbatch.rewards.rules import reward_fn_problem

    routes = data.get("reward_fns")
    if routes is None:
        return []
    if not isinstance(routes, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in routes.items()):
        return [f"data.reward_fns: expected a mapping of data_source to 'module:function', got {routes!r}"[:400]]
    if not load:
        return []
    return [p for source, name in routes.items() if (p := reward_fn_problem(name, f"data.reward_fns[{source!r}]"))]


def _chat_problems(data: Mapping[str, Any], model: Mapping[str, Any]) -> list[str]:
    from rlbatch.data.chat import no_template_reason, template_file

    if not data.get("chat_template"):
        if data.get("system_prompt"):
            return ["data.system_prompt: set, but data.chat_template=false: only a chat template puts a system "
                    "message in the prompt; set data.chat_template=true or unset data.system_prompt"]
        return []
    path = model.get("path")
    if not path:
        return ["data.chat_template: true needs model.path (a model directory whose tokenizer has a chat "
                "template): the built-in character tokenizer has none"]
    d = Path(str(path)).expanduser()
    if model.get("check_path", True) is False or not (d / "config.json").is_file():
        return []  # unseen here, or not a model directory: model.path's own check says so
    return [] if template_file(d) is not None else [no_template_reason(path)]


def _file_problems(data: Mapping[str, Any]) -> list[str]:
    """The records of data.path, read as the run reads them: at least one usable, and chat messages
    only under a chat template."""
    from rlbatch.data.records import read_records

    path = data.get("path")
    if data.get("name") != "file" or not path or data.get("check_path", True) is False:
        return []
    p = Path(str(path)).expanduser()
    if p.suffix.lower() not in SUFFIXES or not p.is_file():
        return []  # data.path's own check says so
    cfg = SimpleNamespace(**{k: data.get(k) for k in ("path", "layout", "prompt_key", "answer_key", "data_source_key")})
    try:
        records, _, keys = read_records(cfg)
    except ConfigError as e:
        return [str(p) for p in e.problems]
    except Exception as e:  # a corrupt parquet file
        return [f"data.path: {path} cannot be read: {type(e).__name__}: {e}"[:400]]
    chats = sum(not isinstance(r.prompt, str) for r in records)
    if chats and not data.get("chat_template"):
        return [f"data.path: {path}: the prompts ('{keys.prompt}') of {chats} of its {len(records)} usable records are "
                f"chat messages; set data.chat_template=true to render them with the model's chat template"]
    return []


def data_problems(plain: Mapping[str, Any], reward_role: bool = True) -> list[str]:
    """One line per problem of the data section; ``reward_role``: the reward role scores with data.reward_fn
    (only then are the routes' functions imported)."""
    data, model = section(plain, "data"), section(plain, "model")
    problems = []
    layout = data.get("layout", "auto")
    if layout not in LAYOUTS:
        problems.append(f"data.layout: {layout!r} is not one of {list(LAYOUTS)}")
    try:
        fill_template(str(data.get("template", "{question}")), "")
    except ConfigError as e:
        problems += e.problems
    problems += _routes_problems(data, reward_role)
    problems += _chat_problems(data, model)
    if not problems:
        problems += _file_problems(data)
    return problems
