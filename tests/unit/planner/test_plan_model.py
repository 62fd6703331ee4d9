"""Parameter, FLOP and KV-cache counts against published model sizes."""

from __future__ import annotations

import pytest
from conftest import MODELS

from rlbatch.models.shape import shape_from_config, shape_from_hf_config


def test_llama2_7b_has_its_published_parameter_count() -> None:
    # Llama 2 7B: 6,738,415,616 parameters (what transformers' num_parameters() reports for
    # meta-llama/Llama-2-7b-hf; the paper rounds it to 7B).
    assert shape_from_config({"path": str(MODELS / "llama2_7b")}).params == 6_738_415_616


@pytest.mark.parametrize(("name", "total", "non_embedding"), [
    # Qwen2.5 model cards: "Number of Parameters: 7.61B; Number of Paramaters (Non-Embedding): 6.53B"
    # and "72.7B; 70.0B".
    ("qwen2_5_7b", 7.61e9, 6.53e9),
    ("qwen2_5_72b", 72.7e9, 70.0e9),
])
def test_qwen2_5_counts_match_model_cards(name: str, total: float, non_embedding: float) -> None:
    s = shape_from_config({"path": str(MODELS / name)})
    assert s.params == pytest.approx(total, rel=0.001)
    # The cards round the non-embedding count (72B: 70.21B computed, "70.0B" printed).
    assert s.params - 2 * s.embedding_params == pytest.approx(non_embedding, rel=0.005)


def test_moe_total_and_active_parameters_match_the_model_card() -> None:
    # Qwen1.5-MoE-A2.7B card: "14.3B parameters in total and 2.7B activated parameters during runtime".
    s = shape_from_config({"path": str(MODELS / "qwen1_5_moe_a2_7b")})
    assert s.params == pytest.approx(14.3e9, rel=0.002)
    assert s.active_params == pytest.approx(2.7e9, rel=0.01)


def test_kv_cache_per_token_of_qwen2_5_7b() -> None:
    # 2 (K, V) x 28 layers x 4 KV heads x 128 head dim x 2 bytes = 57344 bytes = 56 KiB per token.
    s = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})
    assert s.kv_bytes_per_token(2) == 57344


def test_forward_flops_are_two_per_weight_plus_attention() -> None:
    s = shape_from_config({"path": str(MODELS / "llama2_7b")})
    matmul_weights = s.params - s.embedding_params - s.layers * 2 * s.hidden - s.hidden  # lm head stays
    assert s.fwd_flops_per_token(0) == 2 * matmul_weights
    assert s.fwd_flops_per_token(1000) - s.fwd_flops_per_token(0) == 4 * 32 * 32 * 128 * 1000


def test_train_flops_are_palms_6n_plus_12lhqt() -> None:
    s = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})
    layers, heads, head_dim = 28, 28, 128
    # Untied: the lm head is a matmul, the input embedding a lookup; norms are not matmuls.
    n = s.params - s.embedding_params - (2 * layers + 1) * s.hidden
    assert s.matmul_params == n
    assert s.train_flops_per_token(0) == 6 * n
    assert s.train_flops_per_token(4096) == 6 * n + 12 * layers * heads * head_dim * 4096
    assert s.train_flops_per_token(4096) == 3 * s.fwd_flops_per_token(4096)


def test_decode_read_bytes_are_the_weights_once_plus_the_kv_cache() -> None:
    s = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})
    weights = 2 * (s.params - s.embedding_params)  # bf16; the untied input embedding is only looked up
    assert s.decode_read_bytes(0, 0, 2) == weights
    assert s.decode_read_bytes(64, 1000, 2) == weights + 64 * 1000 * 57344


def test_missing_config_json_is_a_config_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rlbatch.errors import ConfigError

    with pytest.raises(ConfigError, match="config.json"):
        shape_from_config({"path": str(tmp_path)})
    with pytest.raises(ConfigError, match="lacks"):
        shape_from_hf_config({"hidden_size": 8}, "broken")
