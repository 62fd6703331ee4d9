"""Token-budget micro-batches in the planner: memory by the packed row, time on real tokens, and the
budget ``plan search`` chooses. The expected numbers are worked out here from the engines' code
(``rlbatch.engines.training``, ``rlbatch.engines.batch``, ``rlbatch.algos.core.chunked_logprobs``),
not taken from the planner."""

from __future__ import annotations

import pytest
from conftest import MODELS, make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.activations import CHUNK_BYTES
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.memory import role_memory
from rlbatch.plan.passes import token_budget
from rlbatch.plan.predict import predict
from rlbatch.plan.search import budgets, packing_roles, search, with_budget

Q7B = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})
# Qwen2.5-7B: hidden 3584, 28 heads of 128, 4 KV heads (512 wide), SwiGLU 18944, vocab 152064, 28 layers.
H, Q, KV, F, A, V, L = 3584, 3584, 512, 18944, 28, 152064, 28
# 8 prompts x 8 samples of a 512-token prompt, responses of 512 tokens on average and 1024 at most,
# on fsdp:d8: a rank's share of a log-prob pass is 8 samples (8192 tokens), of a mini-batch 4 (4096).
ALGO = {"max_new_tokens": 1024, "prompts_per_step": 8, "samples_per_prompt": 8, "mini_batches": 2}
LONGEST, RESPONSE_MAX = 512 + 1024, 1024


def _memory(budget: int | None, hw_name: str = "h100_sxm", role: str = "actor_train"):  # type: ignore[no-untyped-def]
    cfg = make_config(algo=ALGO, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))",
                                             max_tokens=budget))
    w = workload_of(cfg, 512, 0.5)
    return role_memory(make_layout(cfg).roles[role], Q7B, w, 2, load_hardware(hw_name)), w


def _chunk(scored: float) -> float:
    """One chunk of fp32 logits as chunked_logprobs cuts them: 2**28 bytes // (4 V) rows = 441 rows."""
    return 4.0 * min(scored, 441) * V


def test_the_chunk_size_is_the_engines() -> None:
    from rlbatch.algos.core import CHUNK_BYTES as ENGINE_CHUNK_BYTES

    assert CHUNK_BYTES == ENGINE_CHUNK_BYTES
    assert CHUNK_BYTES // (4 * V) == 441


def test_memory_under_a_budget_is_the_largest_packed_row() -> None:
    m, _ = _memory(4096)
    # Log-prob pass: the rank's 8192 tokens in rows of at most 4096; the densest row is all longest
    # samples, 1024 of each 1536 tokens scored. bf16 (e = 2).
    T, K = 4096.0, 4096.0 * RESPONSE_MAX / LONGEST
    fwd = m.transient["logprobs"]
    assert fwd["activations"] == pytest.approx(2 * T * (2 * H + Q + 2 * KV + 2 * F), rel=1e-12)
    # bf16 rows run varlen attention (rlbatch.engines.attention): no [T, T] mask
    assert "attention_mask" not in fwd
    # the logits at the scored positions (bf16), one chunk's fp32 copy and its logsumexp's temporary
    assert fwd["logits"] == pytest.approx(K * V * 2 + 2 * _chunk(K), rel=1e-12)
    # Train pass: the rank's 4 samples of a mini-batch (4096 tokens) in one row of 4096.
    tr = m.transient["train"]
    per_token_layer = 2 * (4 * H + Q + KV + KV + Q + 3 * F) + 4 * A  # Korthikanti's count, GQA, SwiGLU, flash lse
    assert tr["activations"] == pytest.approx(L * T * per_token_layer, rel=1e-12)
    assert "attention_mask" not in tr
    # logits kept and their gradient (bf16), the backward's chunk: fp32 copy, exp, its negation, the product
    assert tr["logits"] == pytest.approx(2 * K * V * 2 + 4 * _chunk(K), rel=1e-12)
    assert "actor_train: token budget 4096, log-prob rows of up to 4096 tokens (2731 scored)" in m.notes


def test_a_budget_below_the_longest_sample_runs_it_alone() -> None:
    small, _ = _memory(256)
    at, _ = _memory(1024)
    # A 1536-token sample is a row of its own whatever the smaller budget: both give that row.
    T, K = float(LONGEST), float(RESPONSE_MAX)
    per_token_layer = 2 * (4 * H + Q + KV + KV + Q + 3 * F) + 4 * A
    for m in (small, at):
        assert m.transient["train"]["activations"] == pytest.approx(L * T * per_token_layer, rel=1e-12)
        assert m.transient["logprobs"]["logits"] == pytest.approx(K * V * 2 + 2 * _chunk(K), rel=1e-12)
    assert small.transient == at.transient


