"""The records of a local data file, read as prompts and answers, with the unusable ones counted.

Two layouts, told apart by ``data.layout`` (``auto`` reads the file's first record):

- ``flat``: ``{"question": "...", "answer": "..."}`` (GSM8K's own files);
- ``verl``: verl's RL layout, ``{"prompt": [{"role": "user", "content": "..."}], "data_source":
  "openai/gsm8k", "reward_model": {"ground_truth": "72"}, "extra_info": {...}}``.

Field names are dotted paths into a record (``data.answer_key=reward_model.ground_truth``); unset,
they are the layout's. A prompt is text or a list of chat messages; ``extra_info`` is not read.

JSON Lines are read line by line with the standard library, not through HF datasets: datasets
falls back to pandas on a column of mixed types and turns ``"007"`` into ``7``, and one malformed
line fails the whole file. Here each line is a record of its own, kept exactly as written, and a
bad one is counted with its line number. Parquet, whose columns are typed, goes through datasets.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeAlias

from rlbatch.config.plain import dotted
from rlbatch.errors import ConfigError

LAYOUTS = ("auto", "flat", "verl")
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

JsonValue: TypeAlias = "str | int | float | bool | None | list[JsonValue] | dict[str, JsonValue]"
"""A value as JSON holds it (a parsed record, a tool call's arguments, a task record's fields)."""
JsonObject: TypeAlias = "dict[str, JsonValue]"

Message = dict[str, str]
"""One chat message, ``{"role": ..., "content": ...}`` (the shape ``apply_chat_template`` takes)."""
Prompt = str | list[Message]
"""A question (text) or chat messages (``[{"role": ..., "content": ...}, ...]``)."""


class RecordsConfig(Protocol):
    """What ``read_records`` reads of the data section (``DataConfig``, or the launcher's checks' view of it)."""

    @property
    def path(self) -> str | None: ...
    @property
    def layout(self) -> str: ...
    @property
    def prompt_key(self) -> str | None: ...
    @property
    def answer_key(self) -> str | None: ...
    @property
    def data_source_key(self) -> str | None: ...


@dataclass(frozen=True)
class Keys:
    """Where a record holds its prompt, its reference answer and its data source (dotted paths)."""

    prompt: str
    answer: str
    data_source: str


LAYOUT_KEYS = {"flat": Keys("question", "answer", "data_source"),
               "verl": Keys("prompt", "reward_model.ground_truth", "data_source")}


@dataclass(frozen=True)
class Record:
    row: int
    """1-based: the line of a JSON Lines file, the row of a parquet file or a JSON array."""
    prompt: Prompt
    answer: str
    data_source: str
    images: tuple[bytes, ...] = ()
    """Encoded images of the prompt, one per ``<image>`` placeholder (``rlbatch.data.images``)."""


@dataclass
class Skipped:
    """The records left out, by reason, with their rows (1-based)."""

    total: int = 0
    rows: dict[str, list[int]] = field(default_factory=dict)

    def add(self, reason: str, row: int) -> None:
        self.rows.setdefault(reason, []).append(row)

    @property
    def count(self) -> int:
        return sum(len(r) for r in self.rows.values())

    def summary(self, first: int = 5) -> str:
        """``"3 of 10 records skipped: 2 have no field 'answer' (rows 3, 7), ..."``, the first rows of each reason."""
        parts = []
        for reason, rows in sorted(self.rows.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            shown = ", ".join(map(str, rows[:first])) + (", ..." if len(rows) > first else "")
            if len(rows) == 1:  # reasons are written for several records
                reason = re.sub(r"^(have|are)\b", lambda m: {"have": "has", "are": "is"}[m.group(1)], reason)
                reason = reason.replace("not objects", "not an object")
            parts.append(f"{len(rows)} {reason} (row{'s' if len(rows) > 1 else ''} {shown})")
        return f"{self.count} of {self.total} records skipped: " + "; ".join(parts)


def read_rows(path: str) -> list[tuple[int, Row]]:
    """``(row, record)`` for each record of a .jsonl, .json or .parquet file; nothing is downloaded.

    A JSON Lines line that is not valid JSON (or not UTF-8) comes back as an ``_Unreadable`` record,
    counted later as skipped; blank lines are not records. A .json file holds a JSON array of
    records, or JSON Lines."""
    p = Path(path).expanduser()
    kind = SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise ConfigError(f"data.path: {path} is not a .jsonl, .json or .parquet file")
    if not p.is_file():
        raise ConfigError(f"data.path: {path} does not exist on this machine")
    if kind == "parquet":
        import datasets

        datasets.disable_progress_bars()
        table = datasets.load_dataset("parquet", data_files=str(p), split="train")
        return [(i + 1, r) for i, r in enumerate(table)]
    data = p.read_bytes()
    if p.suffix.lower() == ".json" and data.lstrip().startswith(b"["):
        try:
            array = json.loads(data)
        except ValueError as e:
            raise ConfigError(f"data.path: {path} is not valid JSON: {e}") from e
        return [(i + 1, r) for i, r in enumerate(array)]
    rows: list[tuple[int, Row]] = []
    # Split the bytes, not decoded text: str.splitlines also breaks at U+2028, which JSON strings may hold.
    for n, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError)
                rows.append((n, _Unreadable()))
    return rows


class _Unreadable:
    """A JSON Lines line that is not valid JSON."""


Row: TypeAlias = "JsonValue | _Unreadable"
"""A record as read: any JSON value (a usable one is an object), or a line that is not JSON."""


_MISSING = object()


def load_records(path: str) -> list[JsonObject]:
    """Rows of a local jsonl/json/parquet file (``records.read_rows``); a ConfigError naming the rows
    that are not JSON objects."""
    rows = read_rows(path)
    bad = [n for n, r in rows if not isinstance(r, dict)]
    if bad:
        raise ConfigError(f"data.path: {path}: {len(bad)} of its {len(rows)} records are not JSON objects "
                          f"(rows {', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})")
    return [r for _, r in rows if isinstance(r, dict)]


def _get(record: Mapping[str, object], path: str) -> object:
    return dotted(record, path, _MISSING)


def resolve_keys(data_cfg: RecordsConfig, first: object) -> Keys:
    """The field names to read: the layout's (``auto``: verl's when the first record has 'prompt'
    and 'reward_model', else flat), each replaced by ``data.<x>_key`` where that is set."""
    layout = str(getattr(data_cfg, "layout", "auto") or "auto")
    if layout not in LAYOUTS:
        raise ConfigError(f"data.layout: {layout!r} is not one of {list(LAYOUTS)}")
    if layout == "auto":
        verl = isinstance(first, Mapping) and "prompt" in first and "reward_model" in first
        layout = "verl" if verl else "flat"
    base = LAYOUT_KEYS[layout]
    given = {k: getattr(data_cfg, f"{k}_key", None) for k in ("prompt", "answer", "data_source")}
    return Keys(**{k: str(v) if v else getattr(base, k) for k, v in given.items()})


def _type(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _prompt(value: object, key: str) -> tuple[Prompt | None, str | None]:
    """The prompt, or why the value is not one."""
    if isinstance(value, str):
        return (value, None) if value.strip() else (None, f"have an empty '{key}'")
    if isinstance(value, list) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value], None
    if isinstance(value, list):
        return None, f"have a '{key}' list that is not chat messages ({{'role': str, 'content': str}}, at least one)"
    return None, f"have a '{key}' of type {_type(value)} (expected text or a list of chat messages)"


def _answer(value: object, key: str) -> tuple[str | None, str | None]:
    """The reference answer as text, or why the value is not one."""
    if isinstance(value, str):
        return (value, None) if value.strip() else (None, f"have an empty '{key}'")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), None
    if isinstance(value, float):
        return (repr(value), None) if math.isfinite(value) else (None, f"have an '{key}' that is {value}")
    return None, f"have an '{key}' of type {_type(value)} (expected text or a number)"


def _source(value: object, key: str) -> tuple[str | None, str | None]:
    if value is _MISSING or value is None:
        return "", None
    if not isinstance(value, str):
        return None, f"have a '{key}' of type {_type(value)} (expected text)"
    return value, None


def parse_records(rows: list[tuple[int, Row]], keys: Keys, base: Path | None = None) -> tuple[list[Record], Skipped]:
    """The usable records, and those skipped with the reason and row of each. A record's images
    (``images``, paths relative to ``base``) must match its placeholders: a ConfigError names every
    record where they do not, or where an image cannot be read."""
    from rlbatch.data.images import IMAGES_KEY, ImageError, count_problem, record_images

    out: list[Record] = []
    refused: list[str] = []
    skipped = Skipped(total=len(rows))
    for row, r in rows:
        if isinstance(r, _Unreadable):
            skipped.add("are not valid JSON", row)
            continue
        if not isinstance(r, Mapping):
            skipped.add(f"are not objects ({_type(r)})", row)
            continue
        raw_prompt, raw_answer = _get(r, keys.prompt), _get(r, keys.answer)
        if raw_prompt is _MISSING or raw_prompt is None:
            skipped.add(f"have no field '{keys.prompt}'", row)
            continue
        if raw_answer is _MISSING or raw_answer is None:
            skipped.add(f"have no field '{keys.answer}'", row)
            continue
        (prompt, bad_prompt), (answer, bad_answer) = _prompt(raw_prompt, keys.prompt), _answer(raw_answer, keys.answer)
        source, bad_source = _source(_get(r, keys.data_source), keys.data_source)
        why = bad_prompt or bad_answer or bad_source
        if why is not None:
            skipped.add(why, row)
            continue
        assert prompt is not None and answer is not None and source is not None
        try:
            images = record_images(r.get(IMAGES_KEY), base)
        except ImageError as e:
            refused.append(f"record {row}: {e}")
            continue
        if (mismatch := count_problem(row, prompt, len(images))) is not None:
            refused.append(mismatch)
            continue
        out.append(Record(row, prompt, answer, source, images))
    if refused:
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        raise ConfigError([f"data.path: {p}" for p in refused[:5]] + ([f"data.path: {more.strip()}"] if more else []))
    return out, skipped


def fill_template(template: str, question: str) -> str:
    """``data.template`` filled with a text prompt; a ConfigError for a template with other fields."""
    try:
        return template.format(question=question)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"data.template: {template!r} cannot be filled with the question only ({type(e).__name__}: "
                          f"{e}); '{{question}}' is its one field, write '{{{{' and '}}}}' for literal braces") from e


def read_records(data_cfg: RecordsConfig) -> tuple[list[Record], Skipped, Keys]:
    """The usable records of ``data.path`` (a ConfigError naming the file and the counts when none is)."""
    path = str(data_cfg.path)
    rows = read_rows(path)
    if not rows:
        raise ConfigError(f"data.path: {path} has no records")
    keys = resolve_keys(data_cfg, rows[0][1])
    records, skipped = parse_records(rows, keys, Path(path).expanduser().parent)
    if not records:
        raise ConfigError(f"data.path: {path}: none of its {len(rows)} records is usable ({skipped.summary()}); "
                          f"fields read: prompt '{keys.prompt}', answer '{keys.answer}' (data.prompt_key, "
                          f"data.answer_key, data.layout)")
    return records, skipped, keys
