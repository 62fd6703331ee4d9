"""The device each process of a GPU job selects, from what it sees (torch.cuda faked: no GPU here)."""

from __future__ import annotations

import pytest
import torch

from rlbatch.placement import ProcessKind, place
from rlbatch.runtime.world import pick_device

EIGHT_GPUS = place({"cluster": {"gpus_per_node": 8}, "roles": {
    "actor_train": {"device_mapping": list(range(8)), "backend": "fsdp:d8"},
    "actor_infer": {"device_mapping": list(range(8)), "backend": "hf:d8"},
    "reward": {"world_size": 1},
}})


@pytest.fixture
def selected(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The devices this process selects; torch.cuda sees 8 GPUs until a test says otherwise."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_a_rank_that_sees_every_gpu_of_its_node_takes_its_local_gpu(selected: list[int]) -> None:
    slot = EIGHT_GPUS.processes[5]
    assert pick_device(EIGHT_GPUS, slot, "auto", None) == torch.device("cuda", 5)
    assert selected == [5]


def test_a_rank_bound_to_one_gpu_takes_the_only_device_it_sees(selected: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """srun --gpus-per-task=1: GPU rank 5's process sees its GPU as device 0 (CUDA_VISIBLE_DEVICES=5)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device(EIGHT_GPUS, EIGHT_GPUS.processes[5], "cuda", "5") == torch.device("cuda", 0)
    assert selected == [0]


def test_a_placement_that_uses_part_of_a_node_needs_only_those_gpus_visible(selected: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    two = place({"cluster": {"gpus_per_node": 8}, "roles": {"actor_train": {"device_mapping": [0, 1], "backend": "fsdp:d2"},
                                                            "actor_infer": {"device_mapping": [0, 1], "backend": "hf:d2"}}})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # --gres=gpu:2 of a larger node
    assert pick_device(two, two.processes[1], "cuda", "0,1") == torch.device("cuda", 1)
    assert selected == [1]


@pytest.mark.parametrize(("visible", "cuda_visible_devices"), [(4, "0,1,2,3"), (1, None), (0, "")])
def test_any_other_view_of_the_node_is_refused_with_the_numbers(
        selected: list[int], monkeypatch: pytest.MonkeyPatch, visible: int, cuda_visible_devices: str | None) -> None:
    """Four of eight GPUs, or one GPU without a binding that says this task owns it (a node with
    fewer GPUs than the placement puts on it): two ranks would share a device, or ask for one
    the process cannot see."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(RuntimeError) as e:
        pick_device(EIGHT_GPUS, EIGHT_GPUS.processes[5], "cuda", cuda_visible_devices)
    assert f"local GPU 5) sees {visible} CUDA device(s) with CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}" in str(e.value)
    assert "uses 8 GPUs on its node" in str(e.value)
    assert selected == []


def test_the_controller_and_cpu_workers_never_select_a_gpu(selected: list[int]) -> None:
    cpu_slots = [s for s in EIGHT_GPUS.processes if s.kind is not ProcessKind.GPU]
    assert [s.kind for s in cpu_slots] == [ProcessKind.CPU, ProcessKind.CONTROLLER]
    for slot in cpu_slots:
        assert pick_device(EIGHT_GPUS, slot, "cuda", "0,1,2,3,4,5,6,7") == torch.device("cpu")
    assert selected == []
