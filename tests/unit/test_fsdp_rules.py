"""The fsdp engine's tensor-parallel rules (``rlbatch.engines.fsdp.rules``), refused before start
with the field and the numbers: heads and KV heads that t does not divide, a Mixture-of-Experts
model, low-rank adapters."""

from __future__ import annotations

from typing import Any

from rlbatch.checks.validate import check
from tests.unit.configs import problems, set_


def fsdp_on(cfg: dict[str, Any], n: int, train: str, **dotted: Any) -> dict[str, Any]:
    """actor_train on ``train``, actor_infer (hf) and the reference (inheriting) on GPU ranks [0, n)."""
    ranks = list(range(n))
    return set_(cfg, roles__actor_train={"device_mapping": ranks, "backend": train},
                roles__actor_infer={"device_mapping": ranks, "backend": f"hf:d{n}"},
                roles__reference={"device_mapping": ranks, "backend": ""}, **dotted)


def test_tensor_parallel_fsdp_on_the_default_model_is_accepted(cfg: dict[str, Any]) -> None:
    assert check(fsdp_on(cfg, 2, "fsdp:d1t2")).roles["actor_train"].backend.dims.t == 2


def test_kv_heads_that_t_does_not_divide_are_refused_with_the_numbers(cfg: dict[str, Any]) -> None:
    # the default model: 4 heads, 2 KV heads; t=4 splits the heads but not the KV heads
    assert problems(fsdp_on(cfg, 4, "fsdp:d1t4")) == [
        "roles.actor_train.backend: 'fsdp:t4' splits the model's attention by heads over tensor-parallel ranks "
        "t=4, but num_kv_heads=2 is not divisible by 4"]


def test_heads_that_t_does_not_divide_are_refused_for_every_role_that_splits_them(cfg: dict[str, Any]) -> None:
    c = set_(fsdp_on(cfg, 2, "fsdp:d1t2", model__hidden_size=48, model__num_heads=3, model__num_kv_heads=3),
             roles__reference={"device_mapping": [0, 1], "backend": "fsdp:d1t2"})
    assert problems(c) == [
        f"roles.{role}.backend: 'fsdp:t2' splits the model's attention by heads over tensor-parallel ranks "
        f"t=2, but {name}=3 is not divisible by 2"
        for role in ("actor_train", "reference") for name in ("num_heads", "num_kv_heads")]


def test_adapters_under_tensor_parallelism_are_accepted_without_dropout(cfg: dict[str, Any]) -> None:
    check(fsdp_on(cfg, 2, "fsdp:d1t2", model__lora={"rank": 8}))
    c = fsdp_on(cfg, 2, "fsdp:d1t2", model__lora={"rank": 8, "dropout": 0.1})
    assert problems(c) == [
        "roles.actor_train.backend: 'fsdp:t2' with model.lora.dropout=0.1: under tensor parallelism (t=2) each rank "
        "of a column-split layer feeds the whole input to the adapter's A, which every rank holds whole; dropout "
        "would mask it differently on each rank and the copies of A would drift apart; use model.lora.dropout=0"]
    check(fsdp_on(cfg, 2, "fsdp:d2", model__lora={"rank": 8, "dropout": 0.1}))


def test_a_mixture_of_experts_model_under_tensor_parallelism_is_refused(cfg: dict[str, Any]) -> None:
    c = fsdp_on(cfg, 2, "fsdp:d1t2", model__arch="qwen2_moe")
    assert [p for p in problems(c) if p.startswith("roles.actor_train.backend")] == [
        "roles.actor_train.backend: 'fsdp:t2': the fsdp engine splits dense decoder layers over tensor-parallel ranks, "
        "and the model is a Mixture-of-Experts qwen2_moe with 4 routed experts; use t=1, or the megatron engine"]


def test_the_engine_splits_each_dense_layers_seven_linear_layers_and_refuses_an_expert_layer(cfg: dict[str, Any]) -> None:
    """What the engine itself refuses at build, should validation be bypassed (a model built by hand)."""
    import pytest
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from rlbatch.engines.fsdp.tp import layer_plan
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import tiny_skeleton

    dense = tiny_skeleton(spec_from_config(cfg["model"])).model.layers[0]
    plan = layer_plan(dense)
    assert sorted(n for n, p in plan.items() if isinstance(p, ColwiseParallel)) == [
        "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert sorted(n for n, p in plan.items() if isinstance(p, RowwiseParallel)) == ["mlp.down_proj", "self_attn.o_proj"]
    moe = tiny_skeleton(spec_from_config(cfg["model"] | {"arch": "qwen2_moe"})).model.layers[0]
    with pytest.raises(NotImplementedError, match="Qwen2MoeDecoderLayer has no mlp.gate_proj, mlp.up_proj, mlp.down_proj"):
        layer_plan(moe)


def test_context_parallel_fsdp_is_accepted_and_its_splits_refused_with_the_numbers(cfg: dict[str, Any]) -> None:
    """fsdp:dXcZ (Ulysses): each context-parallel rank takes whole heads after the all-to-all; KV heads
    fewer than c are repeated up to it; with t, c splits each tp rank's heads; padded rows are not built."""
    assert check(fsdp_on(cfg, 4, "fsdp:d1c4")).roles["actor_train"].backend.dims.c == 4  # 4 heads, 2 KV heads repeated
    c = fsdp_on(cfg, 4, "fsdp:d1c4", model__hidden_size=48, model__num_heads=6, model__num_kv_heads=3)
    assert problems(c) == [
        "roles.actor_train.backend: 'fsdp:c4' gives each of c=4 context-parallel ranks whole attention heads, but "
        "num_heads=6 is not divisible by 4",
        "roles.actor_train.backend: 'fsdp:c4' splits key/value heads over c=4 context-parallel ranks (repeating them "
        "up to c), but num_kv_heads=3 neither divides nor is divisible by 4"]
    c = fsdp_on(cfg, 4, "fsdp:d1t2c2", roles__actor_train__engine_args={"max_tokens_per_micro_batch": 0})
    assert [p for p in problems(c) if "context" in p] == [
        "roles.actor_train.backend: 'fsdp:t2c2' splits packed rows over c=2 context-parallel ranks, but "
        "roles.actor_train.engine_args.max_tokens_per_micro_batch=0 asks for padded ones; leave it unset or give a "
        "token budget"]
    # t and c together: c splits each tensor-parallel rank's heads (4 heads: 2 a tp rank, 1 KV head repeated)
    assert check(fsdp_on(cfg, 4, "fsdp:d1t2c2")).roles["actor_train"].backend.dims.t == 2
    c = fsdp_on(cfg, 8, "fsdp:d1t2c4")
    assert [p for p in problems(c) if "context" in p] == [
        "roles.actor_train.backend: 'fsdp:t2c4' gives each of c=4 context-parallel ranks whole attention heads, but "
        "num_heads=4 (2 on each of t=2 tensor-parallel ranks) is not divisible by 4"]
