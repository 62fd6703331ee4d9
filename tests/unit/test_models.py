"""The model description (rlbatch.models.spec) and the random-init builder (rlbatch.models.tiny):
the model the engines build is the model the planner counts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbatch.config.schema import ModelConfig
from rlbatch.data.tokenizer import build_char_tokenizer
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.errors import ConfigError
from rlbatch.models.shape import ModelShape, shape_from_config
from rlbatch.models.spec import ModelSpec, spec_from_config, spec_from_hf_config
from rlbatch.models.tiny import build_tiny_model

# Random-init configs: the default, both archs, tied and untied, MHA, GQA and MQA.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "qwen2-moe": {"arch": "qwen2_moe"},
    "llama-untied": {"arch": "llama", "tie_word_embeddings": False},
    "qwen2-untied-mqa": {"arch": "qwen2", "tie_word_embeddings": False, "num_kv_heads": 1},
    "llama-tied-mha": {"arch": "llama", "num_heads": 8, "num_kv_heads": 8},
    "qwen2-gqa-3-layers": {"hidden_size": 96, "num_heads": 6, "num_kv_heads": 2, "intermediate_size": 200,
                           "num_layers": 3, "max_position_embeddings": 512},
}


def _built(model: torch.nn.Module) -> tuple[int, int]:
    params = list(model.parameters())  # a tied lm head is the embedding Parameter: counted once
    return sum(p.numel() for p in params), len(params)


@pytest.mark.parametrize("name", CONFIGS)
def test_built_model_has_the_planners_parameter_count(name: str) -> None:
    cfg = ModelConfig(**CONFIGS[name])
    tok = load_tokenizer(cfg)
    with torch.device("meta"):  # the engines' build path; the counts need no weights
        model = load_model(cfg, tok, seed=0)
    shape = shape_from_config(CONFIGS[name])  # what `python -m rlbatch.plan` counts for this config
    assert _built(model) == (shape.params, shape.tensors)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                                      "qwen2_moe": "Qwen2MoeForCausalLM"}[cfg.arch]


def test_attention_biases_are_counted_as_the_builder_makes_them() -> None:
    # Qwen2: q/k/v biases only; a Llama with attention_bias: q/k/v/o; a plain Llama: none.
    qwen2, llama = spec_from_config({}), spec_from_config({"arch": "llama"})
    specs = [qwen2, llama, replace(llama, qkv_bias=True, o_bias=True)]
    counts = [ModelShape.of(s).params for s in specs]
    for spec, count in zip(specs, counts, strict=True):
        with torch.device("meta"):
            assert _built(build_tiny_model(spec)) == (count, ModelShape.of(spec).tensors)
    q, kv = 64, 2 * 16
    assert counts[0] - counts[1] == 2 * (q + 2 * kv)
    assert counts[2] - counts[1] == 2 * (q + 2 * kv + 64)


def test_the_default_model_is_the_documented_one() -> None:
    shape = shape_from_config({})
    assert (shape.arch, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == ("qwen2", 64, 2, 4, 2, 16)
    assert shape.tied and shape.qkv_bias and not shape.o_bias
    assert shape.max_positions == ModelConfig().max_position_embeddings
    assert shape.initializer_range == ModelConfig().initializer_range
    assert shape.params == 124_608  # what the planner has always reported for the default experiment


@pytest.mark.parametrize("name", CONFIGS)
def test_spec_from_the_config_and_from_the_saved_config_json_agree(name: str, tmp_path: Path) -> None:
    cfg = ModelConfig(**CONFIGS[name], initializer_range=0.1)
    model = load_model(cfg, load_tokenizer(cfg), seed=1)
    model.save_pretrained(tmp_path)
    from_config = spec_from_config(vars(cfg))
    from_json = spec_from_config({"path": str(tmp_path)})
    assert from_json == from_config  # every field but the name: arch, sizes, biases, rope, eps, init
    assert from_json.name == tmp_path.name and from_config.name.startswith(cfg.arch)
    assert spec_from_hf_config(json.loads((tmp_path / "config.json").read_text())) == from_config
    assert spec_from_hf_config(model.config.to_dict()) == from_config


def test_random_init_vocabulary_is_the_tokenizers() -> None:
    tok = build_char_tokenizer()
    assert spec_from_config({}).vocab == len(tok) == 18
    model = load_model(ModelConfig(), tok, seed=0)
    assert model.get_input_embeddings().weight.shape == (len(tok), 64)
    ids = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == ids
    gen = model.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == ids
    assert torch.all(model.get_input_embeddings().weight[tok.pad_token_id] == 0)  # the pad row starts at zero
    # Another tokenizer (another alphabet): the model and the plan follow its size.
    tok26 = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
    with torch.device("meta"):
        big = load_model(ModelConfig(), tok26, seed=0)
    assert big.get_input_embeddings().weight.shape[0] == len(tok26) == shape_from_config({}, vocab=len(tok26)).vocab


def test_the_description_needs_neither_torch_nor_transformers() -> None:
    code = ("import sys; from rlbatch.models.spec import spec_from_config; s = spec_from_config({}); "
            "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]; "
            "print(s.vocab, heavy)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["18", "[]"]


def test_rope_theta_is_read_from_old_and_new_config_json() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 32}
    assert spec_from_hf_config(base).rope_theta == 10000.0
    assert spec_from_hf_config({**base, "rope_theta": 1e6}).rope_theta == 1e6  # transformers 4
    assert spec_from_hf_config({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}).rope_theta == 5e5
    spec = replace(spec_from_config({"arch": "llama"}), rope_theta=5e5, norm_eps=1e-5)
    with torch.device("meta"):
        model = build_tiny_model(spec)
    assert spec_from_hf_config(model.config.to_dict()) == spec


def test_bad_head_split_is_a_config_error_naming_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"model.hidden_size 64 .* model.num_heads 3"):
        spec_from_config({"hidden_size": 64, "num_heads": 3})
    with pytest.raises(ConfigError, match=r"model.num_heads 4 .* model.num_kv_heads 3"):
        load_model(ModelConfig(num_kv_heads=3), build_char_tokenizer(), seed=0)


def test_the_builder_refuses_what_it_cannot_make() -> None:
    moe = spec_from_hf_config(json.loads((Path(__file__).parent / "planner/models/qwen1_5_moe_a2_7b/config.json").read_text()))
    assert isinstance(moe, ModelSpec) and moe.experts == 60
    for spec, why in [(replace(spec_from_config({}), experts=4, experts_per_token=2, moe_ffn=8), "arch qwen2_moe"),
                      (replace(moe, experts=0), "arch qwen2_moe"),
                      (replace(spec_from_config({}), gated=False), "SwiGLU"),
                      (replace(spec_from_config({}), qkv_bias=False), "q/k/v biases"),
                      (replace(spec_from_config({"arch": "llama"}), qkv_bias=True), "all of q/k/v/o")]:
        with pytest.raises(ValueError, match=why):
            build_tiny_model(spec)


def test_a_random_init_mixture_of_experts_model_is_a_qwen2_moe_of_the_configs_shape() -> None:
    spec = spec_from_config({"arch": "qwen2_moe", "num_experts": 6, "num_experts_per_token": 3,
                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})
    model = build_tiny_model(spec, seed=1)
    c = model.config
    assert type(model).__name__ == "Qwen2MoeForCausalLM" and c.qkv_bias and not c.norm_topk_prob
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        6, 3, 32, 48)
    assert c.decoder_sparse_step == 1 and not c.mlp_only_layers  # every layer sparse
    assert model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].shape == (6, 64, spec.hidden)
    assert spec_from_hf_config(c.to_dict(), name=spec.name) == spec  # the planner counts the model that runs
    with pytest.raises(ConfigError, match="num_experts_per_token 5 must be between 1 and model.num_experts 4"):
        spec_from_config({"arch": "qwen2_moe", "num_experts_per_token": 5})


# ---------------------------------------------------------------- the builder


def test_tiny_model_is_seeded_and_leaves_global_rng_alone() -> None:
    spec = spec_from_config({})
    torch.manual_seed(123)
    before = torch.get_rng_state()
    m1 = build_tiny_model(spec, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    m2 = build_tiny_model(spec, seed=1)
    m3 = build_tiny_model(spec, seed=2)
    w1, w2, w3 = (m.state_dict()["model.embed_tokens.weight"] for m in (m1, m2, m3))
    assert torch.equal(w1, w2)
    assert not torch.equal(w1, w3)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_generates_and_stops_at_eos(arch: str) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(spec_from_config({"arch": arch, "initializer_range": 0.1}), tokenizer=tok).eval()
    enc = tok(["3+4=", "12*3="] * 100, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, top_k=0, max_new_tokens=6)
    new = out[:, enc["input_ids"].shape[1] :]
    stopped = 0
    for row in new.tolist():
        if tok.eos_token_id in row[:-1]:
            stopped += 1
            after = row[row.index(tok.eos_token_id) + 1 :]
            assert set(after) == {tok.pad_token_id}, row  # nothing is generated after EOS
    assert stopped > 0  # a random policy over 18 tokens emits EOS early in some of 200 rows
