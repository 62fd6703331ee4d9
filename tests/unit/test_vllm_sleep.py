"""The vllm engine's offload on a GPU, driven against a stand-in for vLLM 0.32's sleep mode (no GPU
or vLLM needed; vLLM's CPU build has no sleep mode). The stand-in keeps vLLM's rules, function by
function, so that a sequence of offloads and reloads ends where it would on a GPU:

- ``CuMem``: ``vllm/device_allocator/cumem.py`` ``CuMemAllocator.sleep / discard / wake_up`` as
  ``sleep_mode_backend.py`` ``CuMemBackend.suspend`` drives it: level 1 copies the weights into
  freshly allocated pinned host memory, level 2 copies nothing; every mapped allocation is unmapped,
  one already asleep keeps its policy; both sleep and wake-up release PyTorch's cached blocks;
  a wake maps the asked tags and restores a copy where there is one (else the contents are lost).
  The ``runtime`` and ``cudagraph`` tags vLLM always backs up and wakes are left out.
- ``Executor``: ``vllm/v1/executor/abstract.py`` ``Executor.sleep / wake_up / discard`` and its
  ``sleeping_tags``: ``sleep`` is ignored (a warning) while the weights sleep; ``wake_up(tags)``
  is ignored whole when nothing sleeps or when any of the tags is awake.
- ``EngineCore``: ``vllm/v1/engine/core.py`` ``EngineCore.sleep / wake_up /
  release_kv_cache_memory``: a sleep of any level pauses the scheduler, which resumes only once
  nothing sleeps; releasing the KV cache needs the pause and everything awake.
- ``StandInLLM``: the ``vllm.LLM`` calls the engine makes (``entrypoints/llm.py``); ``generate``
  refuses what on a GPU hangs (a paused scheduler steps for ever) or reads unmapped or lost memory.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.engines.base import SamplingParams
from rlbatch.engines.offload import StaysResident
from rlbatch.engines.vllm.engine import _NO_SLEEP, VLLMEngine, log
from rlbatch.engines.vllm.world import PrivateWorld

SIZES = {"weights": 300, "kv_cache": 500}
"""Device bytes of each of vLLM's tags."""
TOTAL = 10_000


class Device:
    """A GPU's memory as the engine reads it: ``free`` (``torch.cuda.mem_get_info``) and
    ``cached``, blocks PyTorch's caching allocator holds (``torch.cuda.empty_cache`` frees them)."""

    def __init__(self) -> None:
        self.free, self.cached = TOTAL, 0

    def empty_cache(self) -> None:
        self.free, self.cached = self.free + self.cached, 0


class CuMem:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.mapped = {tag: True for tag in SIZES}
        self.contents: dict[str, str | None] = {"weights": "initial", "kv_cache": "empty"}
        self.backup: dict[str, str | None] = {}
        self.pinned_copies = 0
        """Host copies made by sleeps (each one a fresh pinned allocation in vLLM)."""
        device.free -= sum(SIZES.values())

    def sleep(self, level: int) -> None:
        offload = ("weights",) if level == 1 else ()
        for tag in SIZES:
            if not self.mapped[tag]:
                continue  # asleep already: keeps the policy it fell asleep with
            if tag in offload:
                self.backup[tag], self.pinned_copies = self.contents[tag], self.pinned_copies + 1
            self._unmap(tag)
        self.device.empty_cache()

    def discard(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            if self.mapped[tag]:
                self._unmap(tag)

    def wake_up(self, tags: list[str] | None) -> None:
        self.device.empty_cache()
        for tag in SIZES:
            if not self.mapped[tag] and (tags is None or tag in tags):
                self.mapped[tag] = True
                self.device.free -= SIZES[tag]
                self.contents[tag] = self.backup.pop(tag, None)

    def _unmap(self, tag: str) -> None:
        self.mapped[tag], self.contents[tag] = False, None
        self.device.free += SIZES[tag]


class Executor:
    def __init__(self, allocator: CuMem) -> None:
        self.allocator = allocator
        self.sleeping_tags: set[str] = set()
        self.warnings: list[str] = []

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int = 1) -> None:
        if "weights" in self.sleeping_tags:
            self.warnings.append("Executor is already sleeping.")
            return
        self.allocator.sleep(level)
        self.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.is_sleeping:
            self.warnings.append("Executor is not sleeping.")
            return
        for tag in tags or ():
            if tag not in self.sleeping_tags:
                self.warnings.append(f"Tag {tag} is not in sleeping tags {self.sleeping_tags}")
                return
        self.allocator.wake_up(tags)
        self.sleeping_tags = self.sleeping_tags - set(tags) if tags else set()

    def discard(self, tags: tuple[str, ...]) -> None:
        fresh = set(tags) - self.sleeping_tags
        if not fresh:
            self.warnings.append(f"Tags {tags} are already sleeping.")
            return
        self.allocator.discard(tuple(fresh))
        self.sleeping_tags |= fresh


