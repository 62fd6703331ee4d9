"""The vllm engine's offload on a GPU, driven against a stand-in for ``vllm.LLM`` (no GPU or vLLM
needed): one ``sleep(level=1)`` puts weights and KV cache away, ``wake_up`` brings back only the
kinds a phase needs, and the prefix cache is reset once the (dropped) KV cache is back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbatch.engines.infer.vllm import VLLMEngine
from rlbatch.engines.infer.vllm_world import PrivateWorld


class FakeLLM:
    def __init__(self, memory: list[int]) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.memory = memory

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.memory[0] += 300

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))
        self.memory[0] -= 100 * len(tags)

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache", None))


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> VLLMEngine:
    free = [1000]  # device memory free, bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 10_000))
    e = object.__new__(VLLMEngine)
    e.llm, e.on_cpu, e.device, e.world = FakeLLM(free), False, torch.device("cuda", 0), PrivateWorld()
    e._asleep, e._warned_no_sleep = set(), False
    return e


def test_offload_sleeps_once_and_reload_wakes_only_what_a_phase_needs(engine: VLLMEngine) -> None:
    out = engine.offload(("params", "kv_cache"))
    assert engine.llm.calls == [("sleep", 1)] and out.bytes == 300
    assert engine.offload(("params",)).bytes == 0 and len(engine.llm.calls) == 1  # already asleep
    back = engine.reload(("params",))  # the sync phase needs only the weights
    assert engine.llm.calls[-1] == ("wake_up", ["weights"]) and back.bytes == 100
    engine.reload(("params", "kv_cache"))  # generate: the KV cache comes back empty
    assert engine.llm.calls[-2:] == [("wake_up", ["kv_cache"]), ("reset_prefix_cache", None)]
    assert engine.reload(("params", "kv_cache")).bytes == 0 and len(engine.llm.calls) == 4


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
    from types import SimpleNamespace

    from rlbatch.engines.infer.vllm import hf_parameter_names
    from rlbatch.engines.model import load_model, load_tokenizer
    from rlbatch.launch.compose import compose

    cfg = compose([])
    model = load_model(cfg.model, load_tokenizer(cfg.model), seed=0)
    model.save_pretrained(tmp_path)
    assert hf_parameter_names(SimpleNamespace(path=str(tmp_path))) == {n for n, _ in model.named_parameters()}
