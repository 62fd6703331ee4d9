"""Weights read by rows (rlbatch.models.weights) and the skeleton an fsdp engine fills
(rlbatch.engines.model.engine_skeleton): any split of the rows gives the tensors the model built
whole has, from the seeded random init and from a model directory, for the policy and its value
and reward heads; and the dtype a forward-only fsdp engine holds (bf16 on a GPU)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rlbatch.config.schema import AlgoConfig, ModelConfig
from rlbatch.data.tokenizer import build_char_tokenizer
from rlbatch.engines.base import EngineContext
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.model import engine_skeleton, load_engine_model, load_model, model_skeleton
from rlbatch.models import weights
from rlbatch.models.spec import spec_from_config
from rlbatch.models.tiny import build_tiny_model

TOK = build_char_tokenizer()


def _chunks(n: int, d: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 layout: ceil(n/d) rows a rank, the last ranks what is left (maybe nothing)."""
    c = -(-n // d)
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(d)]


def _ctx(model: ModelConfig, head: str = "lm", trainable: bool = False, mesh: Any = None) -> EngineContext:
    return EngineContext("x", FSDPArgs(), model, AlgoConfig(), TOK, torch.device("cpu"), 7, mesh, trainable, head)


@pytest.mark.parametrize("d", [1, 2, 3, 7])
def test_random_init_rows_of_any_split_are_the_whole_models(d: int) -> None:
    model = build_tiny_model(spec_from_config({"arch": "qwen2_moe"}), seed=4)
    init = weights.random_init(model, 4)
    for name, p in model.named_parameters():
        parts = [init.rows(name, tuple(p.shape), a, b) for a, b in _chunks(p.shape[0], d)]
        assert torch.equal(torch.cat(parts), p.detach()), name


def test_random_init_draws_blocks_of_rows_each_from_its_own_seed() -> None:
    # 3000 rows of 1024: 1024 rows a block (2**20 elements), three blocks, the last one short.
    init = weights.RandomInit(seed=1, std=0.02, rules={"w": weights.InitRule("normal", zero_row=5)})
    whole = init.rows("w", (3000, 1024), 0, 3000)
    assert torch.equal(init.rows("w", (3000, 1024), 1000, 2100), whole[1000:2100])  # spans a block boundary
    assert torch.equal(init.rows("w", (3000, 1024), 2999, 3000), whole[2999:])
    assert init.rows("w", (3000, 1024), 7, 7).shape == (0, 1024)
    assert torch.all(whole[5] == 0) and abs(float(whole.std()) - 0.02) < 1e-3
    other = weights.RandomInit(seed=2, std=0.02, rules=init.rules).rows("w", (3000, 1024), 0, 3000)
    assert not torch.equal(whole, other)
    # The rows do not depend on which tensor is drawn first: another name, another stream.
    assert not torch.equal(whole[:10], weights.RandomInit(1, 0.02, {"v": weights.InitRule("normal")}).rows(
        "v", (3000, 1024), 0, 10))


def test_init_rules_follow_transformers_distributions() -> None:
    with torch.device("meta"):
        model = build_tiny_model(spec_from_config({"arch": "llama", "tie_word_embeddings": False}), tokenizer=TOK)
    rules = weights.init_rules(model)
    assert rules["model.embed_tokens.weight"] == weights.InitRule("normal", TOK.pad_token_id)
    assert rules["model.layers.0.input_layernorm.weight"].kind == "ones"
    assert rules["model.norm.weight"].kind == "ones"
    assert rules["lm_head.weight"].kind == "normal"
    assert rules["model.layers.1.mlp.down_proj.weight"].kind == "normal"
    qwen = build_tiny_model(spec_from_config({}), seed=0)
    assert torch.all(qwen.model.layers[0].self_attn.q_proj.bias == 0)


def _whole(sk: weights.TensorSource, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: sk.rows(n, tuple(p.shape), 0, p.shape[0]) for n, p in model.named_parameters()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    bad = [n for n in got if not (got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]))]
    assert not bad, bad[:4]


