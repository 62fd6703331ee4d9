"""The prompt-length guard: ``data.max_prompt_tokens`` with ``data.prompt_too_long`` (docs/data.md).

A prompt is counted as the ranks encode it: its final text (after ``data.template`` and the chat
template) through the run's tokenizer, special tokens included (``tokenizer(text)``, what the
inference ranks do). One over the limit is refused (``refuse``: a ConfigError naming its index,
its length and the limit), left out (``drop``) or cut to the limit (``truncate``), on the left
by default: the end of a prompt holds the question and the generation prompt. A cut is made in
the text, at a token boundary, and re-encoded until it fits, so what the ranks encode is within
the limit. The counts become metrics (``data/prompts_dropped``, ``data/prompts_truncated``) and one
log line.

verl's names: ``max_prompt_length`` is ``max_prompt_tokens``; ``truncation='error'|'left'|'right'``
is ``prompt_too_long=refuse`` or ``truncate`` with ``truncation_side``; verl's
``filter_overlong_prompts`` is ``drop``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rlbatch.data.synthetic import Sample
from rlbatch.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlbatch.config.schema import ModelConfig

log = logging.getLogger(__name__)

_said: set[str] = set()
"""The guard's log lines this process has written."""

POLICIES = ("refuse", "drop", "truncate")
SIDES = ("left", "right")


class GuardConfig(Protocol):
    """What the guard reads of a data section (``DataConfig``)."""

    @property
    def max_prompt_tokens(self) -> int: ...
    @property
    def prompt_too_long(self) -> str: ...
    @property
    def truncation_side(self) -> str: ...


@dataclass
class PromptCounts:
    """What the guard did to a data set: prompts seen, dropped, truncated, and the longest one
    (tokens, before any cut)."""

    prompts: int = 0
    dropped: int = 0
    truncated: int = 0
    longest: int = 0
    limit: int = 0

    def metrics(self, prefix: str = "data") -> dict[str, float]:
        """``<prefix>/prompts_dropped`` and ``<prefix>/prompts_truncated`` (and the longest prompt's
        length) when a limit is set; nothing when it is not."""
        if not self.limit:
            return {}
        return {f"{prefix}/prompts_dropped": float(self.dropped), f"{prefix}/prompts_truncated": float(self.truncated),
                f"{prefix}/prompt_tokens_max": float(self.longest)}


def prompt_tokenizer(model_cfg: ModelConfig | None) -> PreTrainedTokenizerBase:
    """The tokenizer the ranks encode prompts with: ``model.path``'s, or the built-in character one."""
    path = getattr(model_cfg, "path", None)
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    from rlbatch.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def _preview(text: str, n: int = 60) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= n else flat[: n - 3] + "...")


def truncate(text: str, limit: int, side: str, tokenizer: PreTrainedTokenizerBase, field: str = "data") -> str:
    """``text`` cut at a token boundary so that ``tokenizer(text)`` has at most ``limit`` ids: its
    end kept (``side='left'``: the start is cut off) or its start (``'right'``)."""
    count: Callable[[str], int] = lambda t: len(tokenizer(t)["input_ids"])  # noqa: E731
    fast = bool(getattr(tokenizer, "is_fast", False))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids: list[int] = list(enc["input_ids"])
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]] if fast else []
    keep = limit - (count(text) - len(ids))  # the tokenizer's own special tokens take part of the limit
    if keep < 1:
        raise ConfigError(f"{field}.max_prompt_tokens: {limit} leaves no room for a prompt's text: the tokenizer adds "
                          f"{limit - keep} special tokens to every prompt")
    while keep >= 1:
        if fast:
            cut = text[offsets[len(ids) - keep][0]:] if side == "left" else text[: offsets[keep - 1][1]]
        else:
            cut = str(tokenizer.decode(ids[-keep:] if side == "left" else ids[:keep]))
        if count(cut) <= limit:
            return cut
        keep -= 1  # a cut that re-encodes longer (merges across the boundary): one token less
    raise ConfigError(f"{field}.max_prompt_tokens: no cut of the prompt {_preview(text)} fits {limit} tokens")


def guard(problems: Sequence[Sample], data: GuardConfig, tokenizer: PreTrainedTokenizerBase,
          field: str = "data") -> tuple[tuple[Sample, ...], PromptCounts]:
    """The problems after ``<field>.max_prompt_tokens`` and ``<field>.prompt_too_long`` (``field``
    names the section in messages: ``data`` or ``eval.data``), and what was done. A ConfigError
    for ``refuse`` (the first prompt over the limit, and how many are), and when nothing would be
    left."""
    limit, policy, side = int(data.max_prompt_tokens), str(data.prompt_too_long), str(data.truncation_side)
    counts = PromptCounts(prompts=len(problems), limit=limit)
    if not limit or not problems:
        return tuple(problems), counts
    if policy not in POLICIES or side not in SIDES:  # the parse refuses these; a caller's own config may not
        raise ConfigError(f"{field}.prompt_too_long / {field}.truncation_side: {policy!r} / {side!r}; expected one "
                          f"of {list(POLICIES)} / {list(SIDES)}")
    lengths = [len(ids) for ids in tokenizer([s.prompt for s in problems])["input_ids"]]
    counts.longest = max(lengths)
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return tuple(problems), counts
    first = over[0]
    if policy == "refuse":
        raise ConfigError(f"{field}.max_prompt_tokens: prompt {first} of the data set {_preview(problems[first].prompt)} "
                          f"is {lengths[first]} tokens, over the limit of {limit} ({len(over)} of {len(problems)} "
                          f"prompts are, the longest {counts.longest} tokens); raise {field}.max_prompt_tokens, or set "
                          f"{field}.prompt_too_long=drop or truncate")
    if policy == "drop":
        if len(over) == len(problems):
            raise ConfigError(f"{field}.max_prompt_tokens: every one of the {len(problems)} prompts is over the limit "
                              f"of {limit} tokens (the shortest is {min(lengths)}): {field}.prompt_too_long=drop "
                              f"would leave none")
        dropped = set(over)
        counts.dropped = len(over)
        out = tuple(s for i, s in enumerate(problems) if i not in dropped)
        what = "dropped"
    else:
        counts.truncated = len(over)
        cut = {i: truncate(problems[i].prompt, limit, side, tokenizer, field) for i in over}
        out = tuple(dataclasses.replace(s, prompt=cut[i]) if i in cut else s for i, s in enumerate(problems))
        what = f"truncated on the {side} (kept their {'end' if side == 'left' else 'start'})"
    line = (f"{field}.max_prompt_tokens={limit}: {len(over)} of {len(problems)} prompts are longer, {what} (the first: "
            f"prompt {first}, {lengths[first]} tokens; the longest {counts.longest} tokens)")
    if line not in _said:  # once per process: the held-out draw reads the training data again
        _said.add(line)
        log.warning("%s", line)
    return out, counts
