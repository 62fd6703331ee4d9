"""The planner on vision-language models: the shapes of real Qwen2-VL / Qwen2.5-VL configs (flat as
their published config.json files, nested as transformers >= 5 saves them) against their published
sizes, image tokens as the processor resizes, the frozen tower in memory, and ``python -m
rlbatch.plan`` on the visual task."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbatch.data.shapes import COLOUR_QUESTION, COUNT_QUESTION
from rlbatch.models.shape import ModelShape, shape_from_hf_config, smart_resize
from rlbatch.models.spec import ModelSpec
from rlbatch.models.vlm import VisionSpec, build_tiny_vlm, vlm_config
from rlbatch.plan.__main__ import main
from tests.unit.chat_fixtures import chat_tokenizer


def qwen2_vl(hidden: int, ffn: int, heads: int, layers: int, kv: int, vocab: int, tied: bool) -> dict[str, Any]:
    """A Qwen2-VL config.json as published (transformers 4: the language model's fields on top)."""
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                              "hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}


def qwen2_5_vl(hidden: int, ffn: int, heads: int, layers: int, kv: int, vocab: int, tied: bool) -> dict[str, Any]:
    """A Qwen2.5-VL config.json as published."""
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 128000, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                              "num_heads": 16, "in_chans": 3, "out_hidden_size": hidden, "patch_size": 14,
                              "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                              "tokens_per_second": 2, "temporal_patch_size": 2}}


REAL = {  # name -> (config.json, published parameter count: the model cards' safetensors sizes)
    "Qwen2-VL-2B": (qwen2_vl(1536, 8960, 12, 28, 2, 151936, True), 2.21e9),
    "Qwen2-VL-7B": (qwen2_vl(3584, 18944, 28, 28, 4, 152064, False), 8.29e9),
    "Qwen2.5-VL-3B": (qwen2_5_vl(2048, 11008, 16, 36, 2, 151936, True), 3.75e9),
    "Qwen2.5-VL-7B": (qwen2_5_vl(3584, 18944, 28, 28, 4, 152064, False), 8.29e9),
}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """The same model as transformers >= 5 writes its config.json: the language model under text_config."""
    text = {k: v for k, v in flat.items() if k not in ("architectures", "vision_config", "tie_word_embeddings")}
    return {"architectures": flat["architectures"], "model_type": flat["model_type"], "text_config": text,
            "vision_config": flat["vision_config"], "tie_word_embeddings": flat["tie_word_embeddings"]}


@pytest.mark.parametrize("name", REAL)
def test_real_configs_count_their_published_sizes_flat_or_nested(name: str) -> None:
    config, published = REAL[name]
    shape = shape_from_hf_config(config, name)
    assert shape.tower is not None and shape.tower.arch == config["model_type"]
    assert abs(shape.params / published - 1) < 0.02, f"{name}: {shape.params / 1e9:.3f}B vs published {published / 1e9}B"
    # the vision tower: Qwen2-VL's paper gives 675M for its ViT (the merger's output width differs by size)
    assert 0.6e9 < shape.vision_params < 0.7e9
    assert shape_from_hf_config(nested(config), name) == shape
    text = shape_from_hf_config({k: v for k, v in config.items() if k != "vision_config"} | {"model_type": "qwen2"})
    assert shape.params == text.params + shape.vision_params  # the language model counts as the text model's
    assert shape.matmul_params == text.matmul_params  # image patches, not tokens, go through the tower


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_tiny_vlm_config_counts_exactly_what_transformers_builds(arch: str) -> None:
    tokenizer = chat_tokenizer()
    from rlbatch.models.vlm import add_vision_tokens

    add_vision_tokens(tokenizer)
    text = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=len(tokenizer), qkv_bias=True,
                     arch="qwen2")
    vision = VisionSpec(depth=3, hidden=32, heads=2, ffn=96, full_attention_blocks=(1,))
    with torch.device("meta"):
        model = build_tiny_vlm(text, vision, tokenizer, arch=arch)
    built = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    shape = shape_from_hf_config(vlm_config(text, vision, tokenizer, arch).to_dict())  # nested, as transformers 5 saves
    assert (shape.params, shape.vision_params) == (built, tower)
    assert shape.tower is not None and shape.tower.tensors == sum(1 for n, _ in model.named_parameters()
                                                                 if n.startswith("model.visual."))


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_the_planners_random_init_tower_is_the_one_the_engines_build(arch: str) -> None:
    """``model.arch`` of a VLM without a path: the tower the planner counts is the one ``load_model``
    builds (read back from the built model's config) with the resize bounds of ``load_processor``'s
    image processor, field for field, and counts the built tower's parameters."""
    from dataclasses import replace

    from rlbatch.config.schema import ModelConfig
    from rlbatch.engines.model import load_model, load_processor, load_tokenizer
    from rlbatch.models.shape import VisionShape, shape_from_config
    from rlbatch.models.spec import VisionTower, vision_from_hf_config

    cfg = ModelConfig(arch=arch)
    tokenizer = load_tokenizer(cfg)
    with torch.device("meta"):
        model = load_model(cfg, tokenizer, seed=0)
    built = vision_from_hf_config(model.config.to_dict(), load_processor(cfg, tokenizer).image_processor.to_dict())
    planned = shape_from_config(cfg, vocab=len(tokenizer)).tower
    assert built is not None and planned is not None

    def resolved(tower: VisionTower) -> VisionShape:  # None: the last block attends over the whole image
        blocks = tower.full_attention_blocks
        return VisionShape.of(replace(tower, full_attention_blocks=(tower.depth - 1,) if blocks is None else blocks), 0)

    assert resolved(planned) == resolved(built)
    assert planned.params == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))


