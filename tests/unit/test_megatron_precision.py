"""The megatron engine's precision. fp32 main weights (``megatron_optim.MainWeights``) for bf16
parameters: at an RL learning rate (1e-6) AdamW applied to bf16 weights changes nearly nothing
(the update is below half a bf16 step of any weight above ~2.6e-4), while the main weights move
exactly as fp32 AdamW on the same gradients, accumulated over micro-batches in fp32, and the model
holds them rounded. Training in fp16 is refused before anything starts."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from rlbatch import ConfigError
from rlbatch.checks.validate import check
from rlbatch.config.schema import RLBatchConfig
from rlbatch.engines.megatron.optim import MainWeights

LR, WD, STEPS = 1e-6, 0.01, 3


def _model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A bf16 model and the fp32 weights it was rounded from (not representable in bf16)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    exact = {n: torch.randn(p.shape, generator=g) * 0.5 for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(exact[n])
    return model.bfloat16(), exact


def _micro_batches(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(8, 16, generator=g).bfloat16() for _ in range(2)]


def test_bf16_adamw_rounds_the_updates_of_all_but_the_smallest_weights_away_at_rl_learning_rates() -> None:
    """An AdamW update is about lr; a bf16 weight w in [2^e, 2^(e+1)) moves in steps of 2^(e-7), so an
    update under half of that, 2^(e-8), rounds back: every |w| >= 2^10 lr (4x margin) stays put."""
    model, _ = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    for step in range(STEPS):
        opt.zero_grad()
        for x in _micro_batches(step):
            model(x).square().mean().backward()
        opt.step()
    large = torch.cat([(b.abs() >= 2**10 * LR).flatten() for b in before])
    unchanged = torch.cat([(a == b).flatten() for a, b in zip(before, model.parameters(), strict=True)])
    assert bool(unchanged[large].all()) and float(large.float().mean()) > 0.99


def test_main_weights_step_as_fp32_adamw_on_fp32_accumulated_gradients() -> None:
    model, exact = _model()
    twin = copy.deepcopy(model)  # the same bf16 model, whose gradients the reference reads
    main = MainWeights(model.named_parameters(), exact)
    opt = torch.optim.AdamW(list(main.of.values()), lr=LR, weight_decay=WD, foreach=True)
    ref = {n: exact[n].clone().requires_grad_() for n in exact}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=LR, weight_decay=WD, foreach=True)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad()
        for x in _micro_batches(step):
            model(x).square().mean().backward()
            twin.zero_grad()
            twin(x).square().mean().backward()
            for n, p in twin.named_parameters():  # each micro-batch's bf16 gradient, summed in fp32
                ref[n].grad = p.grad.float() if ref[n].grad is None else ref[n].grad + p.grad.float()
        assert all(p.grad is None for p in model.parameters()), "bf16 gradients are dropped once accumulated"
        opt.step()
        main.to_model()
        ref_opt.step()
        with torch.no_grad():
            for t, p in zip(twin.parameters(), model.parameters(), strict=True):
                t.copy_(p)
    for n, p in model.named_parameters():
        m = main.of[p]
        assert m.dtype == torch.float32 and torch.equal(m, ref[n]), n  # fp32 AdamW, bit for bit
        assert torch.equal(p, m.bfloat16()), n  # the model holds them rounded to nearest
        moved = (m - exact[n]).detach().abs()
        assert float(moved.max()) <= STEPS * LR * 1.01 + WD * LR * STEPS * float(exact[n].abs().max())
        assert float(moved.mean()) > STEPS * LR / 2, (n, float(moved.mean()))  # every element moved ~lr per step


def test_fp32_parameters_are_their_own_main_weights() -> None:
    model = torch.nn.Linear(3, 2)
    main = MainWeights(model.named_parameters(), {})
    assert all(main.of[p] is p for p in model.parameters()) and main.copies() == []


@pytest.mark.usefixtures("megatron_runs_here")
def test_training_in_fp16_is_refused_before_start_and_a_forward_only_role_may_run_it(tmp_path: Path) -> None:
    c = dataclasses.asdict(RLBatchConfig())
    c["run_dir"] = str(tmp_path / "run")
    c["model"]["dtype"] = "fp16"
    c["roles"]["actor_train"]["backend"] = "megatron:d2"
    with pytest.raises(ConfigError) as e:
        check(c)
    assert e.value.problems == ["roles.actor_train.backend: the megatron engine trains in bf16 or fp32 (model.dtype), "
                                "got model.dtype=fp16: fp16 gradients need loss scaling, which it does not build"]
    c["roles"]["actor_train"]["backend"] = "fsdp:d2"
    c["roles"]["reference"]["backend"] = "megatron:d2"  # forward-only
    check(c)
    c["model"]["dtype"] = "bf16"
    c["roles"]["actor_train"]["backend"] = "megatron:d2"
    check(c)


def test_a_model_type_the_weight_mapping_does_not_know_is_refused_before_start(tmp_path: Path) -> None:
    import json

    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 32}))
    c = dataclasses.asdict(RLBatchConfig())
    c["run_dir"], c["model"]["path"] = str(tmp_path / "run"), str(model)
    c["roles"]["actor_train"]["backend"] = "megatron:d2"
    with pytest.raises(ConfigError) as e:
        check(c)
    assert ("roles.actor_train.backend: the megatron engine converts qwen2, llama, qwen2_moe models "
            "(rlbatch/engines/megatron/convert.py); model.path is a 'gemma' model; use fsdp or deepspeed for it"
            ) in e.value.problems, e.value.problems
    c["roles"]["actor_train"]["backend"] = "fsdp:d2"
    check(c)  # transformers builds it for fsdp
