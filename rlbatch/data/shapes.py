"""A visual task built from a seed (``data.name=vlm_shapes``): small pictures of coloured shapes and
questions about them.

Each picture is a 64x64 PNG on a white background with one to four filled squares or circles, each
in a quadrant of the picture (a 2x2 grid, so shapes never touch: each is its own connected region of
one flat colour, no anti-aliasing). A quadrant is what one image token of the Qwen2-VL processor sees
(64x64 resized to 56x56: 2x2 tokens of 28x28 pixels), so a shape lies within one token and fills
most of it: the features of a random frozen vision tower then separate the four colours and the
empty quadrants clearly, which a tiny language model can learn to read by RL alone (with shapes
half as wide, anywhere in a 3x3 grid, it did not: docs/vlm.md). A question asks either the
colour of a picture's one shape, or how many shapes a picture has; the prompt marks the picture
with an ``<image>`` placeholder (``rlbatch.models.vlm``). Answers are one digit (a colour by the
number the question gives it), so the default reward (``rlbatch.rewards.rules:exact_match``)
checks them and a random-init model with the built-in character tokenizer (digits, no letters) can
say them in one token::

    <image>What colour is the shape? Answer 5 for red, 6 for green, 7 for blue, 8 for yellow.  -> "5"
    <image>How many shapes are there? Answer 1, 2, 3 or 4.                                     -> "3"

The pool holds as many questions of each colour as of each count (``per_answer`` of each of the
eight answers), so always giving one answer scores 1/8 and guessing among the four options a prompt
names scores 1/4 (the chance level). Every picture is drawn once and asked one question: a held-out
split (``eval.holdout``, drawn by index) shares no picture, hence no (picture, question) pair, with
the training stream.

    python -c "from rlbatch.data.shapes import vlm_shapes; s = vlm_shapes()[0]; print(s.prompt, s.answer)"
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from rlbatch.data.synthetic import Sample

SEED = 20261207
"""The seed of the built-in pool: its pictures and their order."""

SIZE = 64
"""Side of a picture in pixels (the Qwen2-VL processor resizes it to 56x56: 4 image tokens)."""
BACKGROUND = (255, 255, 255)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220), "yellow": (235, 200, 30)}
"""Colour name -> fill."""
COLOUR_ANSWERS = {"red": "5", "green": "6", "blue": "7", "yellow": "8"}
"""Colour name -> the answer the colour question asks for."""
COUNTS = (1, 2, 3, 4)
KINDS = ("square", "circle")
GRID = 2
"""Shapes sit in distinct cells of a GRID x GRID grid: the picture's quadrants, one image token each."""
SHAPE = 24
"""Side (square) or diameter (circle) of a shape in pixels. A cell is SIZE // GRID = 32 wide and a
shape's offset in it at most 32 - 24 - 1 = 7, so neighbours keep at least one background pixel apart."""

PLACEHOLDER = "<image>"
"""Where the picture goes in a prompt (``rlbatch.models.vlm.IMAGE_PLACEHOLDER``)."""
COLOUR_QUESTION = (PLACEHOLDER + "What colour is the shape? Answer "
                   + ", ".join(f"{a} for {c}" for c, a in COLOUR_ANSWERS.items()) + ".")
COUNT_QUESTION = PLACEHOLDER + "How many shapes are there? Answer 1, 2, 3 or 4."
CHANCE = 1 / 4
"""Accuracy of guessing uniformly among the four answers a prompt names (either question)."""


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cell: int
    """Index in the GRID x GRID grid, row-major."""
    dx: int
    dy: int
    """Offset of the shape's top-left corner within its cell."""


@dataclass(frozen=True)
class Picture:
    shapes: tuple[Shape, ...]

    def png(self) -> bytes:
        """The picture as PNG bytes (RGB, SIZE x SIZE), the same bytes for the same shapes."""
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
        draw = ImageDraw.Draw(image)
        cell = SIZE // GRID
        for s in self.shapes:
            x, y = (s.cell % GRID) * cell + s.dx, (s.cell // GRID) * cell + s.dy
            box = (x, y, x + SHAPE - 1, y + SHAPE - 1)
            fill = COLOURS[s.colour]
            if s.kind == "square":
                draw.rectangle(box, fill=fill)
            else:
                draw.ellipse(box, fill=fill)
        out = io.BytesIO()
        image.save(out, format="PNG", optimize=False)
        return out.getvalue()


def _picture(rng: random.Random, colours: list[str]) -> Picture:
    cells = rng.sample(range(GRID * GRID), len(colours))
    room = SIZE // GRID - SHAPE - 1  # a shape's largest offset inside its cell
    return Picture(tuple(Shape(rng.choice(KINDS), c, cell, rng.randint(0, room), rng.randint(0, room))
                         for c, cell in zip(colours, sorted(cells), strict=True)))


def pool(seed: int = SEED, per_answer: int = 64) -> tuple[tuple[Picture, str, str], ...]:
    """(picture, question, answer) triples: ``per_answer`` colour questions of each colour (one
    shape) and count questions of each count (shapes of colours drawn independently), every picture
    distinct, in an order drawn by ``seed``."""
    offsets = SIZE // GRID - SHAPE  # per axis: 0 to the largest offset (``_picture``)
    one_shape = GRID * GRID * len(KINDS) * offsets * offsets  # distinct pictures of one shape of a colour
    if not 1 <= per_answer <= one_shape // 2:
        raise ValueError(f"per_answer {per_answer} must be between 1 and {one_shape // 2}: there are {one_shape} "
                         f"pictures of one shape in a given colour")
    rng = random.Random(seed)
    seen: set[Picture] = set()
    out: list[tuple[Picture, str, str]] = []

    def draw(colours: list[str]) -> Picture:
        while (p := _picture(rng, colours)) in seen:  # at most half of the pictures are taken: few tries
            colours = colours if len(colours) == 1 else [rng.choice(list(COLOURS)) for _ in colours]
        seen.add(p)
        return p

    for colour in COLOURS:
        out += [(draw([colour]), COLOUR_QUESTION, COLOUR_ANSWERS[colour]) for _ in range(per_answer)]
    for n in COUNTS:
        out += [(draw([rng.choice(list(COLOURS)) for _ in range(n)]), COUNT_QUESTION, str(n))
                for _ in range(per_answer)]
    rng.shuffle(out)
    return tuple(out)


def vlm_shapes(seed: int = SEED, per_answer: int = 64) -> tuple[Sample, ...]:
    """The task's samples (``pool``): question, one-digit answer, the picture as PNG bytes."""
    return tuple(Sample(q, a, images=(p.png(),)) for p, q, a in pool(seed, per_answer))
