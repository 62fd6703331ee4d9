"""The vllm inference engine on vLLM itself (its CPU build here): behaviour log-probs equal a
transformers forward's, a GRPO group's samples differ, a seed reproduces them, stop strings and
EOS end a response as in the hf engine, and after a bucketed weight sync through one reused
staging buffer greedy output equals transformers' with the same weights, token for token.
vLLM starts in a one-rank world of its own beside the program's torch.distributed world.

One engine serves the module (vLLM takes ~30-60 s to start on a loaded 2-core machine). ``make
venv`` installs vLLM (its CPU build here; see docs/vllm.md): without it these tests fail, they do
not skip."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

from rlbatch.config.compose import compose  # noqa: E402
from rlbatch.engines.base import EngineContext, SamplingParams  # noqa: E402
from rlbatch.engines.hf import HFArgs  # noqa: E402
from rlbatch.engines.hf.engine import HFInferenceEngine  # noqa: E402
from rlbatch.engines.model import load_model, load_tokenizer  # noqa: E402
from rlbatch.engines.vllm import VLLMArgs  # noqa: E402
from rlbatch.engines.vllm.engine import VLLMEngine, _launcher_env, one_rank_executor  # noqa: E402
from tests.unit.infer_checks import assert_behaviour_logprobs_match_transformers, sync_in_buckets  # noqa: E402

SEED = 1
# vLLM's CPU attention needs head_dim >= 32: the default tiny model (hidden 64) with 2 heads
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The program's world exists first, as on a rank (rlbatch.runtime.world).
    store = tmp_path_factory.mktemp("world") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    program_pg = dist.group.WORLD
    cfg = compose(MODEL)
    tok = load_tokenizer(cfg.model)
    engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64), cfg.model, cfg.algo, tok,
                                      torch.device("cpu"), seed=SEED))
    yield SimpleNamespace(cfg=cfg, tok=tok, engine=engine, program_pg=program_pg)
    engine.close()
    dist.destroy_process_group()


def test_vllm_runs_in_its_own_world_beside_the_programs(setup: Any) -> None:
    assert dist.group.WORLD is setup.program_pg  # the program's default group is back in place
    assert setup.engine.world.default_pg is not setup.program_pg
    assert setup.engine.world.default_pg.size() == 1
    t = torch.ones(3)
    dist.all_reduce(t)  # the program's collectives still work after vLLM started
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_one_rank_engine_runs_on_the_ranks_own_device(setup: Any) -> None:
    """At t=1 the engine's executor takes its worker's device index from the rank's device, not
    from vLLM's DeviceConfig (the device type alone: GPU 0 for every rank of a node). Checked here
    on the running CPU engine (index 0) and, without a GPU, on the executor's own arguments for a
    rank whose GPU is cuda:3; vLLM's own executor would give 0."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    executor = setup.engine.llm.llm_engine.engine_core.engine_core.model_executor
    assert type(executor).__name__ == "OneRankExecutor", type(executor)
    assert executor.driver_worker.worker.local_rank == 0
    bare = object.__new__(one_rank_executor())
    bare.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device=torch.device("cuda")))
    with _launcher_env(0, torch.device("cuda", 3)):
        assert bare._distributed_args()[1:] == (0, 3)
        assert UniProcExecutor._distributed_args(bare)[1:] == (0, 0)  # what vLLM's own would use


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_those_of_a_transformers_forward(setup: Any, temperature: float) -> None:
    tok = setup.tok
    assert_behaviour_logprobs_match_transformers(setup.engine, setup.cfg, tok, SEED,
                                                 [tok.encode(f"{k}+{k}=") for k in range(4)] * 4, temperature)


def test_samples_of_one_prompt_differ_and_a_seed_reproduces_them(setup: Any) -> None:
    tok, engine = setup.tok, setup.engine
    prompts = [tok.encode("1+2=")] * 8 + [tok.encode("3+4=")] * 8
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    a = [tuple(g.tokens) for g in engine.generate(prompts, sp)]
    assert len(set(a[:8])) > 4 and len(set(a[8:])) > 4  # a GRPO group is not one answer repeated
    assert a == [tuple(g.tokens) for g in engine.generate(prompts, sp)]
    assert a != [tuple(g.tokens) for g in engine.generate(prompts, SamplingParams(8, 1.0, seed=8))]
    # interleaved copies of a prompt are grouped too, and each answer goes back to its row
    mixed = [tok.encode("1+2="), tok.encode("3+4=")] * 4
    assert [len(g.tokens) > 0 for g in engine.generate(mixed, sp)] == [True] * 8


def test_stop_strings_and_eos_end_a_response(setup: Any) -> None:
    tok, engine = setup.tok, setup.engine
    stop, eos = tok.convert_tokens_to_ids("="), tok.eos_token_id
    gens = engine.generate([tok.encode("1+2=")] * 64, SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                     stop_strings=("=",), seed=2))
    ended = [g.tokens for g in gens if stop in g.tokens or eos in g.tokens]
    assert ended, "no sample met '=' or EOS in 64 x 12 tokens"
    for tokens in ended:  # ends with the stop token or EOS, nothing after
        first = min(tokens.index(t) for t in (stop, eos) if t in tokens)
        assert first == len(tokens) - 1, tokens
    assert all(len(g.tokens) == 12 for g in gens if stop not in g.tokens and eos not in g.tokens)


