"""``model.lora`` on a vision-language policy: adapters on the language model's modules only (the
vision tower never targeted), trained by the fsdp and deepspeed engines with images, synced merged
into the hf engine (which then scores as the trainer), and the adapter export loadable by PEFT on the
Qwen2-VL base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.schema import AlgoConfig, LoraConfig, ModelConfig
from rlbatch.engines.base import EngineContext
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.models import lora
from tests.unit.test_vlm_engines import _generated, _hf, _prompts, one_thread  # noqa: F401  (autouse)

TOWER = "model.visual."
TARGETS = ["q_proj", "down_proj", "qkv", "fc1"]
"""Names of the language model's linear layers and of the vision tower's (qkv, fc1): only the first get adapters."""


def _cfg(targets: list[str] | None = None) -> ModelConfig:
    return ModelConfig(arch="qwen2_vl", max_position_embeddings=256, initializer_range=0.1,
                       lora=LoraConfig(rank=4, alpha=8.0, target_modules=targets or ["all-linear"]))


def _ctx(mesh: Any, args: Any, cfg: ModelConfig) -> EngineContext:
    algo = AlgoConfig(lr=1e-2, kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=1)
    return EngineContext("actor_train", args, cfg, algo, load_tokenizer(cfg), torch.device("cpu"), 7, mesh, True)


def _fsdp(mesh: Any, cfg: ModelConfig) -> Any:
    from rlbatch.engines.fsdp import FSDPArgs
    from rlbatch.engines.fsdp.engine import FSDPEngine

    return FSDPEngine(_ctx(mesh, FSDPArgs(max_tokens_per_micro_batch=4096), cfg))


def _deepspeed(cfg: ModelConfig) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    from rlbatch.engines.deepspeed import DeepSpeedArgs
    from rlbatch.engines.deepspeed.engine import DeepSpeedEngine

    mesh = DeviceMesh("cpu", torch.arange(1).reshape(1, 1), mesh_dim_names=("dp", "tp"))
    return DeepSpeedEngine(_ctx(mesh, DeepSpeedArgs(zero_stage=2, max_tokens_per_micro_batch=4096), cfg))


def _merged(engine: Any) -> dict[str, torch.Tensor]:
    with engine.export_weights() as stream:
        return {n: t.clone() for unit in stream.units(None) for n, t in unit}


@pytest.mark.parametrize("targets", [None, TARGETS])
def test_adapters_go_on_the_language_model_only(targets: list[str] | None) -> None:
    cfg = _cfg(targets)
    adapted = lora.adapt(load_model(cfg, load_tokenizer(cfg), 1), cfg.lora)
    names = [n for n, _ in adapted.named_parameters() if lora.base_name(n) is None]
    assert names and all(".language_model." in n for n in names), [n for n in names if ".language_model." not in n][:3]
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == ({"q_proj", "down_proj"} if targets else
                                                                        {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"})


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("deepspeed", marks=pytest.mark.full)])
def test_a_lora_step_with_images_trains_adapters_only_and_its_merged_sync_scores_in_hf_as_the_trainer(
        one_rank_mesh: Any, engine: str) -> None:
    cfg = _cfg()
    hf = _hf()
    samples = [s | {"advantage": torch.tensor(a)} for s, a in zip(_generated(hf, _prompts(), 2),
                                                                    (1.0, -1.0, 0.5, -0.5, 1.0, -1.0), strict=True)]
    trainer = _fsdp(one_rank_mesh, cfg) if engine == "fsdp" else _deepspeed(cfg)
    module = trainer.model if engine == "fsdp" else trainer.module
    for s, a in zip(samples, trainer.logprobs(samples), strict=True):  # the adapted model starts as the base
        assert (a - s["behaviour"]).abs().max() <= 1e-5, (a, s["behaviour"])

    def params() -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in module.named_parameters()}

    before = params()
    trainer.train(samples, PolicyObjective(trainer.algo))
    after = params()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(lora.base_name(n) is None for n in changed), sorted(changed)[:3]  # the adapters only
    assert not any(TOWER in n for n in changed) and not any(TOWER in n and ".lora_" in n for n in after)
    assert {n for n, p in module.named_parameters() if p.requires_grad} == {n for n in after if ".lora_" in n}

    merged = _merged(trainer)  # the merged sync: the base model's names, the tower included
    assert set(merged) == {n for n, _ in hf.model.named_parameters()}
    assert any(TOWER in n for n in merged)
    hf.load_weights(merged.items())
    regenerated = _generated(hf, _prompts(), 1)
    for s, a in zip(regenerated, trainer.logprobs(regenerated), strict=True):
        assert (a - s["behaviour"]).abs().max() <= 1e-5, (a, s["behaviour"])
    if engine == "fsdp":  # the adapter-only stream: PEFT's names of the language model's adapters
        with trainer.export_adapters() as stream:
            adapters = [n for n, _ in stream.manifest]
        assert adapters and all(".language_model." in n and n.endswith(("lora_A.weight", "lora_B.weight"))
                                for n in adapters)


def test_a_response_holding_the_image_token_is_text_there_under_adapters(one_rank_mesh: Any) -> None:
    """As without adapters (tests/unit/test_vlm_engines.py): the image features go to the prompts'
    image tokens only, through PEFT's wrapper, packed or padded."""
    from rlbatch.engines.batch import vision_of
    from rlbatch.engines.fsdp import FSDPArgs
    from rlbatch.engines.fsdp.engine import FSDPEngine

    cfg = _cfg()
    packed = _fsdp(one_rank_mesh, cfg)
    padded = FSDPEngine(_ctx(one_rank_mesh, FSDPArgs(max_tokens_per_micro_batch=0), cfg))
    vision = vision_of(packed.model)
    assert vision is not None
    samples = [p | {"response": torch.tensor([5, vision.image_token_id, 7])} for p in _prompts()]
    for a, b in zip(packed.logprobs(samples), padded.logprobs(samples), strict=True):
        assert a.shape == (3,) and (a - b).abs().max() <= 1e-6, (a, b)


