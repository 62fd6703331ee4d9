"""check(cfg) refuses, before anything starts, every configuration this build cannot run, with one
line each naming the field, the numbers and what is supported; check(cfg, runnable=False) (the
planner's) keeps only what holds in any build.

Configs are plain dicts of the schema's defaults (no Hydra), so each case is one override away
from the default experiment, which runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbatch import ConfigError
from rlbatch.algos import registry as algos_registry
from rlbatch.checkpoint.store import CheckpointStore
from rlbatch.checks.validate import check
from rlbatch.engines import registry as engines_registry
from rlbatch.placement import backend as placement_backend
from tests.unit.configs import problems, set_


def on_ranks(cfg: dict[str, Any], n: int, train: str, infer: str) -> dict[str, Any]:
    """actor_train, actor_infer and reference colocated on GPU ranks [0, n)."""
    ranks = list(range(n))
    return set_(cfg, roles__actor_train={"device_mapping": ranks, "backend": train},
                roles__actor_infer={"device_mapping": ranks, "backend": infer},
                roles__reference={"device_mapping": ranks, "backend": ""})


def test_the_default_experiment_is_runnable(cfg: dict[str, Any]) -> None:
    assert set(check(cfg).roles) == {"actor_train", "actor_infer", "reference", "reward"}


def test_a_replicas_context_parallel_ranks_share_its_samples(cfg: dict[str, Any]) -> None:
    """The batch splits over the engine's data axes only: a replica's cp ranks receive the same
    samples (docs/fsdp.md), so 9 samples fit fsdp:d1c2 and not fsdp:d2."""
    odd = {"algo__prompts_per_step": 3, "algo__samples_per_prompt": 3, "algo__mini_batches": 1, "algo__grad_accum": 1}
    assert dict(check(set_(on_ranks(cfg, 2, "fsdp:d1c2", "hf:d2"), **odd)).roles["actor_train"].mesh)["cp"] == 2
    assert problems(set_(on_ranks(cfg, 2, "fsdp:d2", "hf:d2"), **odd)) == [
        "algo: a batch of prompts_per_step*samples_per_prompt = 9 samples cannot be split evenly into actor_train "
        "dp=2 x mini_batches=1 x grad_accum=1 = 2 parts"]


# ------------------------------------------------------------------------------------ engines


@pytest.mark.parametrize(
    ("train", "infer", "line"),
    [
        ("fsdp:d2", "sglang:d2", "roles.actor_infer.backend: engine 'sglang' (in 'sglang:d2') is not built: the "
                                 "SGLang engine is not in this build; built inference engines: ['hf', 'vllm']"),
    ],
)
def test_an_engine_that_is_not_built_is_refused_with_the_built_ones(cfg: dict[str, Any], train: str, infer: str,
                                                                   line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a build without the sglang engine: its registry entry without an implementation
    monkeypatch.setitem(engines_registry.REGISTRY, "sglang", dataclasses.replace(
        engines_registry.REGISTRY["sglang"], implementation=None, rules=None, note="the SGLang engine is not in this build"))
    c = on_ranks(cfg, 2, train, infer)
    assert problems(c) == [line]  # reference inherits actor_train's backend: reported once
    check(c, runnable=False)  # the planner models it


def test_deepspeed_is_runnable_and_its_engine_args_are_checked_before_start(cfg: dict[str, Any]) -> None:
    c = on_ranks(cfg, 2, "deepspeed:d2", "hf:d2")
    assert set(check(c).roles) == {"actor_train", "actor_infer", "reference", "reward"}
    c = set_(c, roles__actor_train__engine_args={"zero_stage": 4})
    assert problems(c) == ["roles.actor_train.engine_args.zero_stage: must be 1, 2 or 3, got 4"]
    c = set_(c, roles__actor_train__engine_args={"zero_stage": 2, "offload_params": True})
    assert problems(c) == ["roles.actor_train.engine_args.offload_params: needs zero_stage 3 (parameters are "
                           "partitioned only there), got zero_stage 2"]


def test_dims_the_built_engine_does_not_split_over_are_refused(cfg: dict[str, Any]) -> None:
    check(on_ranks(cfg, 4, "fsdp:d2t2", "hf:d4"))  # d, t (tensor) and c (context) are built, alone or together
    check(on_ranks(cfg, 4, "fsdp:d2c2", "hf:d4"))
    check(set_(on_ranks(cfg, 8, "fsdp:d2c2t2", "hf:d8"), algo__prompts_per_step=16))
    assert problems(on_ranks(cfg, 4, "fsdp:d2p2", "hf:d4"))[0] == (
        "roles.actor_train.backend: engine 'fsdp' does not accept 'p' (pipeline parallel) in 'fsdp:d2p2'; it accepts "
        "d, t, c")


def test_a_role_given_an_engine_of_the_wrong_kind_is_refused(cfg: dict[str, Any]) -> None:
    assert problems(on_ranks(cfg, 2, "fsdp:d2", "fsdp:d2")) == [
        "roles.actor_infer.backend: 'fsdp:d2' names a training engine, but actor_infer runs generate, which needs "
        "an inference engine; built: ['hf', 'sglang', 'vllm']"]
    assert problems(on_ranks(cfg, 2, "hf:d2", "hf:d2")) == [
        "roles.actor_train.backend: 'hf:d2' names an inference engine, but actor_train runs logprobs and train, "
        f"which needs a training engine; built: {engines_registry.built_engines(engines_registry.EngineKind.TRAIN)}"]


CP_BUILT_FOR = "is built for padded rows of a dense model on one pipeline stage with torch AdamW, not with "


@pytest.mark.usefixtures("megatron_runs_here")
def test_the_hybrid_megatron_layout_runs_and_what_its_sections_cannot_split_is_named_with_the_numbers(
        cfg: dict[str, Any]) -> None:
    moe = set_(cfg, model__arch="qwen2_moe")  # 4 routed experts, 2 kv heads
    for spec in ("megatron:(attn:d2t2|ffn:t2e2)", "megatron:(attn:d2t2|ffn:e4)", "megatron:(attn:d4|ffn:t2e2)",
                 "megatron:(attn:t2|ffn:e2)", "megatron:(attn:d2p2|ffn:p2e2)"):
        n = placement_backend.parse_backend(spec).world_size
        check(on_ranks(moe, n, spec, f"hf:d{n}"))
    c = on_ranks(cfg, 4, "megatron:(attn:d2t2|ffn:e4)", "hf:d4")
    assert problems(c) == [
        "roles.actor_train.backend: 'megatron:(attn:d2t2|ffn:e4)' lays out routed experts in its ffn section (t=1, "
        "e=4), but the model has none (a dense qwen2); a hybrid layout needs a Mixture-of-Experts model, e.g. "
        "model.arch=qwen2_moe, or write one mesh, e.g. 'megatron:d2t2'"]
    assert problems(set_(on_ranks(moe, 4, "megatron:(attn:d2t2|ffn:t2e2)", "hf:d4"), model__num_experts=5,
                         model__moe_intermediate_size=63)) == [
        "roles.actor_train.backend: 'megatron:(attn:d2t2|ffn:t2e2)' splits the model's 5 routed experts over the "
        "ffn section's expert-parallel ranks e=2, but num_experts=5 is not divisible by 2",
        "roles.actor_train.backend: 'megatron:(attn:d2t2|ffn:t2e2)' splits the model's routed experts over the ffn "
        "section's expert tensor-parallel ranks t=2, but moe_intermediate_size=63 is not divisible by 2"]
    assert problems(set_(on_ranks(moe, 4, "megatron:(attn:d2t2|ffn:e4)", "hf:d4"),
                         roles__actor_train__engine_args={"sequence_parallel": False, "distributed_optimizer": True})) == [
        "roles.actor_train.backend: 'megatron:(attn:d2t2|ffn:e4)' trains a Mixture-of-Experts model under tensor "
        "parallelism t=2 (the attn section's), which megatron-core does with sequence parallelism only; leave "
        "engine_args.sequence_parallel true",
        "roles.actor_train.backend: engine_args.distributed_optimizer with a hybrid layout is not built; leave it false"]
    # attention's splits are checked on the attn section, the routed experts' on the ffn section
    assert problems(on_ranks(moe, 4, "megatron:(attn:t4|ffn:e4)", "hf:d4")) == [
        "roles.actor_train.backend: 'megatron:(attn:t4|ffn:e4)' splits the model's attention over tensor-parallel "
        "ranks t=4, but num_kv_heads=2 is not divisible by 4"]
    # context parallelism is built for one pipeline stage of a dense model: refused before start, with the reason
    c = on_ranks(moe, 32, "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", "hf:d32")
    assert problems(c) == [
        "roles.actor_train.backend: 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)': context parallelism c=2 " + CP_BUILT_FOR
        + "pipeline stages (p=2) or a hybrid (attn:...|ffn:...) layout; leave c=1 for those"]


@pytest.mark.usefixtures("megatron_runs_here")
def test_megatron_expert_parallelism_needs_a_mixture_of_experts_model_and_refuses_what_is_not_built(
        cfg: dict[str, Any]) -> None:
    moe = set_(cfg, model__arch="qwen2_moe")  # 4 routed experts
    check(on_ranks(moe, 4, "megatron:d4e2", "hf:d4"))
    check(on_ranks(moe, 4, "megatron:d2p2e2", "hf:d4"))
    assert problems(on_ranks(cfg, 2, "megatron:d2e2", "hf:d2")) == [
        "roles.actor_train.backend: 'megatron:d2e2' splits the model's routed experts over expert-parallel ranks "
        "e=2, but the model has none (a dense qwen2); expert parallelism needs a Mixture-of-Experts model, e.g. "
        "model.arch=qwen2_moe"]
    assert problems(set_(on_ranks(moe, 4, "megatron:d4e4", "hf:d4"), model__num_experts=6)) == [
        "roles.actor_train.backend: 'megatron:d4e4' splits the model's 6 routed experts over expert-parallel ranks "
        "e=4, but num_experts=6 is not divisible by 4"]
    check(set_(on_ranks(moe, 2, "megatron:d2", "hf:d2"), roles__reference__backend="megatron:t2"))  # forward-only
    check(on_ranks(moe, 4, "megatron:d2t2", "hf:d4"))  # sequence parallel by default
    assert problems(on_ranks(moe, 4, "megatron:d2t2e2", "hf:d4")) == [
        "roles.actor_train.backend: 'megatron:d2t2e2' combines expert parallelism e=2 with tensor parallelism t=2, "
        "which the megatron engine does not build on one mesh; use t=1 with e (or t without e), or a hybrid layout, "
        "e.g. 'megatron:(attn:d2t2|ffn:t2e2)'"]
    assert problems(set_(on_ranks(moe, 2, "megatron:t2", "hf:d2"), model__moe_intermediate_size=63)) == [
        "roles.actor_train.backend: 'megatron:t2' splits the model's routed experts over tensor-parallel ranks "
        "t=2, but moe_intermediate_size=63 is not divisible by 2"]
    assert problems(set_(on_ranks(moe, 4, "megatron:d2t2", "hf:d4"),
                         roles__actor_train__engine_args={"sequence_parallel": False})) == [
        "roles.actor_train.backend: 'megatron:d2t2' trains a Mixture-of-Experts model under tensor parallelism t=2, "
        "which megatron-core does with sequence parallelism only; leave engine_args.sequence_parallel true"]
    assert problems(set_(on_ranks(moe, 2, "megatron:d2e2", "hf:d2"),
                         roles__actor_train__engine_args={"distributed_optimizer": True})) == [
        "roles.actor_train.backend: engine_args.distributed_optimizer with expert parallelism e=2 is not built; "
        "leave it false"]


@pytest.mark.usefixtures("megatron_runs_here")
def test_megatron_runs_tensor_pipeline_data_and_context_parallel_and_names_what_context_parallelism_is_not_built_for(
        cfg: dict[str, Any]) -> None:
    assert set(check(on_ranks(cfg, 2, "megatron:t2", "hf:d2")).roles) >= {"actor_train", "reference"}
    assert check(on_ranks(cfg, 4, "megatron:d2t2", "hf:d4")).roles["actor_train"].mesh == (
        ("pp", 1), ("dp", 2), ("cp", 1), ("tp", 2))
    assert check(on_ranks(cfg, 4, "megatron:d2p2", "hf:d4")).roles["actor_train"].mesh == (
        ("pp", 2), ("dp", 2), ("cp", 1), ("tp", 1))
    assert check(on_ranks(cfg, 4, "megatron:t2c2", "hf:d4")).roles["actor_train"].mesh == (
        ("pp", 1), ("dp", 1), ("cp", 2), ("tp", 2))
    check(on_ranks(cfg, 4, "megatron:c4", "hf:d4"))  # 4 heads over 4 ranks; the 2 key/value heads repeated
    assert problems(on_ranks(cfg, 8, "megatron:d2p2c2", "hf:d8")) == [
        "roles.actor_train.backend: 'megatron:d2p2c2': context parallelism c=2 " + CP_BUILT_FOR
        + "pipeline stages (p=2); leave c=1 for those"]
    assert problems(set_(on_ranks(cfg, 2, "megatron:c2", "hf:d2"), roles__actor_train__engine_args={
        "distributed_optimizer": True, "pack_rows": True, "max_tokens_per_micro_batch": 64})) == [
        "roles.actor_train.backend: 'megatron:c2': context parallelism c=2 " + CP_BUILT_FOR
        + "packed rows (engine_args.pack_rows) or engine_args.distributed_optimizer; leave c=1 for those"]
    assert problems(set_(on_ranks(cfg, 8, "megatron:t2c4", "hf:d8"), model__num_heads=6, model__hidden_size=96)) == [
        "roles.actor_train.backend: 'megatron:t2c4' splits each tensor-parallel rank's 3 attention heads "
        "(num_heads=6 over t=2) over context-parallel ranks c=4, but 3 is not divisible by 4"]


@pytest.mark.usefixtures("megatron_runs_here")
def test_megatron_splits_that_do_not_divide_are_refused_with_the_numbers(cfg: dict[str, Any]) -> None:
    c = set_(on_ranks(cfg, 4, "megatron:p4", "hf:d4"), model__num_layers=6)
    assert problems(c) == [
        "roles.actor_train.backend: 'megatron:p4' splits the model's layers over pipeline stages p=4, but "
        "num_layers=6 is not divisible by 4"]
    check(set_(c, model__num_layers=8, roles__actor_train__engine_args={"distributed_optimizer": True}))
    # the tiny model: 4 heads, 2 kv heads, intermediate 256
    assert problems(on_ranks(cfg, 4, "megatron:t4", "hf:d4")) == [
        "roles.actor_train.backend: 'megatron:t4' splits the model's attention over tensor-parallel ranks t=4, but "
        "num_kv_heads=2 is not divisible by 4"]


def test_engine_args_are_read_by_the_engines_typed_arguments(cfg: dict[str, Any]) -> None:
    c = set_(cfg, roles__actor_train__engine_args={"micro_batchez": 4},
             roles__actor_infer__engine_args={"max_batch": "many"},
             roles__reference__engine_args={"share_prompts": False})  # reference inherits fsdp: accepted
    expected = [
        "roles.actor_train.engine_args: unknown key(s) ['micro_batchez'] for engine 'fsdp'; it accepts "
        "['max_tokens_per_micro_batch', 'micro_batch', 'share_prompts', 'single_unit_max_mb', 'sync_bucket_mb']",
        "roles.actor_infer.engine_args.max_batch: expected int, got str 'many'",
    ]
    assert problems(c) == expected
    assert problems(c, runnable=False) == expected  # a typo is a typo in any build


def test_engine_args_of_an_engine_that_is_not_built_are_still_typed(cfg: dict[str, Any]) -> None:
    c = set_(on_ranks(cfg, 2, "fsdp:d2", "sglang:d2"), roles__actor_infer__engine_args={"gpu_mem": 0.5})
    assert problems(c, runnable=False) == [
        "roles.actor_infer.engine_args: unknown key(s) ['gpu_mem'] for engine 'sglang'; it accepts "
        "['dtype', 'kv_cache_tokens', 'max_model_len', 'max_num_batched_tokens', 'max_num_seqs', "
        "'mem_fraction_static']"]


def test_tensor_parallel_sglang_is_refused_where_its_heads_or_gpus_do_not_split(cfg: dict[str, Any]) -> None:
    """On GPUs (no sgl_kernel needed): t must split the model's heads as vLLM's rule says, and a
    worker's engine takes the first rank's GPU and the t - 1 after it on that node."""
    gpu = set_(cfg, cluster__device="cuda")
    check(on_ranks(gpu, 2, "fsdp:d2", "sglang:d1t2"))
    assert [p for p in problems(on_ranks(gpu, 3, "fsdp:d3", "sglang:d1t3")) if "sglang" in p] == [
        "roles.actor_infer.backend: 'sglang:t3' splits attention over t=3 tensor-parallel ranks, but num_heads=4 is "
        "not divisible by t=3; SGLang accepts t in [1, 2, 4] for this model (num_heads=4, num_kv_heads=2)"]
    spread = set_(gpu, roles__actor_infer={"device_mapping": [0, 2], "backend": "sglang:d1t2"})
    assert [p for p in problems(spread) if "sglang" in p] == [
        "roles.actor_infer.backend: 'sglang:t2': a worker's engine runs its 2 tensor-parallel ranks on the first "
        "rank's GPU and the 1 after it on that node, but this worker has node 0 GPU 0, node 0 GPU 2; list each "
        "worker's GPUs consecutively in roles.actor_infer.device_mapping"]


# ---------------------------------------------------------------------------------- algorithm


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        ("advantage", "vtrace", "algo.advantage: 'vtrace' is not a registered advantage estimator; registered: "
                                "['dr_grpo', 'gae', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo']"),
        ("policy_loss", "cispo", "algo.policy_loss: 'cispo' is not a registered policy loss; registered: "
                                 "['gspo', 'ppo_clip']"),
        ("kl_estimator", "k9", "algo.kl_estimator: 'k9' is not a registered KL estimator; registered: "
                               "['abs', 'k1', 'k2', 'k3']"),
        ("loss_agg", "seq-mean", "algo.loss_agg: 'seq-mean' is not a registered loss aggregation; registered: "
                                 "['seq', 'seq_sum', 'token']"),
        ("loss_agg", 3, "algo.loss_agg: expected the name of a loss aggregation, got int 3"),
    ],
)
def test_algorithm_parts_come_from_the_registries(cfg: dict[str, Any], field: str, value: Any, line: str) -> None:
    assert problems(set_(cfg, **{f"algo__{field}": value})) == [line]
    assert problems(set_(cfg, **{f"algo__{field}": value}), runnable=False) == [line]


def test_every_registered_kl_estimator_is_accepted(cfg: dict[str, Any]) -> None:
    for name in algos_registry.KL_ESTIMATORS.names():
        check(set_(cfg, algo__kl_estimator=name))


PROGRAMS = "['dapo', 'dr_grpo', 'grpo', 'gspo', 'ppo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo']"


def ppo(cfg: dict[str, Any], **dotted: Any) -> dict[str, Any]:
    """PPO as conf/algo/ppo.yaml sets it up: the critic on actor_train's GPUs and backend."""
    base = {"algo__name": "ppo", "algo__advantage": "gae", "algo__kl_in_reward": True, "algo__kl_estimator": "k1",
            "roles__critic": {"enabled": True, "device_mapping": None, "backend": ""}}
    return set_(cfg, **(base | dotted))


