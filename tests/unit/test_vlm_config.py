"""A vision-language policy from the config: ``model.arch=qwen2_vl|qwen2_5_vl`` random-initialised, a
saved Qwen2-VL directory loaded by its model_type, the vision tower frozen unless
``model.train_vision``, and what is not built refused by name before start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbatch.config.schema import AlgoConfig, ModelConfig
from rlbatch.engines.model import load_model, load_processor, load_tokenizer, model_skeleton
from rlbatch.models.vlm import VISION_TOKENS, VLM_ARCHS


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_a_random_init_vlm_comes_from_model_arch(arch: str) -> None:
    cfg = ModelConfig(arch=arch)
    tok = load_tokenizer(cfg)
    assert all(t in tok.get_vocab() for t in VISION_TOKENS)
    model = load_model(cfg, tok, seed=3)
    assert type(model).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[arch]
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.") for n in names)
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    from rlbatch.models.spec import spec_from_model_config, vlm_arch

    assert vlm_arch(cfg) == arch and spec_from_model_config(cfg).vocab == len(tok)  # what the planner counts
    # the skeleton a sharded engine fills holds the same tensors as the whole model
    sk = model_skeleton(cfg, tok, seed=3)
    sk.materialise(torch.device("cpu"))
    got = dict(sk.model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p), n
    proc = load_processor(cfg, tok)
    assert proc.tokenizer is tok


def test_a_saved_vlm_directory_loads_by_its_model_type(tmp_path: Path) -> None:
    # AutoModelForCausalLM refuses Qwen2-VL's config: the engine must choose the image-text-to-text class
    base = ModelConfig(arch="qwen2_vl")
    tok = load_tokenizer(base)
    model = load_model(base, tok, seed=1)
    model.save_pretrained(tmp_path)
    proc = load_processor(base, tok)
    proc.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    proc.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    loaded = load_model(cfg, load_tokenizer(cfg), seed=0)
    assert type(loaded) is type(model)
    want = model.state_dict()
    for n, t in loaded.state_dict().items():
        assert torch.equal(t, want[n]), n
    assert type(load_processor(cfg, load_tokenizer(cfg))).__name__ == "ImageTextProcessor"


def _fsdp(mesh: Any, train_vision: bool) -> Any:
    from rlbatch.engines.base import EngineContext
    from rlbatch.engines.fsdp import FSDPArgs
    from rlbatch.engines.fsdp.engine import FSDPEngine

    cfg = ModelConfig(arch="qwen2_vl", train_vision=train_vision)
    algo = AlgoConfig(lr=1e-2, kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=1)
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(), cfg, algo, load_tokenizer(cfg), torch.device("cpu"), 7,
                                    mesh, True))


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_tower_is_frozen_unless_model_train_vision(one_rank_mesh: Any, train_vision: bool) -> None:
    engine = _fsdp(one_rank_mesh, train_vision)
    params = dict(engine.model.named_parameters())
    tower = {n for n in params if n.startswith("model.visual.")}
    assert tower and all(params[n].requires_grad == train_vision for n in tower)
    assert all(p.requires_grad for n, p in params.items() if n not in tower)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert {n for n, p in params.items() if id(p) in in_optimizer} == set(params) - (set() if train_vision else tower)


def test_what_is_not_built_for_a_vlm_is_refused_by_name(cfg: dict[str, Any]) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    vlm = set_(cfg, model__arch="qwen2_vl")
    check(vlm)
    check(set_(vlm, model__train_vision=True))
    check(set_(vlm, roles__actor_train__backend="deepspeed:d2"))
    found = problems(set_(vlm, roles__actor_train__backend="megatron:d2"))
    assert any(p.startswith("roles.actor_train.backend: megatron: model model.arch=qwen2_vl is a vision-language "
                            "model (qwen2_vl), and the megatron engine does not run") and "no Qwen2-VL weight mapping" in p
               for p in found), found
    found = problems(set_(vlm, roles__actor_infer__backend="sglang:d2"))
    assert any(p.startswith("roles.actor_infer.backend: sglang:") for p in found), found
    found = problems(set_(vlm, roles__actor_train__backend="fsdp:d1c2"))
    assert any("context parallelism c = 2" in p for p in found), found
    found = problems(set_(vlm, roles__actor_train__backend="fsdp:d1t2"))
    assert any("tensor parallelism t = 2" in p for p in found), found
    check(set_(vlm, model__lora__rank=8))  # adapters on the language model, synced merged into hf
    check(set_(vlm, model__lora__rank=8, roles__actor_train__backend="deepspeed:d2"))
    found = problems(set_(vlm, model__lora__rank=8, model__train_vision=True))
    assert any(p.startswith("model.train_vision: true with model.lora.rank 8: model model.arch=qwen2_vl is a "
                            "vision-language model") for p in found), found
    vllm = set_(vlm, roles__actor_infer__backend="vllm:d2", model__num_heads=2, model__num_kv_heads=1)
    check(set_(vllm, model__lora__rank=8, model__lora__sync="merged"))
    found = problems(set_(vllm, model__lora__rank=8))  # auto: adapters, into vLLM
    assert any(p.startswith("model.lora.sync: auto: adapter-only syncs into the vllm engine of roles.actor_infer "
                            "with model model.arch=qwen2_vl") for p in found), found
    assert any("model.arch: 'qwen3_vl' is not one of" in p for p in problems(set_(cfg, model__arch="qwen3_vl")))


def test_data_with_images_is_refused_for_a_text_policy_and_taken_by_a_vlm(cfg: dict[str, Any], tmp_path: Path) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    (tmp_path / "a.png").write_bytes(b"\x89PNG not read before start")
    (tmp_path / "d.jsonl").write_text('{"question": "<image>1+1=", "answer": "2", "images": ["a.png"]}\n'
                                      '{"question": "1+2=", "answer": "3"}\n')
    data = set_(cfg, data__name="file", data__path=str(tmp_path / "d.jsonl"))
    found = problems(data)
    assert any("1 of its 2 usable records carry images, and model model.arch=qwen2 is a text model" in p
               for p in found), found
    assert not [p for p in problems(set_(data, model__arch="qwen2_vl")) if "image" in p]

    shapes = set_(cfg, model__arch="qwen2_vl", data__name="vlm_shapes")
    check(shapes)
    assert any(p.startswith("data.name: vlm_shapes: its prompts carry images, and model model.arch=qwen2 is a text")
               for p in problems(set_(shapes, model__arch="qwen2")))
    found = problems(set_(shapes, algo__max_staleness=1))
    assert any(p.startswith("algo.max_staleness: 1: asynchronous training of a qwen2_vl policy") for p in found), found
