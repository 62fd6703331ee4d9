"""data.name=vlm_shapes: seeded pictures of coloured shapes whose answers can be read back from the
pixels, held out without a shared picture.

Chance level: the pool has as many questions of each of the 8 answers (5-8 for the colours, 1-4 the counts),
and each prompt names its 4 options, so guessing uniformly among them scores 1/4 = 0.25 on either
question kind and on the whole pool; always giving the same answer scores 1/8 = 0.125.
``test_chance_level`` computes both from the pool."""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image

from rlbatch.data.shapes import (
    BACKGROUND,
    CHANCE,
    COLOUR_ANSWERS,
    COLOUR_QUESTION,
    COLOURS,
    COUNT_QUESTION,
    SIZE,
    vlm_shapes,
)
from rlbatch.data.source import make_stream, problems_of, split_holdout
from rlbatch.data.synthetic import Sample
from rlbatch.rewards.rules import exact_match


def regions(png: bytes) -> list[str]:
    """The colour name of each 4-connected region of non-background pixels of a PNG."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert pixels.shape == (SIZE, SIZE, 3)
    fg = np.any(pixels != BACKGROUND, axis=-1)
    seen = np.zeros_like(fg)
    names = {v: k for k, v in COLOURS.items()}
    out = []
    for y, x in zip(*np.nonzero(fg), strict=True):
        if seen[y, x]:
            continue
        colours, stack = set(), [(y, x)]
        seen[y, x] = True
        while stack:
            i, j = stack.pop()
            colours.add(tuple(int(c) for c in pixels[i, j]))
            for a, b in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                if 0 <= a < SIZE and 0 <= b < SIZE and fg[a, b] and not seen[a, b]:
                    seen[a, b] = True
                    stack.append((a, b))
        assert len(colours) == 1, f"a region of several colours {colours}: shapes touch or are blurred"
        out.append(names[colours.pop()])
    return out


def answer_from_pixels(prompt: str, png: bytes) -> str:
    found = regions(png)
    if prompt == COLOUR_QUESTION:
        assert len(found) == 1, f"a colour question about {len(found)} shapes"
        return COLOUR_ANSWERS[found[0]]
    assert prompt == COUNT_QUESTION
    return str(len(found))


def test_answers_read_back_from_the_pixels_and_the_task_is_seeded() -> None:
    every = vlm_shapes(per_answer=16)
    assert len(every) == 8 * 16
    for s in every:
        assert s.prompt.count("<image>") == len(s.images) == 1 and s.images[0].startswith(b"\x89PNG")
        got = answer_from_pixels(s.prompt, s.images[0])
        assert got == s.answer, f"{s.prompt!r}: the picture shows {got!r}, the answer is {s.answer!r}"
        assert exact_match(f"{got}<eos>", s.answer) == 1.0  # the default reward scores it
    assert vlm_shapes(per_answer=16) == every  # same seed: same pictures, bytes and order
    other = vlm_shapes(seed=1, per_answer=16)
    assert {s.images for s in other} != {s.images for s in every}


def test_each_shape_lies_in_one_image_token() -> None:
    """A picture's quadrants are its 4 image tokens (64x64 resized to 56x56, 2x2 tokens of 28x28):
    every shape lies in one quadrant and covers most of it, with background before the next quadrant."""
    from rlbatch.data.shapes import GRID

    cell = SIZE // GRID
    assert GRID == 2 and cell == 32
    for s in vlm_shapes(per_answer=16):
        fg = np.any(np.asarray(Image.open(io.BytesIO(s.images[0])).convert("RGB")) != BACKGROUND, axis=-1)
        quadrants = [fg[y : y + cell, x : x + cell] for y in (0, cell) for x in (0, cell)]
        assert sum(q.any() for q in quadrants) == len(regions(s.images[0]))  # one shape per used quadrant
        for q in quadrants:
            if q.any():
                ys, xs = np.nonzero(q)
                assert ys.max() < cell - 1 and xs.max() < cell - 1  # a background pixel before the next quadrant
                assert (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1) >= 24 * 24  # most of the token


def pixels(s: Sample) -> bytes:
    """A digest of a sample's decoded picture (not its PNG encoding)."""
    return hashlib.sha256(np.asarray(Image.open(io.BytesIO(s.images[0]))).tobytes()).digest()


def test_held_out_pictures_are_not_in_the_training_stream() -> None:
    d = SimpleNamespace(name="vlm_shapes", chat_template=False, system_prompt=None, template="{question}")
    every = problems_of(d)  # type: ignore[arg-type]
    assert every == vlm_shapes() and len({pixels(s) for s in every}) == len(every)  # every picture once
    train, held = split_holdout(every, 64, seed=0)
    stream, _ = make_stream(d, seed=5, holdout=64, holdout_seed=0)  # type: ignore[arg-type]
    seen = {s for _ in range(2 * len(every) // 50 + 1) for s in stream.next_batch(50)}
    assert seen == set(train) and len(held) == 64
    assert {(pixels(s), s.prompt) for s in seen}.isdisjoint({(pixels(s), s.prompt) for s in held})
    assert {pixels(s) for s in seen}.isdisjoint({pixels(s) for s in held})


def test_chance_level() -> None:
    every = vlm_shapes()
    answers = Counter(s.answer for s in every)
    assert set(answers) == set("12345678") and len(set(answers.values())) == 1
    options = {COLOUR_QUESTION: ["5", "6", "7", "8"], COUNT_QUESTION: ["1", "2", "3", "4"]}
    for q, digits in options.items():  # each prompt names exactly the options of its kind
        assert [c for c in q if c.isdigit()] == digits
    # the text alone cannot do better: every prompt is one of the two questions, the same for all its answers
    assert {s.prompt for s in every} == set(options)
    uniform = np.mean([1 / len(options[s.prompt]) for s in every])
    constant = max(answers.values()) / len(every)
    print(f"vlm_shapes chance: uniform guess {uniform:.3f}, best constant answer {constant:.3f}")
    assert uniform == CHANCE == 0.25 and constant == 0.125


def test_the_experiment_composes_and_validates(tmp_path: Path) -> None:
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose

    composed = compose(["experiment=vlm_shapes", f"run_dir={tmp_path / 'run'}"])
    assert (composed.data.name, composed.model.arch, composed.model.train_vision) == ("vlm_shapes", "qwen2_vl", False)
    assert composed.algo.max_new_tokens == 1 and composed.data.reward_fn == "rlbatch.rewards.rules:exact_match"
    check(composed, runnable=False)
