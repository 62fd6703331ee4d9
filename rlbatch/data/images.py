"""Images of prompt records, and a prompt with images as a vision-language model's inputs.

A record may carry ``images``: a list in placeholder order, each image encoded bytes (PNG, JPEG), a
mapping ``{"bytes": ..., "path": ...}`` (verl's parquet layout; ``bytes`` first, else the path), or
a path (a JSON Lines file: relative to the data file). The prompt marks where each goes with
``<image>`` (``IMAGE_PLACEHOLDER``); a record whose placeholder count differs from its image count
is refused before start, naming its row and both numbers.

On the generate rank (``prompt_inputs``) each placeholder becomes Qwen2-VL's vision span
``<|vision_start|><|image_pad|><|vision_end|>`` in the rendered text, and the model's processor
expands the pad to the image's tokens and computes ``pixel_values`` / ``image_grid_thw``. A sample
carries them as two flattened per-sample fields (``PIXEL_VALUES``, ``IMAGE_GRID``); ``model_inputs``
gives them back in the model's shapes. The inference engine gets each prompt's images as
``ProcessedImages``: the encoded images with those two tensors beside them, so an engine that runs
the model itself (hf) does not process the images again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import torch

    from rlbatch.models.vlm import ImageOnly

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a prompt's text (verl's parquet layout)."""
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""Qwen2-VL's special tokens: an image is ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch
+ ``<|vision_end|>`` (the processor repeats the pad); the video pad is only named, never used here."""
IMAGES_KEY = "images"
"""The record field that holds a prompt's images."""
PIXEL_VALUES, IMAGE_GRID = "pixel_values", "image_grid_thw"
"""Per-sample fields of a prompt's images: its processed patches (float, [patches x C*T*P*P]
flattened) and each image's (t, h, w) patch grid (3 per image, flattened)."""


class ImageError(ValueError):
    """Why a record's images cannot be read."""


def image_bytes(value: object, base: Path | None) -> bytes:
    """One image of a record as encoded bytes: the bytes themselves, ``{"bytes": ...}`` (or, when
    that is empty, its ``"path"``), or a path read from the disk (relative to ``base``)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, Mapping):
        if isinstance(data := value.get("bytes"), bytes | bytearray) and data:
            return bytes(data)
        if isinstance(path := value.get("path"), str) and path:
            return image_bytes(path, base)
        raise ImageError(f"an image mapping with neither bytes nor a path (keys {sorted(map(str, value))})")
    if type(value).__module__.startswith("PIL."):  # a parquet column HF datasets decodes as images
        import io

        buf = io.BytesIO()
        value.save(buf, format="PNG")  # type: ignore[attr-defined]
        return buf.getvalue()
    if isinstance(value, str) and value:
        p = Path(value).expanduser()
        p = p if p.is_absolute() or base is None else base / p
        if not p.is_file():
            raise ImageError(f"image file {p} does not exist")
        return p.read_bytes()
    raise ImageError(f"an image of type {type(value).__name__} (expected bytes, {{'bytes': ...}} or a path)")


def record_images(value: object, base: Path | None) -> tuple[bytes, ...]:
    """A record's ``images`` field (absent: None) as encoded images, in order."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ImageError(f"'{IMAGES_KEY}' of type {type(value).__name__} (expected a list of images)")
    return tuple(image_bytes(v, base) for v in value)


def placeholders(prompt: str | Sequence[Mapping[str, str]]) -> int:
    """The image placeholders in a prompt (text, or every message's content)."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in prompt)


def count_problem(row: int, prompt: str | Sequence[Mapping[str, str]], images: int) -> str | None:
    """Why a record's placeholders and images do not match (None when they do)."""
    found = placeholders(prompt)
    if found == images:
        return None
    return (f"record {row} has {found} image placeholder(s) {IMAGE_PLACEHOLDER!r} in its prompt but {images} "
            f"image(s) in '{IMAGES_KEY}'; each image needs one placeholder where it goes")


def images_key(images: Sequence[bytes]) -> bytes:
    """A digest of a prompt's images (b'' for none): prompts with equal text and different images
    are different prompts to every dedupe by prompt."""
    if not images:
        return b""
    h = hashlib.sha256()
    for im in images:
        h.update(len(im).to_bytes(8, "little"))
        h.update(im)
    return h.digest()


def same_prompt(texts: Sequence[str], images: Sequence[Sequence[bytes]] | None = None) -> list[int]:
    """Per prompt, the index of the first prompt with the same text and images (its own when none
    before it): prompts of one index are encoded once, and their samples share the image fields."""
    keys = [(t, images_key(images[i]) if images is not None else b"") for i, t in enumerate(texts)]
    first: dict[tuple[str, bytes], int] = {}
    return [first.setdefault(k, i) for i, k in enumerate(keys)]


@dataclass(frozen=True)
class PromptInputs:
    """One prompt with its images as a vision-language model reads it."""

    ids: list[int]
    pixel_values: torch.Tensor
    """float32 [patches, C*T*P*P]."""
    image_grid_thw: torch.Tensor
    """int64 [images, 3]."""

    def fields(self) -> dict[str, torch.Tensor]:
        """The per-sample fields (``PIXEL_VALUES``, ``IMAGE_GRID``): flattened, 1-D."""
        return {PIXEL_VALUES: self.pixel_values.reshape(-1), IMAGE_GRID: self.image_grid_thw.reshape(-1)}


