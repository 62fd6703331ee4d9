"""Without a GPU and without the test-only shim, the megatron engine refuses to start, saying how to run."""

from __future__ import annotations

import pytest
import torch

from rlbatch.engines.train import megatron_device


def test_cpu_without_the_shim_is_refused_naming_the_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_device, "CPU_SHIM", None)
    with pytest.raises(RuntimeError) as e:
        megatron_device.check_device(torch.device("cpu"))
    assert "needs CUDA" in str(e.value) and "fsdp:dN" in str(e.value)
    assert "plugins=[tests.plugins.megatron_cpu]" in str(e.value)
    megatron_device.check_device(torch.device("cuda", 0))  # a GPU rank is accepted
    monkeypatch.setattr(megatron_device, "CPU_SHIM", "tests.plugins.megatron_cpu")
    megatron_device.check_device(torch.device("cpu"))  # with the shim installed, CPU is accepted
