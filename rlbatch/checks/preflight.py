"""The checks that need transformers: run by the launcher once the config is valid, before a local
run starts or a Slurm job is submitted (a dry run leaves them out and stays instant).

- ``data.chat_template``: the prompts are rendered with the model directory's template and the
  first ones encoded both ways (``rlbatch.data.chat.ChatPrompts``): a template that disagrees
  with its tokenizer (a Llama-style tokenizer that adds a BOS its template does not write, or
  special tokens that do not survive the text) is refused here with the prompt and the token
  counts, not by the controller after every rank has started.
"""

from __future__ import annotations

from rlbatch.config.parse import parse
from rlbatch.config.plain import to_plain
from rlbatch.config.schema import DataConfig, ModelConfig
from rlbatch.errors import ConfigError


def chat_problems(data: DataConfig, model: ModelConfig) -> list[str]:
    if not data.chat_template or not model.path:
        return []  # the plain validation already refused a chat template without a model directory
    from rlbatch.data.source import problems_of

    try:
        problems_of(data, model)
    except ConfigError as e:
        return list(e.problems)
    return []


def preflight(cfg: object) -> None:
    """Raise one ConfigError listing what the heavy checks refuse in the validated ``cfg``."""
    typed = parse(to_plain(cfg)).config
    problems = chat_problems(typed.data, typed.model)
    if problems:
        raise ConfigError(problems)