def test_ppo_runs_with_a_critic_and_refuses_what_it_cannot_run(cfg: dict[str, Any]) -> None:
    check(ppo(cfg))
    check(ppo(cfg, roles__critic={"enabled": True, "device_mapping": [2], "backend": "deepspeed:d1"}))
    assert problems(set_(cfg, algo__name="dpo")) == [
        f"algo.name: 'dpo' is not a registered algorithm (program); registered: {PROGRAMS}"]
    assert problems(ppo(cfg, roles__critic={"enabled": False})) == [
        "roles.critic: algo.name=ppo needs the critic role; enable it (roles.critic.enabled=true; it runs on "
        "actor_train's GPUs unless given a device_mapping)"]
    assert problems(ppo(cfg, algo__advantage="grpo", algo__dynamic_sampling=True)) == [
        "algo.advantage: algo.name=ppo trains a critic for a value-based estimator (['gae']), got 'grpo'",
        "algo.dynamic_sampling: DAPO's dynamic sampling runs in the critic-free loop, not in algo.name=ppo's; "
        "set algo.dynamic_sampling=false"]
    assert problems(set_(cfg, algo__advantage="gae")) == [
        "algo.advantage: gae reads the critic's values, which only ['ppo'] compute; use algo=ppo, or a "
        "critic-free estimator with algo.name=grpo"]
    assert problems(ppo(cfg, algo__lam=1.5, algo__value_clip=-0.1, algo__critic_lr=0, algo__critic_warmup_steps=-1)) == [
        "algo.lam: must be in [0, 1] (GAE's lambda), got 1.5",
        "algo.value_clip: must be >= 0 (0 disables value clipping), got -0.1",
        "algo.critic_lr: must be > 0 (a learning rate; null: algo.lr), got 0",
        "algo.critic_warmup_steps: must be >= 0, got -1"]
    assert problems(ppo(cfg, steps=5, algo__critic_warmup_steps=5)) == [
        "algo.critic_warmup_steps: 5 warm-up steps train only the critic, and the run has steps=5: the actor "
        "would never train"]