@pytest.fixture(scope="module")
def model_dirs() -> Iterator[dict[str, Path]]:
    """A causal LM saved in bf16 (the model loads it in fp32: rows are upcast as transformers does),
    and one whose weights are a PyTorch pickle (no safetensors: read whole)."""
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_model(ModelConfig(tie_word_embeddings=False), TOK, 3)
        out = {"bf16": Path(tmp) / "bf16", "plain": Path(tmp) / "plain"}
        lm.to(torch.bfloat16).save_pretrained(out["bf16"])
        lm.save_pretrained(out["plain"])
        (out["plain"] / "model.safetensors").unlink()
        torch.save(lm.state_dict(), out["plain"] / "pytorch_model.bin")
        for d in out.values():
            TOK.save_pretrained(d)
        yield out


@pytest.mark.parametrize("head", ["lm", "value", "reward"])
@pytest.mark.parametrize("source", ["random", "bf16", "plain"])
def test_the_skeleton_filled_whole_is_the_model_built_whole(head: str, source: str, model_dirs: dict[str, Path]) -> None:
    cfg = ModelConfig(tie_word_embeddings=False) if source == "random" else ModelConfig(path=str(model_dirs[source]))
    ctx = _ctx(cfg, head)
    sk = engine_skeleton(ctx)
    assert all(p.is_meta for p in sk.model.parameters())
    assert bool(sk.whole) == (source == "plain")  # no safetensors files: read whole, and said why
    if source == "bf16":
        assert isinstance(sk.weights, weights.SafetensorsFiles) or isinstance(sk.weights.base, weights.SafetensorsFiles)
    sk.materialise(torch.device("cpu"))
    want = dict(load_engine_model(ctx).named_parameters())
    _same(dict(sk.model.named_parameters()), want)
    if source == "random":  # and the rows of any split are those rows
        _same({n: torch.cat([sk.weights.rows(n, tuple(p.shape), a, b) for a, b in _chunks(p.shape[0], 2)])
               for n, p in want.items()}, {n: p.detach() for n, p in want.items()})


@pytest.mark.parametrize("source", ["bf16", "plain"])
def test_a_directory_loads_as_from_pretrained_loads_it(source: str, model_dirs: dict[str, Path]) -> None:
    """load_model reads safetensors one tensor at a time (the others' whole path and the anchor of
    every comparison above): the same tensors, dtype, generation defaults and mode as transformers'."""
    from transformers import AutoModelForCausalLM

    for dtype in (torch.float32, torch.bfloat16):
        got = load_model(ModelConfig(path=str(model_dirs[source])), TOK, 0, dtype)
        want = AutoModelForCausalLM.from_pretrained(model_dirs[source], dtype=dtype)
        _same(dict(got.named_parameters()), dict(want.named_parameters()))
        _same(dict(got.named_buffers()), dict(want.named_buffers()))
        assert got.generation_config.to_dict() == want.generation_config.to_dict()
        assert not got.training and not want.training
        assert all(p.untyped_storage().resizable() for p in got.parameters())  # offload can free them


def test_safetensors_rows_read_only_the_rows_and_check_the_shape(model_dirs: dict[str, Path]) -> None:
    files = weights.SafetensorsFiles(model_dirs["bf16"])
    emb = files.rows("model.embed_tokens.weight", (len(TOK), 64), 3, 9)
    assert emb.shape == (6, 64) and emb.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(18, 64\), the model's is \(19, 64\)"):
        files.rows("model.embed_tokens.weight", (19, 64), 0, 1)


def test_a_whole_model_and_the_skeleton_agree_on_the_random_init() -> None:
    sk = model_skeleton(ModelConfig(), TOK, 11)
    _same(_whole(sk.weights, sk.model), {n: p.detach() for n, p in load_model(ModelConfig(), TOK, 11).named_parameters()})


# ------------------------------------------------------------ an fsdp engine's shard, rank by rank
# torch's fake process group gives one process any rank of a world: FSDP2 lays out that rank's
# shard (its collectives do nothing), so each rank's rows are checked here without launching ranks.

