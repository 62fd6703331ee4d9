"""Memory per role, per phase and per GPU: sharding, vLLM's reservation, offload, the OOM verdict."""

from __future__ import annotations

import pytest
from conftest import MODELS, make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.memory import role_memory
from rlbatch.plan.predict import predict

Q7B = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})
COLOCATED_8 = roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))", micro_batch=4)
ALGO = {"max_new_tokens": 1024, "prompts_per_step": 64, "grad_accum": 8}


def _predict(hw_name: str = "h100_sxm", **over):  # type: ignore[no-untyped-def]
    cfg = make_config(**over)
    hw = load_hardware(hw_name, over.pop("hw", None))
    shape = shape_from_config(cfg["model"])
    return predict(make_layout(cfg), shape, workload_of(cfg, 512), hw)


@pytest.mark.parametrize("d", [1, 2, 8])
def test_fsdp_model_states_are_16_bytes_per_param_over_the_shards(d: int, h100) -> None:  # type: ignore[no-untyped-def]
    cfg = make_config(roles=roles(f"fsdp:d{d}", f"vllm:d{d}", f"list(range(0,{d}))", f"list(range(0,{d}))"))
    m = role_memory(make_layout(cfg).roles["actor_train"], Q7B, workload_of(cfg), 2, h100)
    assert sum(m.state.values()) == pytest.approx(16 * Q7B.params / d)
    ref = role_memory(make_layout(cfg).roles["reference"], Q7B, workload_of(cfg), 2, h100)
    # The forward-only reference holds its shards in the compute dtype (bf16 on a GPU): no fp32 masters.
    assert ref.state == {"params": pytest.approx(2 * Q7B.params / d)}


def test_tensor_parallel_divides_weights_and_activations(h100) -> None:  # type: ignore[no-untyped-def]
    # Prompts run in full: a micro-batch then holds the same tokens per sequence whatever its size.
    full = {"engine_args": {"share_prompts": False}}
    base = make_config(algo=ALGO, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))", actor_train=full))
    tp = make_config(algo=ALGO, roles=roles("fsdp:d4t2", "vllm:d8", "list(range(0,8))", "list(range(0,8))", actor_train=full))
    w = workload_of(base, 512)
    a = role_memory(make_layout(base).roles["actor_train"], Q7B, w, 2, h100)
    b = role_memory(make_layout(tp).roles["actor_train"], Q7B, w, 2, h100)
    # d*t shards of the decoder layers' linear weights either way; the rest (embedding, LM head,
    # norms) stays whole on each tp rank, so over half as many dp ranks it is twice as much.
    rest = Q7B.params - Q7B.layers * (Q7B.layer_params - 2 * Q7B.hidden)
    assert sum(b.state.values()) == pytest.approx(sum(a.state.values()) + 16 * rest / 8)
    # Half the data-parallel ranks: twice the micro-batch; TP halves the attention and MLP inside
    # back, but the engine splits nothing along the sequence (no sequence parallelism): more.
    assert b.transient["train"]["activations"] > 1.1 * a.transient["train"]["activations"]


def test_fsdp_tensor_parallel_ranks_each_compute_the_whole_vocabularys_logits(h100) -> None:  # type: ignore[no-untyped-def]
    """The fsdp engine keeps the LM head whole on every tp rank (no vocabulary-parallel head): at the
    same d, fsdp:d4t2's logits are fsdp:d4's; megatron's vocabulary-parallel head halves them."""
    full = {"engine_args": {"share_prompts": False}}
    mem = {}
    for spec in ("fsdp:d4", "fsdp:d4t2", "megatron:d4", "megatron:d4t2"):
        train = "list(range(0,8))" if spec.endswith("t2") else "list(range(0,4))"
        own = full if spec.startswith("fsdp") else {}  # share_prompts is the fsdp engine's option
        cfg = make_config(algo=ALGO, roles=roles(spec, "vllm:d8", train, "list(range(0,8))", actor_train=own))
        mem[spec] = role_memory(make_layout(cfg).roles["actor_train"], Q7B, workload_of(cfg, 512), 2, h100)
    for phase in ("logprobs", "train"):
        assert mem["fsdp:d4t2"].transient[phase]["logits"] == pytest.approx(mem["fsdp:d4"].transient[phase]["logits"])
        assert mem["megatron:d4t2"].transient[phase]["logits"] == pytest.approx(
            mem["megatron:d4"].transient[phase]["logits"] / 2)