def vision_text(text: str) -> str:
    """``text`` with each image placeholder as the vision span the processor expands."""
    return text.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)


def decode_image(data: bytes) -> object:
    """Encoded bytes as an RGB PIL image."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def prompt_inputs(processor: ImageOnly, text: str, images: Sequence[bytes]) -> PromptInputs:
    """A rendered prompt (``text`` with one placeholder per image, in order) and its encoded images
    through the model's processor: token ids (each image's pad expanded to its tokens),
    ``pixel_values`` and ``image_grid_thw``. A count mismatch is a ValueError naming both numbers."""
    found = text.count(IMAGE_PLACEHOLDER)
    if found != len(images):
        raise ValueError(f"prompt has {found} image placeholder(s) {IMAGE_PLACEHOLDER!r} but {len(images)} image(s)")
    if not images:
        raise ValueError("prompt_inputs is for prompts with images; a text prompt is tokenised as it is")
    out = processor(text=[vision_text(text)], images=[decode_image(b) for b in images], return_tensors="pt")
    return PromptInputs(out["input_ids"][0].tolist(), out["pixel_values"].float(), out["image_grid_thw"].long())


def model_inputs(sample: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3] int64) of a sample's fields, as
    ``PromptInputs.fields`` flattened them (the data plane moves the grid as int64; a float grid is
    read too); None for a sample without images."""
    if IMAGE_GRID not in sample or not sample[IMAGE_GRID].numel():
        return None
    grid = sample[IMAGE_GRID].reshape(-1, 3)
    grid = grid.round().long() if grid.is_floating_point() else grid.long()
    patches = int(grid.prod(dim=1).sum())
    pixels = sample[PIXEL_VALUES].float()
    if patches <= 0 or pixels.numel() % patches:
        raise ValueError(f"{PIXEL_VALUES}: {pixels.numel()} values do not split into the {patches} patches of "
                         f"{IMAGE_GRID} {grid.tolist()}")
    return pixels.reshape(patches, -1), grid


@dataclass(frozen=True, eq=False)
class ProcessedImages(Sequence[bytes]):
    """A prompt's images as the generate rank hands them to its inference engine: the encoded images
    in placeholder order (a sequence of bytes, what an engine that processes images itself reads:
    vLLM), with the ``pixel_values`` / ``image_grid_thw`` the model's processor computed from them
    for the prompt's ids (what an engine that runs the model on them takes as they are: hf)."""

    encoded: tuple[bytes, ...]
    pixel_values: torch.Tensor
    """float32 [patches, C*T*P*P]."""
    image_grid_thw: torch.Tensor
    """int64 [images, 3]: one row per image of ``encoded``."""

    @classmethod
    def of(cls, images: Sequence[bytes], fields: Mapping[str, torch.Tensor]) -> ProcessedImages:
        """``images`` with their per-sample fields (``PromptInputs.fields``) in the model's shapes."""
        inputs = model_inputs(fields)
        grids = 0 if inputs is None else len(inputs[1])
        if inputs is None or grids != len(images):
            raise ValueError(f"{len(images)} image(s) but {IMAGE_GRID} holds the grids of {grids}")
        return cls(tuple(images), *inputs)

    def __len__(self) -> int:
        return len(self.encoded)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[bytes, ...]: ...

    def __getitem__(self, index: int | slice) -> bytes | tuple[bytes, ...]:
        return self.encoded[index]


Encoded = tuple[list[int], dict[str, "torch.Tensor"]]
"""A prompt as a generate rank holds it: its token ids and its per-sample image fields ({} without images)."""


class PromptEncoder:
    """The prompts of a generate phase as token ids, each distinct prompt encoded once: a text prompt
    by the tokenizer, a prompt with images by the model's processor (built on first use). Distinct
    means distinct text *and* images: two prompts with the same text and different images of one
    size have the same ids and are still two prompts."""

    def __init__(self, tokenizer: Callable[[list[str]], Mapping[str, list[list[int]]]],
                 processor: Callable[[], ImageOnly]) -> None:
        self.tokenizer, self._make_processor = tokenizer, processor
        self._processor: ImageOnly | None = None

    def encode(self, texts: Sequence[str], images: Sequence[Sequence[bytes]] | None = None) -> list[Encoded]:
        """One ``Encoded`` per text (``images[i]``: text i's encoded images, in placeholder order)."""
        first = same_prompt(texts, images)
        firsts = sorted(set(first))
        plain = [i for i in firsts if images is None or not images[i]]
        ids = dict(zip(plain, self.tokenizer([texts[i] for i in plain])["input_ids"], strict=True)) if plain else {}
        done: dict[int, Encoded] = {i: (ids[i], {}) for i in plain}
        for i in firsts:
            if i not in done:
                assert images is not None
                if self._processor is None:
                    self._processor = self._make_processor()
                inputs = prompt_inputs(self._processor, texts[i], images[i])
                done[i] = (inputs.ids, inputs.fields())
        return [done[k] for k in first]