def test_a_vlm_adapter_export_loads_on_its_base_with_peft(one_rank_mesh: Any, tmp_path: Path) -> None:
    """What ``python -m rlbatch.export lora_as=adapter`` does with the checkpoint (its adapter branch:
    ``hf_export.load_weights`` of the trained tensors, ``adapter_base``, ``save_pretrained``), loaded
    back by PEFT on the saved Qwen2-VL base: the merge equals the trainer's merged sync."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from rlbatch.checkpoint.dcp import save_state
    from rlbatch.checkpoint.hf_export import adapter_base, load_weights

    cfg = _cfg()
    trainer = _fsdp(one_rank_mesh, cfg)
    samples = [s | {"advantage": torch.tensor(a)} for s, a in zip(_generated(_hf(), _prompts(), 1), (1.0, -1.0, 0.5),
                                                                    strict=True)]
    trainer.train(samples, PolicyObjective(trainer.algo))
    want = _merged(trainer)
    save_state(tmp_path / "ckpt", trainer.checkpoint_state())

    tok = load_tokenizer(cfg)
    base = load_model(cfg, tok, 7)
    out = tmp_path / "adapter"
    named = adapter_base(None, base, tok, out, "fp32")
    peft = lora.adapt(base, cfg.lora)
    assert load_weights(tmp_path / "ckpt", peft, only_trained=True) > 0
    peft.peft_config["default"].base_model_name_or_path = named
    peft.save_pretrained(str(out))

    loaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(named), str(out))
    got = dict(loaded.merge_and_unload().named_parameters())
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.allclose(got[n], t, atol=1e-6), n
    untrained = dict(load_model(cfg, tok, 7).named_parameters())
    assert any(not torch.equal(t, untrained[n]) for n, t in want.items())  # the adapters' update is in the export


def test_a_target_only_the_vision_tower_has_is_refused_before_start(cfg: dict[str, Any]) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    vlm = set_(cfg, model__arch="qwen2_vl", model__lora__rank=8)
    check(set_(vlm, model__lora__target_modules=["q_proj", "down_proj"]))
    found = problems(set_(vlm, model__lora__target_modules=["q_proj", "qkv"]))
    assert any(p.startswith("model.lora.target_modules: ['qkv'] name no linear layer of the language model")
               for p in found), found


def test_the_names_of_a_vlm_directory_on_meta_are_the_image_text_models(tmp_path: Path) -> None:
    """What the vLLM engine expects of a model directory's weights and adapters (``meta_model``)."""
    from rlbatch.engines.inference import hf_parameter_names, meta_model

    cfg = ModelConfig(arch="qwen2_vl")
    model = load_model(cfg, load_tokenizer(cfg), 1)
    model.config.save_pretrained(tmp_path)
    on_disk = ModelConfig(path=str(tmp_path))
    assert hf_parameter_names(on_disk) == {n for n, _ in model.named_parameters()}
    shapes = lora.adapter_shapes(meta_model(on_disk), _cfg().lora)
    assert shapes and all(".language_model." in n for n in shapes)