def test_vllm_reserves_its_share_of_the_gpu(h100) -> None:  # type: ignore[no-untyped-def]
    cfg = make_config(roles=COLOCATED_8)
    m = role_memory(make_layout(cfg).roles["actor_infer"], Q7B, workload_of(cfg), 2, h100)
    reserved = m.state["params"] + m.state["kv_cache"] + m.transient["generate"]["activations"]
    assert reserved == pytest.approx(VLLMArgs.gpu_memory_utilization * h100.hbm_bytes)
    assert m.state["params"] == pytest.approx(2 * Q7B.params)


def test_colocated_peak_follows_what_is_offloaded() -> None:
    on = _predict(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO, roles=COLOCATED_8)
    assert on.fits, on.problems
    g = on.gpus[0]
    # While vLLM generates, actor_train's weights and optimizer are in host memory.
    assert "actor_train" not in g.memory["generate"]
    # Weight sync runs with both actor roles resident; the reference waits in host memory.
    assert set(g.memory["sync"]) == {"actor_train", "actor_infer"}
    assert g.host_bytes >= 16 * Q7B.params / 8

    off = _predict(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO,
                   roles={k: v | {"offload": False} for k, v in COLOCATED_8.items()})
    assert not off.fits
    problem = off.problems[0]
    assert "OOM on GPU ranks 0-7" in problem and "phase train needs" in problem
    assert "largest term: actor_infer kv_cache" in problem and "GiB" in problem


def test_activations_dominate_an_oom_without_gradient_accumulation() -> None:
    # Prompts run in full in both (recompute turns sharing off): recompute alone is compared.
    full = {"engine_args": {"share_prompts": False, "micro_batch": 4}}
    p = _predict(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO | {"grad_accum": 1},
                 roles=roles("fsdp:d4", "vllm:d4", "list(range(0,4))", "list(range(4,8))", actor_train=full))
    assert any("phase train" in x and "actor_train activations" in x for x in p.problems), p.problems
    with_recompute = _predict(model={"path": str(MODELS / "qwen2_5_7b")},
                              algo=ALGO | {"grad_accum": 1, "activation_checkpointing": True},
                              roles=roles("fsdp:d4", "vllm:d4", "list(range(0,4))", "list(range(4,8))", actor_train=full))
    peak = lambda pr: max(g.peak()[1] for g in pr.gpus)  # noqa: E731
    assert peak(with_recompute) < peak(p) / 2


def test_host_ram_check_counts_pinned_offload_buffers() -> None:
    p = _predict(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO, roles=COLOCATED_8,
                 hw={"host_ram_bytes": 64e9})
    assert any(x.startswith("host RAM") and "> 59.6 GiB per node" in x for x in p.problems), p.problems


def test_cpu_ranks_share_the_nodes_ram() -> None:
    small = _predict("cpu")
    assert small.fits
    big = _predict("cpu", model={"path": str(MODELS / "qwen2_5_7b")})
    assert any(x.startswith("host RAM") for x in big.problems), big.problems