def test_the_budget_resolves_as_the_engines_do(h100, cpu_hw) -> None:  # type: ignore[no-untyped-def]
    from rlbatch.engines.defaults import max_tokens_per_micro_batch
    from rlbatch.engines.registry import engine_args

    unset = make_layout(make_config(algo=ALGO, roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))",
                                                            "list(range(0,8))", max_tokens=None)))
    r = unset.roles["actor_train"]
    assert token_budget(r, h100) == max_tokens_per_micro_batch(engine_args("fsdp", {}), "cuda") > 0  # the GPU's default: packed
    assert token_budget(r, cpu_hw) == 0  # padded on CPU
    padded, _ = _memory(0)
    assert "attention_mask" not in padded.transient["train"]
    # megatron has no budget: padded whatever the device
    mega = make_layout(make_config(algo=ALGO, roles=roles("megatron:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))")))
    assert token_budget(mega.roles["actor_train"], h100) == 0


def test_packed_time_follows_real_tokens_padded_time_the_longest() -> None:
    """Twice the longest response at the same mean: padded rows grow with it, packed rows of a
    budget the rank's share fills do not."""
    def train_roofline(budget: int, cap: int) -> float:
        cfg = make_config(algo=ALGO | {"max_new_tokens": cap},
                          roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))", max_tokens=budget,
                                      actor_train={"engine_args": {"share_prompts": False}}))
        p = predict(make_layout(cfg), Q7B, workload_of(cfg, 512, 512.0), load_hardware("h100_sxm"))
        phase = p.phase("train")
        assert phase is not None
        return phase.features["roofline"]

    assert train_roofline(4096, 2048) == pytest.approx(train_roofline(4096, 1024), rel=1e-9)
    assert train_roofline(0, 2048) > 1.4 * train_roofline(0, 1024)
    assert train_roofline(4096, 1024) < train_roofline(0, 1024)


def _search_case() -> tuple[dict, object]:  # type: ignore[type-arg]
    cfg = make_config(model={"path": str(MODELS / "qwen2_5_7b")},
                      algo={"max_new_tokens": 1024, "prompts_per_step": 16, "samples_per_prompt": 8},
                      roles=roles("fsdp:d4", "vllm:d4", "list(range(0,4))", "list(range(4,8))", max_tokens=None))
    return cfg, workload_of(cfg, 512, 0.5)


def test_search_picks_the_largest_budget_that_fits() -> None:
    cfg, w = _search_case()
    hw = load_hardware("h100_sxm")
    layout = make_layout(cfg)
    packed = packing_roles(layout, hw)
    assert packed == ["actor_train", "reference"]
    # from the longest sample's power of two (1536 -> 2048) to a log-prob share (32 x 1024 tokens)
    ladder = budgets(layout, packed, w)
    assert ladder == [32768, 16384, 8192, 4096, 2048]
    fits = {b: predict(with_budget(layout, packed, b), Q7B, w, hw).fits for b in ladder}
    assert fits == {32768: False, 16384: False, 8192: False, 4096: True, 2048: True}
    best, stats = search(cfg, 8, 8, Q7B, w, hw, Coefficients(), "auto", top=20)
    ours = [c for c in best if c.label.startswith("disaggregated: actor_train fsdp:d4 on 0-3")]
    assert ours and ours[0].budget == 4096, [(c.label, c.budget) for c in best]
    assert "++roles.actor_train.engine_args.max_tokens_per_micro_batch=4096" in ours[0].overrides
    assert "++roles.reference.engine_args.max_tokens_per_micro_batch=4096" in ours[0].overrides
    assert all(c.budget in ladder for c in ours) and stats["fit"] > 0
    # other layouts search their own ladders (a rank's share differs): powers of two from the longest sample's
    assert all(c.budget >= 2048 and c.budget & (c.budget - 1) == 0 for c in best), [c.budget for c in best]