class EngineCore:
    def __init__(self, executor: Executor) -> None:
        self.model_executor = executor
        self.paused = False

    def sleep(self, level: int = 1) -> None:
        self.paused = True
        if level >= 1:
            self.model_executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is not None:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.model_executor.wake_up(tags)
        fully_awake = not self.model_executor.is_sleeping
        if fully_awake:
            self.paused = False
        return fully_awake

    def release_kv_cache_memory(self) -> None:
        if not self.paused:
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        if self.model_executor.is_sleeping:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident")
        self.model_executor.discard(("kv_cache",))


class StandInLLM:
    def __init__(self, device: Device) -> None:
        self.allocator = CuMem(device)
        self.executor = Executor(self.allocator)
        self.core = EngineCore(self.executor)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=self.core))
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return self.core.wake_up(tags)

    def release_kv_cache_memory(self) -> None:
        self.calls.append(("release_kv_cache_memory", None))
        self.core.release_kv_cache_memory()

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))

    def collective_rpc(self, fn: Any, args: tuple[Any, ...]) -> None:
        """The engine's ``_load_bucket`` on the worker: writes into the weights' memory."""
        chunk, first, last = args
        if not self.allocator.mapped["weights"]:
            raise RuntimeError("illegal memory access: weights loaded into unmapped memory")
        if last:
            self.allocator.contents["weights"] = "synced"

    def generate(self, requests: list[Any], sampling: list[Any], use_tqdm: bool = False) -> list[Any]:
        if self.core.paused:
            raise RuntimeError("hang: the scheduler is paused, vLLM would step for ever")
        unmapped = [tag for tag, on in self.allocator.mapped.items() if not on]
        if unmapped:
            raise RuntimeError(f"illegal memory access: {unmapped} unmapped")
        if self.allocator.contents["weights"] is None:
            raise RuntimeError("garbage: generated from weights whose contents were lost")
        self.generated_with = self.allocator.contents["weights"]
        step = {7: SimpleNamespace(logprob=-0.5)}
        return [SimpleNamespace(outputs=[SimpleNamespace(index=i, token_ids=[7], logprobs=[step]) for i in range(s.n)])
                for s in sampling]


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Device:
    d = Device()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (d.free, TOTAL))
    monkeypatch.setattr(torch.cuda, "empty_cache", d.empty_cache)
    # The engine's generate imports vLLM's request types; vLLM itself takes ~30 s to import here.
    stub, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    sampling = types.ModuleType("vllm.sampling_params")
    stub.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs.TokensPrompt = lambda **kw: kw  # type: ignore[attr-defined]
    sampling.RequestOutputKind = SimpleNamespace(CUMULATIVE=0, DELTA=1, FINAL_ONLY=2)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", stub)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    return d


@pytest.fixture
def engine(device: Device) -> VLLMEngine:
    e = object.__new__(VLLMEngine)
    e.llm, e.on_cpu, e.device, e.world = StandInLLM(device), False, torch.device("cuda", 0), PrivateWorld()
    e.expected, e._received = {"a", "b"}, set()
    e._weights_lost, e._resident = False, StaysResident(log, _NO_SLEEP)
    e._asleep = set()  # type: ignore[attr-defined]  # the record an engine kept before it read vLLM's tags
    return e


def generate(engine: VLLMEngine) -> str:
    """One generation; returns which weights vLLM generated with."""
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1, temperature=1.0))
    assert [g.tokens for g in out] == [[7]]
    return str(engine.llm.generated_with)


def sync(engine: VLLMEngine) -> None:
    """A weight sync's buckets: the last completes the model's names."""
    engine.load_weights([("a", torch.zeros(2))])
    engine.load_weights([("b", torch.zeros(2))])


def mapped(engine: VLLMEngine) -> dict[str, bool]:
    return dict(engine.llm.allocator.mapped)


ALL = ("params", "kv_cache")


def test_a_colocated_run_start_generate_train_sync_checkpoint_generate(engine: VLLMEngine, device: Device) -> None:
    """The calls a colocated rank makes: put away after start, woken for generate, put away for
    the trainer, the weights woken for the sync, put away again for a checkpoint, woken for the
    next generate. vLLM's memory follows each call, and both generations ran on mapped memory
    with the weights of their time."""
    assert engine.offload(ALL).bytes == 800 and device.free == TOTAL  # start-up: before the trainer builds
    engine.reload(ALL)
    assert generate(engine) == "initial"
    engine.offload(ALL)  # train
    engine.reload(("params",))  # sync: the weights, not the KV cache
    assert mapped(engine) == {"weights": True, "kv_cache": False}
    sync(engine)
    assert engine.offload(ALL).bytes == 300  # checkpoint: the weights go too
    assert mapped(engine) == {"weights": False, "kv_cache": False}
    assert engine.reload(ALL).bytes == 800
    assert generate(engine) == "synced"
    assert engine.llm.executor.warnings == []


