"""Without a GPU and without the test-only shim, the megatron engine refuses to start, saying how to
run, and validation refuses such a run before anything starts, in the same words."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlbatch.engines.megatron import device as megatron_device


def test_cpu_without_the_shim_is_refused_naming_the_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_device, "CPU_SHIM", None)
    with pytest.raises(RuntimeError) as e:
        megatron_device.check_device(torch.device("cpu"))
    assert "needs CUDA" in str(e.value) and "fsdp:dN" in str(e.value)
    assert "plugins=[tests.plugins.megatron_cpu]" in str(e.value)
    megatron_device.check_device(torch.device("cuda", 0))  # a GPU rank is accepted
    monkeypatch.setattr(megatron_device, "CPU_SHIM", "tests.plugins.megatron_cpu")
    megatron_device.check_device(torch.device("cpu"))  # with the shim installed, CPU is accepted


def test_validation_refuses_cpu_ranks_before_start_with_the_engines_words(
        cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rank would stop with after start-up is refused before anything starts: on ranks that
    run on CPUs (cluster.device=cpu, or auto on cluster=local without a GPU), each role that runs
    the engine by its own backend, once; a GPU run, a Slurm job's unjudged nodes and the shim pass."""
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    monkeypatch.setattr(megatron_device, "CPU_SHIM", None)
    with pytest.raises(RuntimeError) as e:
        megatron_device.check_device(torch.device("cpu"))
    c = set_(cfg, cluster__device="cpu", roles__actor_train__backend="megatron:t2")  # the reference inherits it
    assert problems(c) == [f"roles.actor_train.backend: {e.value}"]
    own = set_(c, roles__reference__backend="megatron:d2")
    assert [p.split(":")[0] for p in problems(own)] == ["roles.actor_train.backend", "roles.reference.backend"]
    check(set_(c, cluster__device="cuda"))
    monkeypatch.setattr(megatron_device, "CPU_SHIM", "tests.plugins.megatron_cpu")
    check(c)
