"""tools/bench/vs_trl.py's arithmetic bound: the FLOPs of a step's log-prob and training passes,
counted by hand, and the ceiling it puts on any framework's speedup over TRL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbatch.models.shape import shape_from_hf_config
from tools.bench import vs_trl

CONFIG = {"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "tie_word_embeddings": True}
SETTINGS = {"prompts_per_step": 2, "samples_per_prompt": 2, "mini_batches": 2, "epochs": 1, "kl_coef": 0.01}


def by_hand(tokens: float, settings: dict[str, float]) -> float:
    # matmul weights of a layer: q 8x8, k and v 8x4, o 8x8, gate/up/down 3 x 8x16, Qwen2's q/k/v
    # biases 8 + 4 + 4; the lm head 10x8 (tied to the embedding: still a matmul)
    n = 2 * (64 + 32 + 32 + 64 + 3 * 128 + 16) + 80
    ctx = tokens / 4 / 2  # half the mean sequence length of the 4 samples
    forward = tokens * (2 * n + 4 * 2 * 2 * 4 * ctx)  # 4 * layers * heads * head_dim * ctx
    old = (settings["mini_batches"] - 1) / settings["mini_batches"]
    return forward * ((1 if settings["kl_coef"] > 0 else 0) + old + 3)


@pytest.mark.parametrize("changes", [{}, {"kl_coef": 0.0}, {"mini_batches": 1}, {"mini_batches": 4, "kl_coef": 0.0}])
def test_step_flops_counts_reference_old_and_training_passes(changes: dict[str, float]) -> None:
    s = SETTINGS | changes
    shape = shape_from_hf_config(CONFIG)
    assert vs_trl.step_flops(shape, s, 40.0) == pytest.approx(by_hand(40.0, s), rel=1e-12)


def test_ceiling_is_the_fastest_generation_plus_the_least_arithmetic_at_peak(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.setattr("rlbatch.plan.measure.matmul_flops", lambda threads: {64: 1e6, 256: 2e6})
    def run(name: str, gen: float, busy: float, gen_tokens: float, prompt: float | None) -> dict:
        return {"name": name, "samples_per_s": 4 / (gen + busy), "gen_tokens_per_step": gen_tokens,
                "prompt_tokens_per_step": prompt, "phase_median_s": {"generate": gen, "logprobs": busy / 2, "train": busy / 2}}
    results = [run("TRL GRPOTrainer", 1.0, 4.0, 24.0, None), run("rlbatch 2 ranks", 1.5, 2.0, 20.0, 16.0)]
    a = vs_trl.arithmetic(SETTINGS, tmp_path, results, threads=2)
    assert a["peak_gflop_per_s"] == pytest.approx(4e-3)  # 2 threads x the best single-thread matmul
    trl, ours = by_hand(16 + 24, SETTINGS), by_hand(16 + 20, SETTINGS)  # TRL's prompts are rlbatch's
    assert a["runs"]["TRL GRPOTrainer"]["gflop_per_s"] == pytest.approx(trl / 4.0 / 1e9)
    assert a["runs"]["rlbatch 2 ranks"]["gflop_per_s"] == pytest.approx(ours / 2.0 / 1e9)
    floor = 1.0 + ours / 4e6  # TRL's generate phase, rlbatch's smaller arithmetic at peak
    assert a["floor_step_s"] == pytest.approx(floor)
    assert a["ceiling"] == pytest.approx((4 / floor) / (4 / 5.0))
