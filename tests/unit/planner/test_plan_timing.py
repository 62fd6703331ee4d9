"""Collective formulas, roofline times and the long tail, by hand."""

from __future__ import annotations

import pytest
from conftest import MODELS, make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan import comm, timing
from rlbatch.plan.predict import predict

LINK = comm.Link(bw=100e9, alpha=2e-6)


def test_ring_collectives_by_hand() -> None:
    S = 1e9
    assert comm.all_reduce(S, 8, LINK) == pytest.approx(2 * 7 * 2e-6 + 2 * 7 / 8 * S / 100e9)
    assert comm.all_gather(S, 8, LINK) == pytest.approx(7 * 2e-6 + 7 / 8 * S / 100e9)
    assert comm.reduce_scatter(S, 8, LINK) == comm.all_gather(S, 8, LINK)
    assert comm.broadcast(S, 8, LINK) == pytest.approx(7 * 2e-6 + S / 100e9)
    assert comm.all_reduce(S, 1, LINK) == comm.all_gather(S, 1, LINK) == comm.broadcast(S, 1, LINK) == 0.0


def test_groups_across_nodes_use_the_nic() -> None:
    hw = load_hardware("h100_sxm")
    assert comm.link(hw, False).bw == pytest.approx(450e9 * hw.link_eff)
    assert comm.link(hw, True).bw == pytest.approx(50e9 * hw.link_eff)
    one_node = make_layout(make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))")))
    two = make_layout(make_config(roles=roles("fsdp:d16", "vllm:d16", "list(range(0,16))", "list(range(0,16))")))
    assert not one_node.group_spans_nodes("actor_train", 1, 8)
    assert two.group_spans_nodes("actor_train", 1, 16)
    tp = make_layout(make_config(roles=roles("fsdp:d2t8", "vllm:d16", "list(range(0,16))", "list(range(0,16))")))
    assert not tp.group_spans_nodes("actor_train", 1, 8)   # TP groups stay in a node
    assert tp.group_spans_nodes("actor_train", 8, 2)       # the FSDP group strides across both


def _pred(hw: str = "h100_sxm", response: float | None = None, **over):  # type: ignore[no-untyped-def]
    cfg = make_config(**over)
    return predict(make_layout(cfg), shape_from_config(cfg["model"]), workload_of(cfg, 512, response),
                   load_hardware(hw))


def test_training_is_six_flops_per_parameter_token_when_compute_bound() -> None:
    # A 72B model on 8 GPUs trains compute-bound: the roofline equals 6 * N * tokens / achieved FLOP/s
    # (plus the attention term, 12 * L * a * d * ctx per token, and the optimizer's memory pass).
    hw = load_hardware("h100_sxm")
    algo = {"max_new_tokens": 512, "prompts_per_step": 8, "samples_per_prompt": 4, "mini_batches": 1, "grad_accum": 32}
    p = _pred(response=1.0, model={"path": str(MODELS / "qwen2_5_72b")}, algo=algo,
              roles=roles("fsdp:d1t8", "vllm:d1t8", "list(range(0,8))", "list(range(0,8))"))
    shape, w = p.shape, p.workload
    tokens = w.sequences * w.seq_len
    flops = 3 * tokens * shape.fwd_flops_per_token(w.seq_len / 2) / 8
    expected = flops / (hw.peak_flops * hw.mfu)
    roof = p.phase("train").features["roofline"]  # type: ignore[union-attr]
    opt = 2 * 16 * shape.params / 8 / (hw.hbm_bw * hw.mbu)
    assert roof == pytest.approx(expected + opt, rel=0.01)
    assert flops * 8 == pytest.approx(6 * shape.active_params * tokens, rel=0.1)


def test_the_long_tail_sets_the_decode_steps() -> None:
    algo = {"max_new_tokens": 2048, "prompts_per_step": 64}
    model = {"path": str(MODELS / "qwen2_5_7b")}
    rl = roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))")
    short = _pred(response=256, model=model, algo=algo, roles=rl).phase("generate")
    long = _pred(response=1024, model=model, algo=algo, roles=rl).phase("generate")
    assert short is not None and long is not None
    # Memory-bound decode re-reads the weights every step: same 2048 steps, so the shorter mean
    # costs more than mean_ratio suggests (the tail keeps the GPU busy).
    assert short.features["roofline"] > long.features["roofline"] / 4 * 1.5


