"""The megatron engine on real megatron-core, 2 ranks with gloo on CPU (the test-only shim
``tests/plugins/megatron_cpu.py`` is imported by the scripts; docs/megatron.md)."""

from __future__ import annotations

import pytest

from tests.dist.test_mechanisms import mpirun

pytestmark = pytest.mark.dist


def test_megatron_engine_converts_exactly_matches_transformers_resumes_bitwise_and_shares_checkpoints_with_fsdp() -> None:
    out = mpirun("megatron_engine.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron engine ok") == 2, out.stdout[-2000:]


@pytest.mark.full  # ~23 s alone, 80 s on a loaded machine; token budgets on the critic and reward model too
def test_megatron_value_and_reward_heads_match_transformers_train_like_fsdp_and_share_checkpoints() -> None:
    out = mpirun("megatron_heads.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron heads ok") == 2, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_distributed_optimizer_halves_adam_state_trains_like_adamw_and_resumes_bitwise() -> None:
    out = mpirun("megatron_distopt.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron distributed optimizer ok") == 2, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_pipeline_stages_match_one_stage_train_alike_resume_bitwise_and_share_checkpoints() -> None:
    out = mpirun("megatron_pp.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron pipeline ok") == 2, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_mixture_of_experts_with_expert_parallelism_matches_transformers_and_trains_like_fsdp() -> None:
    out = mpirun("megatron_moe.py", 2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron moe ok") == 2, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_pipeline_stages_with_data_parallelism_and_the_distributed_optimizer_train_like_one_stage_and_token_budgets_like_one_pass(
) -> None:
    out = mpirun("megatron_pp_dp.py", 4)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron pipeline with data parallelism ok") == 4, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_hybrid_attn_ffn_layouts_export_exactly_and_train_like_one_mesh() -> None:
    out = mpirun("megatron_hybrid.py", 4)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron hybrid ok") == 4, out.stdout[-2000:]


@pytest.mark.full
def test_megatron_context_parallelism_matches_data_parallelism_resumes_bitwise_and_shares_checkpoints() -> None:
    out = mpirun("megatron_cp.py", 4)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("megatron context parallelism ok") == 4, out.stdout[-2000:]
