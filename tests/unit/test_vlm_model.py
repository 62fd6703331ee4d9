"""Random-init vision-language models and their processor (rlbatch.models.vlm), built offline without
torchvision: a prompt with image placeholders becomes the model's inputs, and the model reads the image."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

from rlbatch.models.spec import ModelSpec, spec_from_config
from rlbatch.models.vlm import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    VLM_ARCHS,
    VisionSpec,
    add_vision_tokens,
    build_processor,
    build_tiny_vlm,
    encode,
    load_processor,
    mrope_section,
)
from tests.unit.chat_fixtures import chat_tokenizer

VISION = VisionSpec()  # patch 14, merge 2: a token per 28x28 pixels after the resize


def _tokenizer() -> Any:
    tok = chat_tokenizer(template=None)
    add_vision_tokens(tok)
    return tok


def _text_spec(tok: Any) -> ModelSpec:
    return spec_from_config({"max_position_embeddings": 512}, vocab=len(tok))


def test_torchvision_is_not_installed() -> None:
    # What the module is for: were torchvision importable, the tests below would not show that it is not needed.
    import importlib.util

    assert importlib.util.find_spec("torchvision") is None


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_processor_expands_each_image_to_its_merged_patches(arch: Any) -> None:
    tok = _tokenizer()
    proc = build_processor(tok, VISION, arch)
    # vLLM checks the class of the processor it is given.
    assert isinstance(proc, {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[arch])
    # PIL sizes are (width, height). 64x64 resizes to 56x56 (sides rounded to multiples of 28): a 4x4 grid
    # of 14-pixel patches, 2x2 tokens. 100 (h) x 60 (w) resizes to 112x56: an 8x4 grid, 4x2 tokens.
    square, tall = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (60, 100), (0, 0, 255))
    batch = encode(proc, "<image>and<image>: which one is red?", [square, tall])

    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 4]]
    assert tuple(batch["pixel_values"].shape) == (16 + 32, 3 * 2 * 14 * 14)
    assert [VISION.tokens(64, 64), VISION.tokens(100, 60)] == [4, 8]
    ids = batch["input_ids"][0].tolist()
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VISION_START, VISION_END))
    # Each image is vision_start, its pads, vision_end, in the order of the placeholders.
    spans = [(i, ids.index(end, i)) for i, t in enumerate(ids) if t == start]
    assert [ids[a + 1 : b] for a, b in spans] == [[pad] * 4, [pad] * 8]
    assert batch["mm_token_type_ids"][0].tolist() == [int(t == pad) for t in ids]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "and<|vision_start|>" in text and "which one is red?" in text


def test_a_prompt_needs_one_placeholder_per_image() -> None:
    proc = build_processor(_tokenizer(), VISION)
    image = Image.new("RGB", (64, 64))
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) '<image>' but 2 image\(s\)"):
        encode(proc, "<image>which is larger?", [image, image])


def test_a_tokenizer_without_the_vision_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks the vision tokens"):
        build_processor(chat_tokenizer(template=None), VISION)


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_the_model_reads_the_image_and_generates(arch: Any) -> None:
    tok = _tokenizer()
    proc = build_processor(tok, VISION, arch)
    model = build_tiny_vlm(_text_spec(tok), VISION, tok, arch=arch, seed=0).eval()
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    same = build_tiny_vlm(_text_spec(tok), VISION, tok, arch=arch, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))

    red, blue = (encode(proc, "<image>What colour is the shape?", [Image.new("RGB", (64, 64), c)])
                 for c in ((255, 0, 0), (0, 0, 255)))
    assert torch.equal(red["input_ids"], blue["input_ids"])  # the prompts differ only in their pixels
    with torch.no_grad():
        logits_red, logits_blue = (model(**b).logits for b in (red, blue))
        out = model.generate(**red, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    length = red["input_ids"].shape[1]
    assert logits_red.shape == (1, length, len(tok)) and bool(torch.isfinite(logits_red).all())
    first_image_token = red["input_ids"][0].tolist().index(tok.convert_tokens_to_ids(IMAGE_PAD))
    # Before the image the two prompts are the same tokens; from the image on, the pixels change the logits.
    assert torch.allclose(logits_red[0, :first_image_token], logits_blue[0, :first_image_token], atol=1e-5)
    assert not torch.allclose(logits_red[0, -1], logits_blue[0, -1], atol=1e-4)
    assert out.shape[0] == 1 and length < out.shape[1] <= length + 3


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_a_saved_processor_loads_back_and_encodes_the_same(arch: Any, tmp_path: Path) -> None:
    proc = build_processor(_tokenizer(), VISION, arch)
    proc.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": arch}))
    image = Image.new("RGB", (90, 50), (0, 200, 0))
    want = encode(proc, "Is it green? <image>", [image])
    loaded = load_processor(tmp_path)
    assert type(loaded) is type(proc)
    got = encode(loaded, "Is it green? <image>", [image])
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_rotary_frequencies_split_as_qwen2_vl_splits_its_128_dim_heads() -> None:
    # Qwen2-VL-7B's config.json: "mrope_section": [16, 24, 24] for head_dim 3584 / 28 = 128.
    assert mrope_section(128) == [16, 24, 24]
    assert [sum(mrope_section(d)) for d in (16, 32, 64)] == [8, 16, 32]


@pytest.mark.parametrize(("vision", "arch", "message"), [
    (VisionSpec(hidden=30, heads=4), "qwen2_vl", "vision.hidden 30 / vision.heads 4"),
    (VisionSpec(ffn=48), "qwen2_vl", "vision.ffn 48 must be a multiple of vision.hidden 32"),
    (VisionSpec(full_attention_blocks=(2,)), "qwen2_5_vl", r"vision.full_attention_blocks \[2\] must lie in \[0, depth=2\)"),
    (VisionSpec(window_size=100), "qwen2_5_vl", "vision.window_size 100 must be a multiple of patch_size x merge_size = 28"),
])
def test_vision_shapes_the_builder_cannot_make_are_refused(vision: VisionSpec, arch: Any, message: str) -> None:
    tok = _tokenizer()
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        build_tiny_vlm(_text_spec(tok), vision, tok, arch=arch)