def test_a_padded_config_is_searched_padded() -> None:
    cfg, w = _search_case()
    cfg["roles"]["actor_train"]["engine_args"]["max_tokens_per_micro_batch"] = 0
    cfg["roles"]["reference"]["engine_args"]["max_tokens_per_micro_batch"] = 0
    hw = load_hardware("h100_sxm")
    assert packing_roles(make_layout(cfg), hw) == []
    best, _ = search(cfg, 8, 8, Q7B, w, hw, Coefficients(), "auto", top=3)
    assert all(c.budget == 0 and not any("max_tokens_per_micro_batch" in o for o in c.overrides) for c in best)


def test_the_log_prob_estimate_matches_a_cpu_measurement() -> None:
    """``python tools/bench/packing.py --samples 64 --threads 1`` (docs/planner.md, "Packing: checked
    against a measurement"): the packed log-prob pass's peak was 702.9 MiB (fp32, CPU, VmHWM) for
    rows of at most 961 tokens, the one with the most scored positions 886 tokens with 765 scored,
    on a qwen2 of hidden 64, 2 layers, 4 heads (2 KV), SwiGLU 256, vocab 151936. The planner's terms
    on that row come within 1 %."""
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan import activations as act
    from rlbatch.plan.activations import mask_bytes, packed_logits_bytes

    shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=256, vocab=151936)
    T, K, e = 886.0, 765.0, 4
    predicted = act.forward_working_bytes(shape, T, 1, e) + mask_bytes(T, e, 1) + packed_logits_bytes(K, shape.vocab, e)
    assert predicted == pytest.approx(702.9 * 2**20, rel=0.01)


def test_megatron_under_a_budget_is_modelled_as_its_padded_micro_batches(h100) -> None:  # type: ignore[no-untyped-def]
    """megatron meets a token budget with padded rows: a micro-batch of as many mean-length samples as
    the budget holds (8192 / (512 + 512) = 8 here, 2 at 2048), each padded to the longest: its memory
    and time are those of padded micro-batches of that many sequences."""
    from rlbatch.plan.passes import budget_micro_batch, padded_budget

    def layout(budget: int | None, micro_batch: int = 0):  # type: ignore[no-untyped-def]
        args = {"engine_args": {"max_tokens_per_micro_batch": budget} if budget is not None else {}}
        if micro_batch:
            args["engine_args"]["micro_batch"] = micro_batch
        cfg = make_config(algo=ALGO | {"grad_accum": 4}, roles=roles("megatron:d8", "vllm:d8", "list(range(0,8))",
                                                                     "list(range(0,8))", actor_train=args, reference=args))
        return make_layout(cfg), workload_of(cfg, 512, 0.5)

    (lay, w), (small, _) = layout(8192), layout(2048)
    r = lay.roles["actor_train"]
    assert padded_budget(r) == 8192 and token_budget(r, h100) == 0  # no packed rows on megatron
    assert padded_budget(layout(None)[0].roles["actor_train"]) == 0
    assert budget_micro_batch(w, 8192, 8) == 8 and budget_micro_batch(w, 2048, 8) == 2
    assert budget_micro_batch(w, 100, 8) == 1  # a sample longer than the budget runs alone

    def mem(lay):  # type: ignore[no-untyped-def]
        return role_memory(lay.roles["actor_train"], Q7B, w, 2, h100)

    # the log-prob pass: a rank's share is 8 sequences; at 2048 two per micro-batch, as micro_batch=2
    by_count, _ = layout(None, micro_batch=2)
    assert mem(small).transient["logprobs"] == pytest.approx(mem(by_count).transient["logprobs"], rel=1e-12)
    assert mem(lay).transient["logprobs"]["activations"] == pytest.approx(
        4 * mem(small).transient["logprobs"]["activations"], rel=1e-12)
    # training: 4 sequences of a mini-batch per rank; at 2048, 2 per micro-batch
    assert mem(lay).transient["train"]["activations"] == pytest.approx(
        2 * mem(small).transient["train"]["activations"], rel=1e-12)

    def train_phase(lay):  # type: ignore[no-untyped-def]
        p = predict(lay, Q7B, w, h100)
        phase = p.phase("train")
        assert phase is not None
        return phase.features

    few, many = train_phase(lay), train_phase(small)
    assert many["roofline"] == pytest.approx(few["roofline"], rel=1e-12)  # the same padded tokens
    assert many["overhead"] > 1.5 * few["overhead"]  # 4x the model calls, each a host cost
