"""What the launcher refuses about the data section before anything starts (``data_problems``).

The layout is one the reader knows; the template fills with the question alone; a system prompt
comes with a chat template, a chat template with a model directory that has one (read from its
files: nothing is imported but the reward modules the config names); each ``data.reward_fns``
route names a function callable as ``fn(completion, answer)``; and the file (name=file, where
this machine sees it) has a usable record, with chat-message prompts only under a chat template.
The prompts' length against ``data.max_prompt_tokens``: ``rlbatch.checks.prompt_rules``.
"""

from __future__ import annotations

from pathlib import Path

from rlbatch.config.schema import DataConfig, ModelConfig
from rlbatch.data.records import LAYOUTS, SUFFIXES, fill_template
from rlbatch.errors import ConfigError


def _routes_problems(data: DataConfig, load: bool) -> list[str]:
    from rlbatch.rewards.rules import reward_fn_problem

    if not load:  # their shape is the parse's (rlbatch.config.parse)
        return []
    return [p for source, name in data.reward_fns.items()
            if (p := reward_fn_problem(name, f"data.reward_fns[{source!r}]"))]


def _chat_problems(data: DataConfig, model: ModelConfig) -> list[str]:
    from rlbatch.data.chat import no_template_reason, template_file

    if not data.chat_template:
        if data.system_prompt:
            return ["data.system_prompt: set, but data.chat_template=false: only a chat template puts a system "
                    "message in the prompt; set data.chat_template=true or unset data.system_prompt"]
        return []
    path = model.path
    if not path:
        return ["data.chat_template: true needs model.path (a model directory whose tokenizer has a chat "
                "template): the built-in character tokenizer has none"]
    d = Path(path).expanduser()
    if not model.check_path or not (d / "config.json").is_file():
        return []  # unseen here, or not a model directory: model.path's own check says so
    return [] if template_file(d) is not None else [no_template_reason(path)]


def _file_problems(data: DataConfig, model: ModelConfig) -> list[str]:
    """The records of data.path, read as the run reads them: at least one usable, and chat messages
    only under a chat template."""
    from rlbatch.data.records import read_records

    path = data.path
    if data.name != "file" or not path or not data.check_path:
        return []
    p = Path(path).expanduser()
    if p.suffix.lower() not in SUFFIXES or not p.is_file():
        return []  # data.path's own check says so
    try:
        records, _, keys = read_records(data)
    except ConfigError as e:
        return [str(p) for p in e.problems]
    except Exception as e:  # a corrupt parquet file
        return [f"data.path: {path} cannot be read: {type(e).__name__}: {e}"[:400]]
    chats = sum(not isinstance(r.prompt, str) for r in records)
    if chats and not data.chat_template:
        return [f"data.path: {path}: the prompts ('{keys.prompt}') of {chats} of its {len(records)} usable records are "
                f"chat messages; set data.chat_template=true to render them with the model's chat template"]
    if with_images := sum(bool(r.images) for r in records):
        from rlbatch.checks.vlm_rules import image_data_problem

        problem = image_data_problem(str(path), with_images, len(records), model)
        return [problem] if problem else []
    return []


def data_problems(data: DataConfig, model: ModelConfig, reward_role: bool = True) -> list[str]:
    """One line per problem of a data section (the training data's, or evaluation's held-out data);
    ``reward_role``: the reward role scores with data.reward_fn (only then are the routes' functions
    imported)."""
    problems = []
    if data.layout not in LAYOUTS:
        problems.append(f"data.layout: {data.layout!r} is not one of {list(LAYOUTS)}")
    try:
        fill_template(data.template, "")
    except ConfigError as e:
        problems += e.problems
    problems += _routes_problems(data, reward_role)
    problems += _chat_problems(data, model)
    if not problems:
        problems += _file_problems(data, model)
    return problems
