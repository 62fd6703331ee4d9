"""Hardware profiles: every one loads, overrides apply, and published numbers carry a source."""

from __future__ import annotations

import re

import pytest

from rlbatch.config.hardware import DEVICE_PROFILES, HARDWARE_DIR, available, load_hardware, profile_for_device
from rlbatch.errors import ConfigError


@pytest.mark.parametrize("name", available())
def test_every_profile_loads(name: str) -> None:
    hw = load_hardware(name)
    assert hw.name == name and hw.peak_flops > 0 and hw.hbm_bytes > 0 and hw.usable_bytes > 0


def test_the_profiles_the_issue_names_exist() -> None:
    assert {"h100_sxm", "h200", "a100_80g", "cpu"} <= set(available())


@pytest.mark.parametrize("name", ["h100_sxm", "h200", "a100_80g"])
def test_gpu_datasheet_numbers_cite_a_source(name: str) -> None:
    text = (HARDWARE_DIR / f"{name}.yaml").read_text()
    assert len(re.findall(r"https?://", text)) >= 1
    for key in ("peak_flops", "hbm_bw", "intra_bw", "pcie_bw", "inter_bw", "host_ram_bytes"):
        assert re.search(rf"^{key}:", text, re.M), key


def test_cpu_profile_says_how_it_was_measured() -> None:
    assert "python -m rlbatch.plan.measure" in (HARDWARE_DIR / "cpu.yaml").read_text()
    assert load_hardware("cpu").cores_per_node >= 1


def test_overrides_and_errors() -> None:
    assert load_hardware("h100_sxm", {"hbm_bytes": "40e9"}).hbm_bytes == 40e9
    with pytest.raises(ConfigError, match="no profile 'tpu'"):
        load_hardware("tpu")
    with pytest.raises(ConfigError, match="unknown field"):
        load_hardware("h100_sxm", {"warp_speed": 9})
    with pytest.raises(ConfigError, match="is not a float"):
        load_hardware("h100_sxm", {"hbm_bw": "fast"})


def test_cuda_device_names_pick_their_profile_and_near_misses_pick_none() -> None:
    assert profile_for_device("NVIDIA H100 80GB HBM3") == "h100_sxm"
    assert profile_for_device("NVIDIA H200") == "h200"
    assert profile_for_device("NVIDIA A100-SXM4-80GB") == "a100_80g"
    # Same chip, lower clocks or bandwidth: the SXM profile would overstate the limits.
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-40GB"):
        assert profile_for_device(name) is None
    assert set(DEVICE_PROFILES.values()) <= set(available())


def test_measure_helpers_run_on_this_machine() -> None:
    """The measurements behind cache_bw and the planner's per-sample constants (small sizes)."""
    from rlbatch.plan import measure

    assert measure.cache_bw(1 << 16) > 1e8
    host = measure.per_sample_host(64)
    assert set(host) == {"generate", "logprobs", "train"} and all(0 < v < 1e-2 for v in host.values())
    assert 0 < measure.attention_problem(seqs=32) < 1e-3