@pytest.mark.usefixtures("megatron_runs_here")
def test_a_critic_inherits_megatron_and_an_engine_without_a_value_head_is_refused(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    c = ppo(cfg, roles__actor_train={"device_mapping": [0, 1], "backend": "megatron:t2"})
    assert str(check(c).roles["critic"].backend) == "megatron:t2"
    # An engine that builds only the policy's head (a plugin, say) is refused for the critic by name.
    monkeypatch.setitem(engines_registry.REGISTRY, "megatron",
                        dataclasses.replace(engines_registry.REGISTRY["megatron"], heads=("lm",)))
    assert problems(c) == [
        "roles.critic.backend: 'megatron:t2' (inherited from actor_train): the megatron engine has no value head "
        "in this build; give the critic backend 'fsdp:dN' or 'deepspeed:dN'"]
    check(set_(c, roles__critic={"enabled": True, "device_mapping": [0, 1], "backend": "fsdp:d2"}))


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_advantages_need_two_samples_per_prompt(cfg: dict[str, Any], advantage: str) -> None:
    assert problems(set_(cfg, algo__advantage=advantage, algo__samples_per_prompt=1)) == [
        f"algo.samples_per_prompt: algo.advantage={advantage} compares each sample with the others of its "
        "prompt's group, so it needs at least 2 samples per prompt, got 1"]


def test_reinforce_pp_runs_with_one_sample_per_prompt(cfg: dict[str, Any]) -> None:
    check(set_(cfg, algo__advantage="reinforce_pp", algo__samples_per_prompt=1))


def test_dynamic_sampling_needs_groups_and_a_round(cfg: dict[str, Any]) -> None:
    c = set_(cfg, algo__advantage="reinforce_pp", algo__dynamic_sampling=True)
    assert problems(set_(c, algo__samples_per_prompt=1, algo__max_sampling_rounds=0)) == [
        "algo.samples_per_prompt: algo.dynamic_sampling keeps groups whose rewards differ, so it needs at least "
        "2 samples per prompt, got 1",
        "algo.max_sampling_rounds: dynamic sampling needs a cap of at least one generation round per step, got 0"]
    check(set_(c, algo__max_sampling_rounds=1))
    check(set_(c, algo__dynamic_sampling=False, algo__max_sampling_rounds=0))  # unused without dynamic sampling


@pytest.mark.parametrize(("args", "line"), [
    (["algo=dapo", "algo.max_sampling_rounds=0"],
     "algo.max_sampling_rounds: dynamic sampling needs a cap of at least one generation round per step, got 0"),
    (["algo=rloo", "algo.samples_per_prompt=1"],
     "algo.samples_per_prompt: algo.advantage=rloo compares each sample with the others of its prompt's group, so "
     "it needs at least 2 samples per prompt, got 1"),
    (["algo=reinforce_pp_baseline", "algo.samples_per_prompt=1"],
     "algo.samples_per_prompt: algo.advantage=reinforce_pp_baseline compares each sample with the others of its "
     "prompt's group, so it needs at least 2 samples per prompt, got 1"),
])
def test_the_launcher_refuses_family_presets_before_anything_starts(
        args: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlbatch.launch.__main__ import main

    assert main(["dry_run=true", f"run_dir={tmp_path / 'run'}", *args]) == 2
    out, err = capsys.readouterr()
    assert "rlbatch placement" not in out and f"  - {line}" in err.splitlines(), err


def test_overlong_buffer_and_gamma_are_checked(cfg: dict[str, Any]) -> None:
    assert problems(set_(cfg, algo__max_new_tokens=8, algo__overlong_buffer=9, algo__gamma=0.0)) == [
        "algo.gamma: must be in (0, 1] (a discount), got 0.0",
        "algo.overlong_buffer: 9 tokens is longer than algo.max_new_tokens = 8; the shaping buffer must fit "
        "inside the longest response"]
    assert problems(set_(cfg, algo__overlong_buffer=-1)) == ["algo.overlong_buffer: must be >= 0, got -1"]
    check(set_(cfg, algo__max_new_tokens=8, algo__overlong_buffer=8, algo__gamma=0.99))


def test_a_critic_that_nothing_uses_is_refused(cfg: dict[str, Any]) -> None:
    c = set_(cfg, roles__critic={"enabled": True, "device_mapping": [0, 1], "backend": ""})
    assert problems(c) == ["roles.critic: enabled, but algo.name=grpo does not use a critic (programs that do: "
                           "['ppo']); set roles.critic.enabled=false or algo=ppo"]


def test_training_needs_a_reward_role(cfg: dict[str, Any]) -> None:
    assert problems(set_(cfg, roles__reward__enabled=False)) == [
        "roles.reward: program=train scores every response with data.reward_fn on the reward role's CPU "
        "workers; enable it, e.g. roles.reward.world_size=1"]


# ------------------------------------------------------------------------------------ plugins


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for plugin modules; the registries they change are restored after."""
    path = tmp_path / "plugins"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    saved = (dict(engines_registry.REGISTRY), {r: dict(r._entries) for r in algos_registry.ALL})
    before = set(sys.modules)
    yield path
    engines_registry.REGISTRY.clear()
    engines_registry.REGISTRY.update(saved[0])
    for r, entries in saved[1].items():
        r._entries = entries
    for name in set(sys.modules) - before:
        if name.startswith("rlbatch_test_"):
            del sys.modules[name]


def test_plugin_names_are_module_names_never_code(cfg: dict[str, Any], plugin_dir: Path) -> None:
    bad = ["os; import shutil", "__import__('os')", "a..b", "", 3]
    lines = problems(set_(cfg, plugins=bad))
    assert lines == [f"plugins: {name!r} is not a Python module name (dotted identifiers, e.g. "
                     f"'mylab.rlbatch_plugin')" for name in bad]
    assert problems(set_(cfg, plugins="rlbatch_test_one")) == [
        "plugins: expected a list of module names, got str 'rlbatch_test_one'"]


def test_a_plugin_that_fails_to_import_is_one_line(cfg: dict[str, Any], plugin_dir: Path) -> None:
    (plugin_dir / "rlbatch_test_broken.py").write_text("raise RuntimeError('needs a licence server')\n")
    assert problems(set_(cfg, plugins=["rlbatch_test_missing", "rlbatch_test_broken"])) == [
        "plugins: importing 'rlbatch_test_missing' failed: ModuleNotFoundError: No module named 'rlbatch_test_missing'",
        "plugins: importing 'rlbatch_test_broken' failed: RuntimeError: needs a licence server",
    ]


def test_a_plugin_that_exits_at_import_is_refused_by_name(cfg: dict[str, Any], plugin_dir: Path) -> None:
    """A plugin that parses the command line at import exits with its own usage text: the launch
    refuses it by name instead, with what it printed."""
    (plugin_dir / "rlbatch_test_cli.py").write_text(
        "import argparse\nargparse.ArgumentParser(prog='lab-tool').parse_args(['--bogus'])\n")
    (plugin_dir / "rlbatch_test_quit.py").write_text("import sys\nsys.exit(0)\n")
    assert problems(set_(cfg, plugins=["rlbatch_test_cli", "rlbatch_test_quit"])) == [
        "plugins: importing 'rlbatch_test_cli' exited (SystemExit 2) instead of registering what it provides; "
        "it printed: usage: lab-tool [-h] lab-tool: error: unrecognized arguments: --bogus",
        "plugins: importing 'rlbatch_test_quit' exited (SystemExit 0) instead of registering what it provides",
    ]


def test_a_plugin_registers_an_engine_and_an_algorithm_part_before_validation(cfg: dict[str, Any],
                                                                              plugin_dir: Path) -> None:
    (plugin_dir / "rlbatch_test_toy.py").write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "from rlbatch.algos.registry import ADVANTAGES\n"
        "from rlbatch.engines.registry import EngineSpec, register\n"
        "from rlbatch.engines.registry import EngineKind\n"
        "@dataclass(frozen=True)\n"
        "class ToyArgs:\n"
        "    beams: int = 1\n"
        "register(EngineSpec('toy', EngineKind.INFER, ToyArgs, 'rlbatch_test_toy:Toy', dims='dt'))\n"
        "ADVANTAGES.register('rloo', 'rlbatch_test_toy:rloo')\n"
    )
    c = set_(on_ranks(cfg, 4, "fsdp:d4", "toy:d2t2"), algo__advantage="rloo", roles__actor_infer__engine_args={"beams": 4})
    with pytest.raises(ConfigError, match="unknown engine 'toy'"):
        check(c)
    check(set_(c, plugins=["rlbatch_test_toy"]))
    assert problems(set_(c, plugins=["rlbatch_test_toy"], roles__actor_infer__engine_args={"beams": "4"})) == [
        "roles.actor_infer.engine_args.beams: expected int, got str '4'"]


# ----------------------------------------------------------------------- what the run will read


def test_a_missing_model_directory_is_refused_unless_only_the_nodes_see_it(cfg: dict[str, Any], tmp_path: Path) -> None:
    hint = ("give a local Hugging Face model directory (nothing is downloaded), or set model.check_path=false if "
            "only the compute nodes see it")
    assert problems(set_(cfg, model__path="/nonexistent/model")) == [
        f"model.path: /nonexistent/model does not exist on this machine; {hint}"]
    (tmp_path / "model").mkdir()
    assert problems(set_(cfg, model__path=str(tmp_path / "model"))) == [
        f"model.path: {tmp_path / 'model'} has no config.json, so it is not a Hugging Face model directory; {hint}"]
    (tmp_path / "model" / "config.json").write_text("{}")
    check(set_(cfg, model__path=str(tmp_path / "model")))
    check(set_(cfg, model__path="/nonexistent/model", model__check_path=False))
    check(set_(cfg, model__path="/nonexistent/model"), runnable=False)


def test_a_missing_dataset_is_refused_unless_only_the_nodes_see_it(cfg: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    c = set_(cfg, model__path=str(tmp_path / "model"), data__name="file", data__path=str(tmp_path / "train.jsonl"))
    assert problems(c) == [f"data.path: {tmp_path / 'train.jsonl'} does not exist on this machine; set "
                           f"data.check_path=false if only the compute nodes see it"]
    check(set_(c, data__check_path=False))
    (tmp_path / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    check(c)
    assert problems(set_(c, data__path=str(tmp_path / "train.csv"))) == [
        f"data.path: {tmp_path / 'train.csv'} is not a .jsonl, .json or .parquet file"]


@pytest.mark.parametrize(
    ("fn", "line"),
    [
        ("nosuch.module:fn", "data.reward_fn: reward function 'nosuch.module:fn': cannot import module "
                             "'nosuch.module': No module named 'nosuch'"),
        ("rlbatch.rewards.rules:nope", "data.reward_fn: reward function 'rlbatch.rewards.rules:nope': module "
                                       "'rlbatch.rewards.rules' has no attribute 'nope'"),
        ("rlbatch.rewards.rules:STOP_MARKERS", "data.reward_fn: reward function 'rlbatch.rewards.rules:STOP_MARKERS' "
                                               "is a tuple, not a callable"),
        ("exact_match", "data.reward_fn: reward function path 'exact_match' must look like 'package.module:function' "
                        "or 'package.module.function'"),
    ],
)
def test_the_reward_function_is_resolved_before_anything_starts(cfg: dict[str, Any], fn: str, line: str) -> None:
    assert problems(set_(cfg, data__reward_fn=fn)) == [line]
    check(set_(cfg, data__reward_fn=fn), runnable=False)


def test_a_reward_module_that_fails_while_importing_is_one_line(cfg: dict[str, Any], plugin_dir: Path) -> None:
    (plugin_dir / "rlbatch_test_reward.py").write_text("1/0\n")
    assert problems(set_(cfg, data__reward_fn="rlbatch_test_reward:score")) == [
        "data.reward_fn: importing 'rlbatch_test_reward:score' failed: ZeroDivisionError: division by zero"]


def test_resume_is_auto_never_or_a_checkpoint_that_exists(cfg: dict[str, Any], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = Path(cfg["run_dir"])
    assert problems(set_(cfg, resume="yes")) == [
        f"resume: 'yes' is not 'auto', 'never' or an existing checkpoint path (neither {tmp_path / 'yes'} nor "
        f"{run / 'checkpoints' / 'yes'} exists)"]
    assert problems(set_(cfg, resume="/nonexistent/ckpt")) == [
        "resume: '/nonexistent/ckpt' is not 'auto', 'never' or an existing checkpoint path (/nonexistent/ckpt does "
        "not exist)"]
    (tmp_path / "empty").mkdir()
    (line,) = problems(set_(cfg, resume=str(tmp_path / "empty")))
    assert line.startswith(f"resume: {tmp_path / 'empty'}: no complete checkpoint in {tmp_path / 'empty'}")
    store = CheckpointStore(run / "checkpoints")
    (store.begin(12) / "state.bin").write_bytes(b"x")
    store.commit(12)
    for resume in ("auto", "never", "step_000012", str(run / "checkpoints" / "step_000012"), str(run)):
        check(set_(cfg, resume=resume))
    check(set_(cfg, resume="yes"), runnable=False)


# ------------------------------------------------------------------------------ run directory


@pytest.mark.parametrize("root", ["/tmp", "/var/tmp", "/dev/shm"])
def test_a_slurm_run_directory_the_nodes_cannot_see_is_refused(cfg: dict[str, Any], root: str) -> None:
    c = set_(cfg, cluster__name="slurm", run_dir=f"{root}/runs/a")
    assert problems(c) == [
        f"run_dir: {root}/runs/a is under {root}, which every node has its own of: the job's nodes would not see "
        f"the config, placement and logs written there; put run_dir on a filesystem every node sees (home, "
        f"project or scratch)"]
    assert problems(set_(c, program="selftest")) == problems(c)  # selftest ranks read the run directory too
    check(set_(c, cluster__name="local"))
    check(c, runnable=False)


def test_a_relative_run_directory_is_judged_where_it_resolves(cfg: dict[str, Any], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # pytest's tmp_path is under /tmp
    (line,) = problems(set_(cfg, cluster__name="slurm", run_dir="runs/a"))
    assert line.startswith(f"run_dir: {tmp_path / 'runs' / 'a'} is under /tmp")


# -------------------------------------------------------------------------------------- whole


def test_selftest_starts_no_engine_so_only_the_placement_and_run_directory_count(cfg: dict[str, Any]) -> None:
    c = set_(on_ranks(cfg, 4, "fsdp:t2c2", "vllm:d2p2"), program="selftest", model__path="/nonexistent/model",
             data__reward_fn="nosuch.module:fn", resume="yes", roles__reward__enabled=False)
    check(c)
    assert len(problems(set_(c, program="train"))) == 4


def test_every_problem_is_reported_at_once(cfg: dict[str, Any]) -> None:
    c = set_(on_ranks(cfg, 4, "fsdp:t2c2", "vllm:d2p2"), algo__loss_agg="mean", model__path="/nonexistent/model",
             data__reward_fn="nosuch.module:fn", resume="yes", plugins=["rlbatch_test_missing"], cluster__name="slurm",
             run_dir="/tmp/runs/a", roles__actor_train__engine_args={"bogus": 1})
    fields = [line.split(":", 1)[0] for line in problems(c)]
    assert sorted(fields) == sorted(["plugins", "algo.loss_agg", "roles.actor_train.engine_args",
                                     "roles.actor_infer.backend", "model.path", "data.reward_fn", "resume", "run_dir"])


def test_a_head_split_the_model_builder_cannot_make_is_refused_before_launch() -> None:
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check(compose(["model.num_heads=3"]))
    assert any("model.hidden_size 64" in p and "num_heads 3" in p for p in e.value.problems), e.value.problems


@pytest.mark.usefixtures("megatron_runs_here")
def test_a_reward_model_on_gpus_is_checked_before_anything_starts(cfg: dict[str, Any], tmp_path: Path) -> None:
    gpu = set_(cfg, roles__reward={"device_mapping": [0, 1], "backend": "fsdp:d2"})
    check(gpu)
    check(set_(gpu, roles__reward={"device_mapping": [0, 1], "backend": "deepspeed:d2"}))
    assert problems(set_(gpu, reward_model__model_weight=0, reward_model__rule_weight=0)) == [
        "reward_model: model_weight and rule_weight are both 0 ({'model_weight': 0, 'rule_weight': 0}): nothing "
        "would score the responses"]
    assert problems(set_(gpu, reward_model__rule_weight=-1)) == [
        "reward_model.rule_weight: must be >= 0, got -1"]
    assert problems(set_(gpu, roles__reward={"device_mapping": [0, 1], "backend": "hf:d2"}))[0].startswith(
        "roles.reward.backend: 'hf:d2' names an inference engine, but reward runs score, which needs a training engine")
    check(set_(gpu, roles__reward={"device_mapping": [0, 1], "backend": "megatron:t2"}))
    missing = str(tmp_path / "no-rm")
    assert problems(set_(gpu, reward_model__path=missing)) == [
        f"reward_model.path: {missing} does not exist on this machine; give a local Hugging Face model directory "
        "(nothing is downloaded), or set reward_model.check_path=false if only the compute nodes see it"]
    assert problems(set_(cfg, reward_model__path=missing, reward_model__check_path=False)) == [
        f"reward_model.path: {missing} is set, but roles.reward scores with data.reward_fn on CPU workers; give "
        "roles.reward a device_mapping and a backend (e.g. 'fsdp:d2') to run the model"]


def test_a_critic_directory_needs_a_critic_and_must_exist(cfg: dict[str, Any], tmp_path: Path) -> None:
    missing = str(tmp_path / "no-critic")
    assert problems(set_(cfg, critic_model__path=missing, critic_model__check_path=False)) == [
        f"critic_model.path: {missing} is set, but no critic runs (algo.name=grpo); use algo=ppo, or leave "
        "critic_model.path unset"]
    assert problems(ppo(cfg, critic_model__path=missing)) == [
        f"critic_model.path: {missing} does not exist on this machine; give a local Hugging Face model directory "
        "(nothing is downloaded), or set critic_model.check_path=false if only the compute nodes see it"]
    (tmp_path / "critic").mkdir()
    (tmp_path / "critic" / "config.json").write_text("{}")
    check(ppo(cfg, critic_model__path=str(tmp_path / "critic")))


def test_the_token_budget_is_unset_by_default_and_typed_when_set(cfg: dict[str, Any]) -> None:
    """engine_args.max_tokens_per_micro_batch: unset (or null) is the device's default, packed on a
    GPU and padded on the CPU; set, an int of at least 0."""
    from rlbatch.engines.defaults import GPU_MAX_TOKENS_PER_MICRO_BATCH, max_tokens_per_micro_batch
    from rlbatch.engines.registry import engine_args
    from rlbatch.placement.backend import parse_backend
    from rlbatch.plan.layout import RoleLayout

    for raw, cuda, cpu in (({}, GPU_MAX_TOKENS_PER_MICRO_BATCH, 0), ({"max_tokens_per_micro_batch": None},
                           GPU_MAX_TOKENS_PER_MICRO_BATCH, 0), ({"max_tokens_per_micro_batch": 0}, 0, 0),
                           ({"max_tokens_per_micro_batch": 4096}, 4096, 4096)):
        for engine in ("fsdp", "deepspeed"):
            args = engine_args(engine, raw)
            assert (max_tokens_per_micro_batch(args, "cuda"), max_tokens_per_micro_batch(args, "cpu")) == (cuda, cpu)
            planned = RoleLayout("actor_train", parse_backend(f"{engine}:d1"), [0], engine_args=raw)
            assert max_tokens_per_micro_batch(planned.args, "cuda") == cuda  # the planner types them alike
    assert max_tokens_per_micro_batch(engine_args("hf", {}), "cuda") == 0  # an engine without budgets
    assert problems(set_(cfg, roles__actor_train__engine_args={"max_tokens_per_micro_batch": "lots"})) == [
        "roles.actor_train.engine_args.max_tokens_per_micro_batch: expected int | None, got str 'lots'"]
    assert problems(set_(cfg, roles__actor_train__engine_args={"max_tokens_per_micro_batch": -1})) == [
        "roles.actor_train.engine_args.max_tokens_per_micro_batch: must be >= 0, got -1"]