def test_whole_share_log_prob_passes_blow_up_on_big_vocabularies() -> None:
    # Without engine_args.micro_batch, rlbatch's fsdp engine computes log-probs for a rank's whole
    # share at once: 64 sequences x 1536 positions x 152064 vocab of logits.
    p = _predict(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO,
                 roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    assert any("largest term: actor_train logits" in x or "largest term: reference logits" in x for x in p.problems)


def test_shared_prompts_hold_each_prompt_once_in_activations_and_logits(h100) -> None:  # type: ignore[no-untyped-def]
    """A micro-batch of 16 sequences in groups of 8 (2 distinct 512-token prompts, 1024-token
    responses) holds 2 * 512 + 16 * 1023 tokens of activations instead of 16 * 1536, and logits for
    2 + 16 * 1023 positions instead of 16 * 1536."""
    algo = ALGO | {"grad_accum": 4}
    off = {"engine_args": {"share_prompts": False}}
    shared = make_config(algo=algo, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    full = make_config(algo=algo, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))", actor_train=off))
    w = workload_of(shared, 512)
    a = role_memory(make_layout(shared).roles["actor_train"], Q7B, w, 2, h100).transient["train"]
    b = role_memory(make_layout(full).roles["actor_train"], Q7B, w, 2, h100).transient["train"]
    assert a["logits"] == pytest.approx(b["logits"] * (2 + 16 * 1023) / (16 * 1536))
    assert a["activations"] < b["activations"] * (2 * 512 + 16 * 1023) / (16 * 1536) * 1.05


def test_megatron_activations_follow_its_sequence_parallelism(h100) -> None:  # type: ignore[no-untyped-def]
    # rlbatch's megatron engine runs TP with sequence parallelism by default: a layer's activations
    # are (34 + ...)/t. With engine_args.sequence_parallel=false it keeps Korthikanti's
    # s*b*h*(10 + 24/t + ...) (the norms' and dropouts' inputs whole on every TP rank), like fsdp's
    # tensor parallelism (no sequence parallelism) at the same dims and whole-sequence passes.
    from rlbatch.plan import activations as act

    full = {"engine_args": {"share_prompts": False}}
    f = make_config(algo=ALGO, roles=roles("fsdp:d4t2", "vllm:d8", "list(range(0,8))", "list(range(0,8))", actor_train=full))
    m = make_config(algo=ALGO, roles=roles("megatron:d4t2", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    no_sp = make_config(algo=ALGO, roles=roles("megatron:d4t2", "vllm:d8", "list(range(0,8))", "list(range(0,8))",
                                               actor_train={"engine_args": {"sequence_parallel": False}}))
    w = workload_of(f, 512)
    a, b, c = (role_memory(make_layout(x).roles["actor_train"], Q7B, w, 2, h100).transient["train"]["activations"]
               for x in (f, m, no_sp))
    s = w.seq_len
    ratio = act.layer_bytes(Q7B, s, 1, 2, 2, sp=False) / act.layer_bytes(Q7B, s, 1, 2, 2, sp=True)
    assert c == pytest.approx(a, rel=1e-9)
    assert ratio > 1.1 and c == pytest.approx(b * ratio, rel=1e-9)


def test_megatron_context_parallelism_splits_activations_and_keeps_the_whole_rows_logits(h100) -> None:  # type: ignore[no-untyped-def]
    """megatron:d4c2 runs each row's half on each cp rank (half d8's per-sequence activations at twice
    its micro-batch: the same), but gathers the outputs over cp: each rank holds the whole rows' logits,
    twice d8's (its micro-batch is twice as many rows)."""
    mem = {}
    for spec in ("megatron:d8", "megatron:d4c2"):
        cfg = make_config(algo=ALGO, roles=roles(spec, "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
        mem[spec] = role_memory(make_layout(cfg).roles["actor_train"], Q7B, workload_of(cfg, 512), 2, h100)
    for phase in ("logprobs", "train"):
        a, b = mem["megatron:d8"].transient[phase], mem["megatron:d4c2"].transient[phase]
        assert b["activations"] == pytest.approx(a["activations"], rel=1e-6)
        assert b["logits"] == pytest.approx(2 * a["logits"], rel=1e-6)


def test_megatron_hybrid_layout_splits_the_routed_experts_by_its_ffn_dims(h100) -> None:  # type: ignore[no-untyped-def]
    # megatron:(attn:d4t2|ffn:t2e4): attention, norms, router and shared expert as at d4t2; each rank
    # holds 1/(t*e) = 1/8 of the routed experts (the ffn section's), where d4t2 holds 1/2 of them.
    # The engine keeps 18 bytes per trained parameter in bf16 (weights, fp32 grads, main weights, moments).
    moe = shape_from_config({"path": str(MODELS / "qwen1_5_moe_a2_7b")})
    ranks = "list(range(0,8))"
    model = {"path": str(MODELS / "qwen1_5_moe_a2_7b")}
    one = make_config(algo=ALGO, model=model, roles=roles("megatron:d4t2", "vllm:d8", ranks, ranks))
    hybrid = make_config(algo=ALGO, model=model, roles=roles("megatron:(attn:d4t2|ffn:t2e4)", "vllm:d8", ranks, ranks))
    w = workload_of(one, 512)
    a, b = (role_memory(make_layout(x).roles["actor_train"], moe, w, 2, h100) for x in (one, hybrid))
    experts = moe.layers * moe.expert_params
    assert sum(a.state.values()) - sum(b.state.values()) == pytest.approx(18 * experts * (1 / 2 - 1 / 8))
    assert a.transient["train"]["activations"] == pytest.approx(b.transient["train"]["activations"])
