"""Where prompts come from: the built-in synthetic task or a jsonl/parquet file.

Both become a ``PromptStream``: seeded, shuffled epochs, resumable from its position.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rlbatch.data.synthetic import PromptStream, Sample, arithmetic_problems
from rlbatch.errors import ConfigError


def load_records(path: str) -> list[dict[str, Any]]:
    """Rows of a local jsonl/json/parquet file, read with HF datasets (nothing downloaded)."""
    from datasets import load_dataset

    suffix = Path(path).suffix.lower()
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
    if kind is None:
        raise ConfigError(f"data.path: {path!r} is not .jsonl, .json or .parquet")
    if not Path(path).exists():
        raise ConfigError(f"data.path: {path!r} does not exist")
    return list(load_dataset(kind, data_files=path, split="train"))


def file_problems(data_cfg: Any) -> tuple[Sample, ...]:
    rows = load_records(str(data_cfg.path))
    missing = [k for k in (data_cfg.prompt_key, data_cfg.answer_key) if rows and k not in rows[0]]
    if missing:
        raise ConfigError(f"data: {data_cfg.path} has no field(s) {missing}; its fields are {sorted(rows[0])}")
    return tuple(
        Sample(prompt=str(data_cfg.template).format(question=r[data_cfg.prompt_key]), answer=str(r[data_cfg.answer_key]))
        for r in rows
    )


def fingerprint(problems: tuple[Sample, ...]) -> str:
    """A digest of the dataset's content and order, stored in checkpoints to catch a changed dataset."""
    h = hashlib.sha256()
    for s in problems:
        h.update(s.prompt.encode())
        h.update(b"\0")
        h.update(s.answer.encode())
        h.update(b"\1")
    return f"{len(problems)}:{h.hexdigest()[:16]}"


def problems_of(data_cfg: Any) -> tuple[Sample, ...]:
    """The problem set ``data.name`` names: synthetic, file, synthetic_code or code_file."""
    from rlbatch.data import code

    build = {"synthetic": lambda: arithmetic_problems(), "file": lambda: file_problems(data_cfg),
             "synthetic_code": lambda: code.synthetic_code_problems(),
             "code_file": lambda: code.code_file_problems(data_cfg)}
    if data_cfg.name not in build:
        raise ConfigError(f"data.name: {data_cfg.name!r} is not one of {sorted(build)}")
    return build[data_cfg.name]()


def make_stream(data_cfg: Any, seed: int) -> tuple[PromptStream, str]:
    """The prompt stream and the dataset's fingerprint."""
    problems = problems_of(data_cfg)
    return PromptStream(problems, seed=seed), fingerprint(problems)
