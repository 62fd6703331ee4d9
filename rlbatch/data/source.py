"""Where prompts come from: the built-in synthetic task or a jsonl/parquet file (``records``: flat
records or verl's layout), rendered with the model's chat template when ``data.chat_template``.

Both become a ``PromptStream``: seeded, shuffled epochs, resumable from its position, after the
prompt-length guard (``data.max_prompt_tokens``: ``rlbatch.data.prompt_length``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

from rlbatch.data.chat import ChatPrompts, chat_prompts
from rlbatch.data.images import images_key
from rlbatch.data.prompt_length import PromptCounts, guard, prompt_tokenizer
from rlbatch.data.records import fill_template, read_records
from rlbatch.data.synthetic import PromptStream, Sample, arithmetic_problems
from rlbatch.errors import ConfigError

if TYPE_CHECKING:
    from rlbatch.config.schema import DataConfig, ModelConfig

log = logging.getLogger(__name__)


def file_problems(data_cfg: DataConfig, chat: ChatPrompts | None = None) -> tuple[Sample, ...]:
    """The usable records of ``data.path`` as problems; the skipped ones in one warning."""
    records, skipped, keys = read_records(data_cfg)
    if skipped.count:
        log.warning("data.path: %s: %s; the other %d are used", data_cfg.path, skipped.summary(), len(records))
    chats = [r.row for r in records if not isinstance(r.prompt, str)]
    if chats and chat is None:
        raise ConfigError(f"data.path: {data_cfg.path}: the prompts ('{keys.prompt}') of {len(chats)} records are chat "
                          f"messages (rows {', '.join(map(str, chats[:5]))}{', ...' if len(chats) > 5 else ''}); set "
                          f"data.chat_template=true to render them with the model's chat template")
    template = str(data_cfg.template)
    prompts = [fill_template(template, r.prompt) if isinstance(r.prompt, str) else r.prompt for r in records]
    texts = chat.render_all(prompts) if chat is not None else [str(p) for p in prompts]
    return tuple(Sample(t, r.answer, r.data_source, r.images) for t, r in zip(texts, records, strict=True))


def fingerprint(problems: tuple[Sample, ...]) -> str:
    """A digest of the dataset's content and order, stored in checkpoints to catch a changed dataset."""
    h = hashlib.sha256()
    for s in problems:
        h.update(s.prompt.encode())
        h.update(b"\0")
        h.update(s.answer.encode())
        if s.data_source:  # a dataset without sources keeps the digest it had before they existed
            h.update(b"\2")
            h.update(s.data_source.encode())
        if s.images:  # likewise a dataset without images
            h.update(b"\3")
            h.update(images_key(s.images))
        h.update(b"\1")
    return f"{len(problems)}:{h.hexdigest()[:16]}"


def problems_of(data_cfg: DataConfig, model_cfg: ModelConfig | None = None) -> tuple[Sample, ...]:
    """The problem set ``data.name`` names: synthetic, word_arithmetic, file, synthetic_code, code_file
    or none; with ``data.chat_template``, the prompts rendered with ``model.path``'s chat template (a
    word problem after ``data.template``)."""
    from rlbatch.data import code, shapes, word_problems

    chat = chat_prompts(data_cfg, model_cfg)
    build = {"synthetic": lambda: arithmetic_problems(), "file": lambda: file_problems(data_cfg, chat),
             # a question in words, filled into data.template as a file's is
             "word_arithmetic": lambda: tuple(Sample(fill_template(str(data_cfg.template), s.prompt), s.answer)
                                              for s in word_problems.word_problems()),
             "vlm_shapes": lambda: tuple(Sample(fill_template(str(data_cfg.template), s.prompt), s.answer, images=s.images)
                                         for s in shapes.vlm_shapes()),
             "synthetic_code": lambda: code.synthetic_code_problems(),
             "code_file": lambda: code.code_file_problems(data_cfg),
             "none": lambda: (Sample("", ""),)}  # one empty task: an environment draws each episode from its seed
    if data_cfg.name not in build:
        raise ConfigError(f"data.name: {data_cfg.name!r} is not one of {sorted(build)}")
    problems = build[data_cfg.name]()
    if chat is None or data_cfg.name in ("file", "none"):  # an env's rollout renders an empty task's opening
        return problems
    texts = chat.render_all([s.prompt for s in problems])
    return tuple(Sample(t, s.answer) for t, s in zip(texts, problems, strict=True))


def split_holdout(problems: tuple[Sample, ...], n: int, seed: int) -> tuple[tuple[Sample, ...], tuple[Sample, ...]]:
    """(training problems, held-out problems): ``n`` problems drawn by ``seed`` alone (not the run's
    seed, so every run of a data set holds out the same ones), both in the data set's order. A
    ConfigError when fewer than one problem would be left to train on."""
    if n <= 0:
        return problems, ()
    if n >= len(problems):
        raise ConfigError(f"eval.holdout: {n} held-out problems leave none of the training data's {len(problems)} to train on")
    import random

    held = set(random.Random(seed).sample(range(len(problems)), n))
    return (tuple(p for i, p in enumerate(problems) if i not in held),
            tuple(p for i, p in enumerate(problems) if i in held))


def guarded_problems(data_cfg: DataConfig, model_cfg: ModelConfig | None = None,
                     field: str = "data") -> tuple[tuple[Sample, ...], PromptCounts]:
    """``problems_of`` through the prompt-length guard (``data.max_prompt_tokens``,
    ``data.prompt_too_long``; ``rlbatch.data.prompt_length``): the problems a run uses, and what the
    guard dropped or truncated. ``field`` names the section in messages (``eval.data``)."""
    problems = problems_of(data_cfg, model_cfg)
    if not int(getattr(data_cfg, "max_prompt_tokens", 0) or 0) or data_cfg.name == "none":
        return problems, PromptCounts(prompts=len(problems))
    return guard(problems, data_cfg, prompt_tokenizer(model_cfg), field)


def make_stream(data_cfg: DataConfig, seed: int, model_cfg: ModelConfig | None = None, holdout: int = 0,
                holdout_seed: int = 0, counts: PromptCounts | None = None) -> tuple[PromptStream, str]:
    """The prompt stream and the dataset's fingerprint. ``model_cfg`` (``cfg.model``) gives the
    tokenizer whose chat template ``data.chat_template=true`` renders prompts with. ``holdout``
    problems (``split_holdout``: eval.holdout, eval.holdout_seed) are left out of training, after
    the prompt-length guard; ``counts``, when given, is set to what the guard did."""
    guarded, done = guarded_problems(data_cfg, model_cfg)
    if counts is not None:
        vars(counts).update(vars(done))
    problems, _ = split_holdout(guarded, holdout, holdout_seed)
    return PromptStream(problems, seed=seed), fingerprint(problems)