def test_vllm_is_never_left_with_the_weights_asleep_and_the_kv_cache_awake(engine: VLLMEngine) -> None:
    """A KV cache woken alone leaves vLLM with the weights asleep; a later sleep is then ignored by
    vLLM, and a wake of both tags too (the KV cache is not asleep): a record of the calls made says
    all is awake while the weights are unmapped and the scheduler paused. The engine wakes the
    weights with the KV cache and reads what sleeps from vLLM."""
    engine.offload(ALL)
    engine.reload(("kv_cache",))
    engine.offload(ALL)
    assert mapped(engine) == {"weights": False, "kv_cache": False}  # the KV cache's memory was given back
    engine.reload(ALL)
    assert generate(engine) == "initial"
    assert engine.llm.executor.warnings == []


def test_the_kv_cache_alone_leaves_without_copying_the_weights(engine: VLLMEngine) -> None:
    """A phase that needs the weights but not the KV cache (a sync) releases the KV cache alone:
    no level-1 sleep, which would copy the weights to host memory only to wake them again."""
    assert engine.offload(("kv_cache",)).bytes == 500
    assert mapped(engine) == {"weights": True, "kv_cache": False} and engine.llm.allocator.pinned_copies == 0
    assert engine.reload(("params",)).bytes == 0  # awake already
    sync(engine)
    engine.reload(ALL)
    assert generate(engine) == "synced"


def test_weights_a_sync_overwrites_are_discarded_and_generate_waits_for_the_sync(engine: VLLMEngine) -> None:
    """``discard``: a level-2 sleep, no host copy. A generate before a complete sync loaded the
    weights again is refused (it would read lost memory); after the sync it runs on them."""
    engine.reload(ALL)
    generate(engine)
    assert engine.discard(("params",)).bytes == 800  # the KV cache goes with them
    assert engine.llm.calls[-1] == ("sleep", 2) and engine.llm.allocator.pinned_copies == 0
    assert engine.offload(("kv_cache",)).bytes == 0
    engine.reload(ALL)
    with pytest.raises(RuntimeError, match="discarded"):
        generate(engine)
    engine.offload(ALL)
    engine.reload(("params",))  # the sync
    engine.load_weights([("a", torch.zeros(2))])
    engine.reload(ALL)
    with pytest.raises(RuntimeError, match="discarded|incomplete weight sync"):
        generate(engine)  # half a sync
    engine.load_weights([("b", torch.zeros(2))])
    assert generate(engine) == "synced"


def test_generate_with_state_asleep_is_refused_not_left_to_hang(engine: VLLMEngine) -> None:
    engine.offload(ALL)
    engine.reload(("params",))
    with pytest.raises(RuntimeError, match=r"kv_cache'\] asleep"):
        generate(engine)


def test_bytes_moved_are_vllms_own_not_pytorchs_cache(engine: VLLMEngine, device: Device) -> None:
    """vLLM's sleep and wake release PyTorch's cached blocks (a trainer's offloaded storage): they
    are not vLLM's bytes."""
    device.cached, device.free = 200, device.free - 200
    assert engine.offload(ALL).bytes == 800
    device.cached, device.free = 100, device.free - 100
    assert engine.reload(ALL).bytes == 800


def test_on_cpu_offload_moves_nothing_and_says_so_once(engine: VLLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    engine.on_cpu = True
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert engine.offload(engine.state_kinds).bytes == 0
            assert engine.reload(engine.state_kinds).bytes == 0
    assert engine.llm.calls == []
    assert sum("no sleep mode" in r.message for r in caplog.records) == 1


def test_expected_names_of_a_model_directory_are_what_a_trainer_exports(tmp_path: Any) -> None:
    """A model.path run knows when a sync is complete from the directory's config alone."""
    from rlbatch.config.compose import compose
    from rlbatch.engines.inference import hf_parameter_names
    from rlbatch.engines.model import load_model, load_tokenizer

    cfg = compose([])
    model = load_model(cfg.model, load_tokenizer(cfg.model), seed=0)
    model.save_pretrained(tmp_path)
    assert hf_parameter_names(SimpleNamespace(path=str(tmp_path))) == {n for n, _ in model.named_parameters()}