def test_image_tokens_as_the_processor_resizes() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    shape = shape_from_hf_config(REAL["Qwen2-VL-7B"][0])
    assert shape.tower is not None
    tower = shape.tower
    assert tower.tokens(64, 64) == 4 and tower.tokens(448, 448) == 256 and tower.tokens(1080, 1920) == 2691
    assert tower.tokens(448, 448, max_pixels=224 * 224) == 64 and tower.tokens(20, 20, min_pixels=112 * 112) == 16
    tiny = VisionSpec()
    for h, w in [(64, 64), (10, 300), (300, 10), (57, 85), (1000, 1000), (224, 447), (29, 28)]:
        assert smart_resize(h, w, 28, tiny.min_pixels, tiny.max_pixels) == hf_resize(h, w, 28, tiny.min_pixels,
                                                                                      tiny.max_pixels)
        random_init = ModelShape.of(shape_from_hf_config(REAL["Qwen2-VL-2B"][0]))
        assert random_init.tower is not None
        assert random_init.tower.tokens(h, w, tiny.min_pixels, tiny.max_pixels) == tiny.tokens(h, w)


def test_the_windowed_tower_costs_less_attention() -> None:
    full = shape_from_hf_config(REAL["Qwen2-VL-7B"][0]).tower
    windowed = shape_from_hf_config(REAL["Qwen2.5-VL-7B"][0]).tower
    assert full is not None and windowed is not None
    small, large = 256, 4096  # patches of a 224x224 and of an 896x896 image
    # linear work is per patch (it cancels in f(large) - 16 f(small)); attention over all patches grows
    # with their square in all 32 Qwen2-VL blocks, in 4 of 32 Qwen2.5-VL blocks (the others attend
    # within windows of (112 / 14)^2 = 64 patches: linear too)
    excess = lambda t: t.fwd_flops(large) - 16 * t.fwd_flops(small)  # noqa: E731
    assert excess(full) == pytest.approx(4 * 1280 * 32 * (large**2 - 16 * small**2))
    assert excess(full) / excess(windowed) == pytest.approx(32 / 4)
    # an image smaller than a window: every block attends over all of it
    assert windowed.fwd_flops(16) - full.fwd_flops(16) == pytest.approx(
        2 * 16 * 32 * 1280 * (3 * 3420 - 2 * 5120), abs=1)  # the MLPs differ, the attention does not


def test_plan_prints_image_tokens_and_the_frozen_towers_share(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment=vlm_shapes", "hardware=cpu", "--json"]) == 0
    import json

    frozen = json.loads(capsys.readouterr().out)
    assert main(["experiment=vlm_shapes", "hardware=cpu"]) == 0
    out = capsys.readouterr().out
    assert "vision tower (qwen2_vl): 79.6K params" in out and "frozen" in out and "4 image tokens per prompt" in out
    assert main(["experiment=vlm_shapes", "hardware=cpu", "model.train_vision=true", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    state = lambda p: p["roles"]["actor_train"]["state"]  # noqa: E731
    tower = 79552  # VisionSpec()'s tower under a 64-wide decoder: test_tiny_vlm_config_counts_exactly_... checks the count
    assert state(trained)["optimizer"] - state(frozen)["optimizer"] == pytest.approx(8 * tower)
    assert state(trained)["params"] == state(frozen)["params"]
    assert state(trained)["grads"] - state(frozen)["grads"] == pytest.approx(4 * tower)
    text = max(len(q.removeprefix("<image>")) for q in (COLOUR_QUESTION, COUNT_QUESTION)) + 3  # chars, BOS, image's start, end
    assert frozen["workload"]["image_tokens"] == 4 and frozen["workload"]["prompt_len"] == text + 4