TOK19 = build_char_tokenizer("0123456789+-*=a")  # 19 tokens: an embedding that splits unevenly


@contextmanager
def fake_world(rank: int, size: int) -> Iterator[Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield DeviceMesh("cpu", torch.arange(size), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def _engine(cfg: ModelConfig, head: str, trainable: bool, mesh: Any, args: FSDPArgs | None = None) -> Any:
    from rlbatch.engines.fsdp.engine import FSDPEngine

    return FSDPEngine(EngineContext("x", args or FSDPArgs(), cfg, AlgoConfig(), TOK19, torch.device("cpu"), 5, mesh, trainable, head))


def _holds_its_rows(e: Any, whole: torch.nn.Module, rank: int, size: int, what: str) -> None:
    want = dict(whole.named_parameters())
    assert [n for n, _ in e.model.named_parameters()] == list(want), what
    for name, p in e.model.named_parameters():
        assert isinstance(p, DTensor), (what, name)
        rows = -(-p.shape[0] // size)  # FSDP2's chunk: ceil(n / d) rows a rank, the last ones the rest
        lo, hi = min(rank * rows, p.shape[0]), min((rank + 1) * rows, p.shape[0])
        local = p.to_local()
        assert local.dtype == want[name].dtype and torch.equal(local, want[name].detach()[lo:hi]), (what, name, rank)
    for (name, b), (_, wb) in zip(e.model.named_buffers(), whole.named_buffers(), strict=True):
        assert torch.equal(b, wb), (what, name)  # the rotary tables survive the move to memory


SHARD_CONFIGS = {"qwen2-tied": {}, "llama-untied": {"arch": "llama", "tie_word_embeddings": False},
                 "qwen2-moe": {"arch": "qwen2_moe"}}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("config", sorted(SHARD_CONFIGS))
def test_each_rank_holds_its_rows_of_the_model_built_whole(config: str, size: int) -> None:
    """Random init: every rank's shard of the policy (trained and forward-only), its value head and
    its reward head are the rows of the model the other engines build whole; a tied head stays tied."""
    cfg = ModelConfig(**SHARD_CONFIGS[config])
    for head, trainable in [("lm", True), ("lm", False), ("value", True), ("reward", False)]:
        whole = load_engine_model(EngineContext("x", None, cfg, AlgoConfig(), TOK19, torch.device("cpu"), 5, head=head))
        for rank in range(size):
            with fake_world(rank, size) as mesh:
                e = _engine(cfg, head, trainable, mesh)
                _holds_its_rows(e, whole, rank, size, f"{config} {head} rank {rank}/{size}")
                if head == "lm" and cfg.tie_word_embeddings:
                    assert e.model.lm_head.weight is e.model.model.embed_tokens.weight


def test_each_rank_reads_its_rows_of_a_model_directory(tmp_path: Path) -> None:
    """One safetensors file or several (an index), a causal LM and a reward model of its own: each
    rank's shard is those rows of the model transformers loads, one FSDP unit or one per layer."""
    from transformers import AutoModelForCausalLM

    lm = load_model(ModelConfig(tie_word_embeddings=False), TOK19, 9)
    lm.save_pretrained(tmp_path / "one")
    lm.save_pretrained(tmp_path / "many", max_shard_size="100KB")
    from rlbatch.engines.model import reward_model

    reward_model(lm, 3).save_pretrained(tmp_path / "rm")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    for d in ("one", "many", "rm"):
        TOK19.save_pretrained(tmp_path / d)
    for d, head, trainable in [("one", "lm", True), ("many", "lm", False), ("many", "value", True), ("rm", "reward", False)]:
        cfg = ModelConfig(path=str(tmp_path / d))
        whole = (AutoModelForCausalLM.from_pretrained(tmp_path / d) if head == "lm" else
                 load_engine_model(EngineContext("x", None, cfg, AlgoConfig(), TOK19, torch.device("cpu"), 5, head=head)))
        for rank in range(2):
            with fake_world(rank, 2) as mesh:
                args = FSDPArgs(single_unit_max_mb=0 if d == "many" else 64)
                _holds_its_rows(_engine(cfg, head, trainable, mesh, args), whole, rank, 2, f"{d} {head} rank {rank}")


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_building_a_shard_never_holds_the_whole_model() -> None:
    """The peak resident set (VmHWM, reset through clear_refs) while rank 0 of 2 builds a 232 MiB
    fp32 model (61M parameters): its shard, half the model (116 MiB), plus transients of one
    tensor's rows (at most half a 4096 x 1024 MLP matrix, 8 MiB) and one random-init block (4 MiB).
    Building the whole model and then sharding it (what the engine did before) peaks at the whole
    model and more. The bound, three quarters of the model (174 MiB), sits ~45 MiB above the first
    and ~60 MiB below the second (measured: 130-145 MiB, and 261 MiB before)."""
    import gc

    cfg = ModelConfig(hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=8)
    with fake_world(0, 2) as mesh:
        _engine(ModelConfig(), "lm", True, mesh)  # imports and lazy initialisation first
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        e = _engine(cfg, "lm", True, mesh)
        grew = _status("VmHWM") - before
        full = sum(4 * p.numel() for p in e.model.parameters())
    assert 230 << 20 < full < 235 << 20, full
    assert grew < 0.75 * full, f"building a {full >> 20} MiB model peaked {grew >> 20} MiB above the start"


# ------------------------------------------------------------ the dtype an fsdp engine holds


def test_forward_only_engines_hold_the_models_dtype_trainable_ones_fp32_masters() -> None:
    """On a GPU ('auto' is bf16 there) a forward-only fsdp engine holds bf16 parameters, a trainable
    one fp32 master weights; on a CPU both fp32. The decision, for a device that need not exist."""
    from rlbatch.engines.fsdp.engine import held_dtype

    cuda, cpu = torch.device("cuda", 3), torch.device("cpu")
    assert held_dtype("auto", cuda, trainable=False) == torch.bfloat16
    assert held_dtype("auto", cuda, trainable=True) == torch.float32
    assert held_dtype("auto", cpu, trainable=False) == torch.float32
    assert held_dtype("fp16", cuda, trainable=False) == torch.float16
    assert held_dtype("bf16", cpu, trainable=True) == torch.float32


def test_a_forward_only_fsdp_engine_holds_bf16_and_computes_the_whole_models_logprobs(one_rank_mesh: Any) -> None:
    """The engine itself on CPU with the model's dtype set to bf16 (what 'auto' is on a GPU): the
    reference holds bf16 shards (half the bytes to keep and to offload), the trainable policy fp32;
    the reference's log-probs are the bf16 model's, and after them it holds only its shards."""
    from rlbatch.engines.fsdp.engine import FSDPEngine

    cfg = ModelConfig(dtype="bf16")
    ref = FSDPEngine(_ctx(cfg, "lm", trainable=False, mesh=one_rank_mesh))
    actor = FSDPEngine(_ctx(cfg, "lm", trainable=True, mesh=one_rank_mesh))
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    whole = load_model(cfg, TOK, 7, torch.bfloat16)
    _same({n: p.full_tensor() for n, p in ref.model.named_parameters()}, {n: p.detach() for n, p in whole.named_parameters()})
    sample = {"prompt": torch.tensor([1, 5, 15, 6, 17]), "response": torch.tensor([9, 2])}
    got = ref.logprobs([sample])[0]
    # Nothing stays gathered after the pass: FSDP2 would keep the root unit (here the whole model)
    # unsharded for a backward that a forward-only role never runs.
    assert all(isinstance(p, DTensor) for p in ref.model.parameters())
    with torch.no_grad():
        logits = whole(torch.cat([sample["prompt"], sample["response"]])[None]).logits[0, 4:6].float()
    want = torch.log_softmax(logits, -1).gather(1, sample["response"][:, None])[:, 0]
    assert torch.allclose(got.float(), want, atol=0.05), (got, want)  # bf16 logits: 2**-8 relative each