def test_hf_generation_keeps_finished_rows_vllm_drops_them() -> None:
    algo = {"max_new_tokens": 512, "prompts_per_step": 512, "samples_per_prompt": 1}  # same prefill for both
    model = {"path": str(MODELS / "qwen2_5_7b")}
    hf = _pred(response=64, model=model, algo=algo, roles=roles("fsdp:d8", "hf:d8", "list(range(0,8))", "list(range(0,8))"))
    vl = _pred(response=64, model=model, algo=algo, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    assert hf.phase("generate").features["roofline"] > vl.phase("generate").features["roofline"]  # type: ignore[union-attr]


def test_cpu_ranks_beyond_the_cores_slow_each_other() -> None:
    two = _pred("cpu")
    four = _pred("cpu", roles=roles("fsdp:d4", "hf:d4", [0, 1, 2, 3], [0, 1, 2, 3]))
    g2, g4 = two.phase("generate"), four.phase("generate")
    assert g2 is not None and g4 is not None
    # Each of 4 ranks gets half of the 2 cores: host overhead per decode step doubles, and half the
    # sequences per rank at half the bandwidth stream as long as before.
    assert g4.features["overhead"] == pytest.approx(2 * g2.features["overhead"])
    assert g4.features["roofline"] == pytest.approx(g2.features["roofline"], rel=0.05)


def test_repeated_prompts_run_once_per_micro_batch() -> None:
    """rlbatch's fsdp engine runs each distinct prompt of a micro-batch once and the responses on
    its cache (rlbatch.engines.batch); the hf engine prefills each distinct prompt once. By hand:
    a rank's 64 sequences in groups of 16 and 512-token prompts with 64-token responses are
    4 * 512 + 64 * 63 tokens instead of 64 * (512 + 64)."""
    algo = {"max_new_tokens": 64, "prompts_per_step": 32, "samples_per_prompt": 16, "mini_batches": 1}
    model = {"path": str(MODELS / "qwen2_5_7b")}
    off = {"engine_args": {"share_prompts": False}}
    shared = _pred(response=1.0, model=model, algo=algo, roles=roles("fsdp:d8", "hf:d8", "list(range(0,8))", "list(range(0,8))"))
    full = _pred(response=1.0, model=model, algo=algo,
                 roles=roles("fsdp:d8", "hf:d8", "list(range(0,8))", "list(range(0,8))",
                             actor_train=off, actor_infer=off, reference=off))
    ratio = (4 * 512 + 64 * 63) / (64 * (512 + 64))
    for phase in ("train", "ref_logprobs"):
        assert shared.phase(phase).features["roofline"] == pytest.approx(  # type: ignore[union-attr]
            ratio * full.phase(phase).features["roofline"], rel=0.03), phase  # type: ignore[union-attr]
    assert shared.phase("generate").features["roofline"] < full.phase("generate").features["roofline"]  # type: ignore[union-attr]
    # activation checkpointing re-runs layers, which would extend a shared cache twice: trained roles run whole
    ckpt = _pred(response=1.0, model=model, algo=algo | {"activation_checkpointing": True},
                 roles=roles("fsdp:d8", "hf:d8", "list(range(0,8))", "list(range(0,8))"))
    full_ckpt = _pred(response=1.0, model=model, algo=algo | {"activation_checkpointing": True},
                      roles=roles("fsdp:d8", "hf:d8", "list(range(0,8))", "list(range(0,8))", actor_train=off))
    assert ckpt.phase("train").features == full_ckpt.phase("train").features  # type: ignore[union-attr]


def test_in_cache_traffic_streams_at_the_cache_bandwidth() -> None:
    """On a CPU profile a working set that fits the last-level cache streams at cache_bw times the
    rank's share of the cores; beyond it the rest shares the memory bus (host_mem_bw / ranks)."""
    hw = load_hardware("cpu", {"cache_bw": 20e9, "hbm_bw": 3e9, "host_mem_bw": 4e9, "llc_bytes": 32e6, "cores_per_node": 2})
    layout = make_layout(make_config(roles=roles("fsdp:d2", "hf:d2", [0, 1], [0, 1])))
    assert timing.rates(hw, layout, 2, working_set=1e6).bw == pytest.approx(20e9 * hw.mbu)
    # 2 ranks x 64 MB: a quarter of it cached at 20 GB/s, the rest at min(3, 4 / 2) GB/s
    half = 1.0 / (0.25 / 20e9 + 0.75 / 2e9)
    assert timing.rates(hw, layout, 2, working_set=64e6).bw == pytest.approx(half * hw.mbu)
    assert timing.rates(load_hardware("cpu", {"cache_bw": 0.0, "llc_bytes": 32e6}), layout, 2, 1e6).bw == pytest.approx(
        load_hardware("cpu").hbm_bw * load_hardware("cpu").mbu)  # unknown: hbm_bw


def test_commanding_ranks_costs_a_wakeup_each_only_on_an_oversubscribed_cpu_node() -> None:
    cpu = load_hardware("cpu", {"wakeup_s": 2e-3, "op_overhead_s": 5e-6, "cores_per_node": 2})
    two = make_layout(make_config(roles=roles("fsdp:d2", "hf:d2", [0, 1], [0, 1])))  # 2 ranks + controller + reward
    assert timing.command(2, cpu, two) == pytest.approx(2 * (timing.WORKER_OPS * 5e-6 + 2e-3))
    roomy = load_hardware("cpu", {"wakeup_s": 2e-3, "op_overhead_s": 5e-6, "cores_per_node": 8})
    assert timing.command(2, roomy, two) == pytest.approx(2 * timing.WORKER_OPS * 5e-6)
    gpu = load_hardware("h100_sxm")
    assert timing.command(8, gpu, two) == pytest.approx(8 * timing.WORKER_OPS * gpu.op_overhead_s)
    # the phase's feature counts the ranks it commands: 2 colocated, 1 per role disaggregated
    p = predict(two, shape_from_config(make_config()["model"]), workload_of(make_config()), cpu)
    assert p.phase("train").features["workers"] == pytest.approx(timing.command(2, cpu, two))  # type: ignore[union-attr]
