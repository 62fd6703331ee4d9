"""Prompt records with images (rlbatch.data.images): verl's parquet layout and JSON Lines with image
paths become samples carrying their encoded images; a placeholder/image count mismatch is refused
before start; a sample's images go through the model's processor and back from the per-sample fields."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from rlbatch.config.schema import DataConfig, ModelConfig
from rlbatch.data.chat import ChatPrompts
from rlbatch.data.images import IMAGE_GRID, PIXEL_VALUES, model_inputs, prompt_inputs
from rlbatch.data.source import file_problems, fingerprint
from rlbatch.errors import ConfigError
from tests.unit.chat_fixtures import chat_tokenizer


def _png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = _png((255, 0, 0)), _png((0, 0, 255), (56, 112))


def _verl(prompt: str, answer: str, images: list[Any]) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": prompt}], "data_source": "shapes",
            "reward_model": {"ground_truth": answer}, "images": images}


def test_verl_parquet_and_jsonl_records_carry_their_images(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_verl("<image>colour?", "red", [{"bytes": RED, "path": None}]),
            _verl("<image><image>same?", "no", [{"bytes": RED, "path": None}, {"bytes": BLUE, "path": None}]),
            _verl("no image: 1+1=", "2", [])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    chat = ChatPrompts(chat_tokenizer())  # verl's prompts are chat messages: the placeholders stay in the rendering
    got = file_problems(DataConfig(name="file", path=str(tmp_path / "train.parquet"), template="{question}"), chat)
    assert [s.images for s in got] == [(RED,), (RED, BLUE), ()]
    assert [s.prompt.count("<image>") for s in got] == [1, 2, 0] and "<image><image>same?" in got[1].prompt

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "blue.png").write_bytes(BLUE)
    lines = [{"question": "<image>colour?", "answer": "blue", "images": ["img/blue.png"]},
             {"question": "text only", "answer": "x"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = file_problems(DataConfig(name="file", path=str(tmp_path / "data.jsonl"), template="{question}"))
    assert [s.images for s in got] == [(BLUE,), ()]
    # the dataset's fingerprint sees the images: the same text with another image is another dataset
    other = [{"question": "<image>colour?", "answer": "blue", "images": [str(tmp_path / "img" / "blue.png")]}]
    (tmp_path / "other.jsonl").write_text(json.dumps(other[0]) + "\n")
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "red.jsonl").write_text(json.dumps({**other[0], "images": ["red.png"]}) + "\n")
    fp = [fingerprint(file_problems(DataConfig(name="file", path=str(tmp_path / f), template="{question}")))
          for f in ("other.jsonl", "red.jsonl")]
    assert fp[0] != fp[1]


def test_a_placeholder_image_count_mismatch_is_refused_with_the_record_and_both_numbers(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(RED)
    lines = [{"question": "<image>ok", "answer": "1", "images": ["a.png"]},
             {"question": "<image>two?", "answer": "1", "images": ["a.png", "a.png"]},
             {"question": "<image>", "answer": "1", "images": ["missing.png"]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ConfigError) as e:
        file_problems(DataConfig(name="file", path=str(tmp_path / "d.jsonl"), template="{question}"))
    assert e.value.problems[0] == ("data.path: record 2 has 1 image placeholder(s) '<image>' in its prompt but 2 "
                                   "image(s) in 'images'; each image needs one placeholder where it goes")
    assert e.value.problems[1].startswith("data.path: record 3: image file ") and "missing.png" in e.value.problems[1]
    assert len(e.value.problems) == 2


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_a_prompts_images_go_through_the_processor_and_back_from_the_sample_fields(arch: str) -> None:
    from rlbatch.engines.model import load_model, load_processor, load_tokenizer
    from rlbatch.models.vlm import IMAGE_PAD

    cfg = ModelConfig(arch=arch, max_position_embeddings=256)
    tok = load_tokenizer(cfg)
    proc = load_processor(cfg, tok)
    inputs = prompt_inputs(proc, "<image>1+<image>=", [RED, BLUE])
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    grid = inputs.image_grid_thw
    assert grid.tolist() == [[1, 4, 4], [1, 8, 4]]  # 64x64 -> 2x2 tokens, 56x112 (w x h) -> 4x2
    assert inputs.ids.count(pad) == 4 + 8 and inputs.pixel_values.shape == (16 + 32, 3 * 2 * 14 * 14)
    # as the data plane carries them: flattened, the grid as float; back in the model's shapes exactly
    fields = {k: v.float() for k, v in inputs.fields().items()}
    assert set(fields) == {PIXEL_VALUES, IMAGE_GRID} and all(v.dim() == 1 for v in fields.values())
    back = model_inputs(fields)
    assert back is not None
    assert torch.equal(back[0], inputs.pixel_values) and torch.equal(back[1], grid) and back[1].dtype == torch.long
    assert model_inputs({"prompt": torch.tensor([1])}) is None
    model = load_model(cfg, tok, seed=0)
    ids = torch.tensor([inputs.ids])
    out = model(input_ids=ids, pixel_values=back[0], image_grid_thw=back[1], mm_token_type_ids=(ids == pad).long())
    assert torch.isfinite(out.logits).all()
    with pytest.raises(ValueError, match="prompt has 1 image placeholder"):
        prompt_inputs(proc, "<image>", [RED, BLUE])


def test_every_dedupe_by_prompt_keys_on_the_images_too() -> None:
    from rlbatch.data.images import PromptEncoder, images_key
    from rlbatch.engines.batch import distinct_prompts

    ids = [[1, 2, 3]] * 4
    keys = [images_key([RED]), images_key([BLUE]), images_key([RED]), b""]
    firsts, group = distinct_prompts(ids, keys)
    assert firsts == [0, 1, 3] and group.tolist() == [0, 1, 0, 2]
    assert distinct_prompts(ids)[0] == [0]  # text alone: one prompt
    made: list[int] = []

    def processor() -> Any:
        from rlbatch.engines.model import load_processor, load_tokenizer

        made.append(1)
        cfg = ModelConfig(arch="qwen2_vl")
        return load_processor(cfg, load_tokenizer(cfg))

    from rlbatch.engines.model import load_tokenizer

    enc = PromptEncoder(load_tokenizer(ModelConfig(arch="qwen2_vl")), processor)
    blue = _png((0, 0, 255))  # the red image's size: the same ids
    got = enc.encode(["<image>a", "<image>a", "<image>a", "1+1"], [[RED], [blue], [RED], []])
    assert got[0][0] == got[1][0] and got[0][1] is got[2][1]  # equal ids; the red prompt encoded once
    assert not torch.equal(got[0][1][PIXEL_VALUES], got[1][1][PIXEL_VALUES]) and got[3][1] == {}
    assert enc.encode(["1+1"]) == [got[3]] and made == [1]