def test_turns_join_and_leave_the_running_batch(setup: Any) -> None:
    """``Turns`` on vLLM: a request submitted while a longer one runs finishes first and comes back
    under its key, the longer one still in flight; each turn's greedy tokens and log-probs equal
    ``generate``'s for the same context."""
    from rlbatch.engines.base import TurnRequest, turns_of

    tok, engine = setup.tok, setup.engine
    turns = turns_of(engine)
    assert turns is engine  # vLLM runs turns itself, not through BatchedTurns
    long_sp, short_sp = SamplingParams(max_new_tokens=24, temperature=0.0), SamplingParams(max_new_tokens=2, temperature=0.0)
    # a context whose greedy answer runs the whole 24 tokens (no EOS on the way)
    contexts = [tok.encode(f"{k}+{k}={k}") for k in range(10)]
    full = [c for c, g in zip(contexts, engine.generate(contexts, long_sp), strict=True) if len(g.tokens) == 24]
    assert full, "no context's greedy answer runs 24 tokens: pick other contexts"
    turns.submit([TurnRequest(100, full[0], seed=1)], long_sp)
    assert turns.poll(block=False) == [] and turns.in_flight() == 1  # one step: prefill, far from done
    short = [tok.encode("1+2="), tok.encode("3+4=5")]
    turns.submit([TurnRequest(7, short[0], seed=2), TurnRequest(8, short[1], seed=3)], short_sp)
    first: dict[int, Any] = {}
    while not {7, 8} <= set(first):
        first |= dict(turns.poll())
    assert 100 not in first and turns.in_flight() == 1  # the short ones did not wait for the long one
    last = turns.poll()
    assert [k for k, _ in last] == [100] and turns.in_flight() == 0 and turns.poll() == []
    want = engine.generate([short[0], short[1], full[0]], short_sp)[:2] + engine.generate([full[0]], long_sp)
    for got, exp in zip([first[7], first[8], last[0][1]], want, strict=True):
        assert got.tokens == exp.tokens
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(exp.logprobs), atol=1e-4)
    with pytest.raises(ValueError, match="already in flight"):
        turns.submit([TurnRequest(9, short[0], seed=1), TurnRequest(9, short[0], seed=1)], short_sp)
    while turns.in_flight():
        turns.poll()


def _new_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_greedy_after_a_bucketed_sync_equals_transformers(setup: Any) -> None:
    """Weight sync's receiving side: buckets broadcast into one staging buffer that the next bucket
    overwrites (vLLM keeps a layer's tensors until the layer is complete: the engine must copy)."""
    cfg, tok, engine = setup.cfg, setup.tok, setup.engine
    hf = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=SEED))
    prompts = [tok.encode(f"{k}*{k + 1}=") for k in range(6)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert [g.tokens for g in engine.generate(prompts, greedy)] == [g.tokens for g in hf.generate(prompts, greedy)]
    named = _new_weights(hf.model)
    sync_in_buckets(engine, named)
    hf.load_weights(named)
    want = [g.tokens for g in hf.generate(prompts, greedy)]
    assert [g.tokens for g in engine.generate(prompts, greedy)] == want
    # and in one call (the colocated sync), twice: the second sync replaces the first
    engine.load_weights(_new_weights(load_model(cfg.model, tok, SEED)))
    engine.load_weights(named)
    assert [g.tokens for g in engine.generate(prompts, greedy)] == want


def test_generate_refuses_a_half_done_sync(setup: Any) -> None:
    engine, named = setup.engine, _new_weights(load_model(setup.cfg.model, setup.tok, SEED))
    engine.load_weights(named[:3])
    with pytest.raises(RuntimeError, match="incomplete weight sync"):
        engine.generate([[1, 5]], SamplingParams(max_new_tokens=2))
    engine.load_weights(named[3:])
    assert engine.generate([[1, 5]], SamplingParams(max_new_tokens=2))[0].tokens


def test_offload_on_cpu_keeps_vllm_resident(setup: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine = setup.engine
    assert engine.offload(engine.state_kinds).bytes == 0
    assert engine.reload(engine.state_kinds).bytes == 0
    assert engine.generate([[1, 5]], SamplingParams(max_new_tokens=2))[0].tokens
    assert engine.weight_views(["model.embed_tokens.weight"], torch.float32) is None


def test_registry_builds_vllm_data_and_tensor_parallel() -> None:
    from rlbatch.engines.registry import engine_args, spec_of

    spec = spec_of("vllm")
    assert spec.built and spec.dims == "dt"
    assert engine_args("vllm", {"kv_cache_mb": 128}).kv_cache_mb == 128
    with pytest.raises(ValueError, match="kv_cache_memory"):
        engine_args("vllm", {"kv_cache_memory": 1})



def test_a_tensor_parallel_split_the_model_cannot_take_is_refused_naming_the_numbers() -> None:
    from rlbatch.engines.vllm.engine import check_tp

    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256}
    for t in (1, 2, 4):  # kv heads split (t=2) or replicated (t=4)
        check_tp(shape, t)
    with pytest.raises(ValueError, match=r"t=3 .*num_attention_heads 4 is not divisible by t=3; "
                                         r"num_key_value_heads 2 neither divides nor is divisible by t=3; "
                                         r"intermediate_size 256 is not divisible by t=3"):
        check_tp(shape, 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 neither divides"):
        check_tp({"num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 256}, 2)
