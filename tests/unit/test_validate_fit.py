"""``hardware=<profile>`` at launch: check() runs the planner's memory prediction and refuses a
placement that does not fit, naming the GPU, its roles, the phase and the bytes; without a
profile nothing is predicted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.config.hardware import available, load_hardware
from rlbatch.config.hardware_section import HardwareConfig
from rlbatch.config.parse import parse
from rlbatch.errors import ConfigError
from tests.unit.configs import default_config, problems
from tests.unit.test_presets import refusal

GiB = float(1 << 30)

# PPO on a 6.5B-parameter model: the actor (and reference) sharded over GPUs 0-1, the critic alone
# and unsharded on GPU 2, where its bf16 params and grads plus fp32 Adam state (16 bytes a
# parameter, ~97 GiB) cannot fit an H100's 80 GiB.
BIG_PPO = [
    "algo=ppo", "roles=disaggregated",
    "roles.actor_train.device_mapping=[0,1]", "roles.actor_train.backend=fsdp:d2",
    "roles.reference.device_mapping=[0,1]",
    "roles.critic.device_mapping=[2]", "roles.critic.backend=fsdp:d1",
    "model.hidden_size=4096", "model.intermediate_size=11008", "model.num_layers=32",
    "model.num_heads=32", "model.num_kv_heads=8",
]
OOM = re.compile(r"hardware=h100_sxm: OOM on GPU rank 2 \(critic\): phase critic_train needs ([\d.]+) GiB > "
                 r"([\d.]+) GiB usable \(80\.0 GiB h100_sxm minus ([\d.]+) GiB reserved\)")


def test_the_default_experiment_fits_an_h100() -> None:
    assert check(compose(["hardware=h100_sxm"])).num_gpus == 2


def test_the_default_experiment_is_predicted_too_and_refused_on_a_gpu_with_nothing_usable() -> None:
    with pytest.raises(ConfigError) as e:
        check(compose(["hardware=h100_sxm", "hardware.reserved_bytes=85899345920"]))
    lines = e.value.problems
    assert len(lines) == 1, lines  # colocated: both GPUs hold the same roles
    assert lines[0].startswith("hardware=h100_sxm: OOM on GPU ranks 0-1 (actor_train, actor_infer, reference): phase ")
    assert "> 0.0 GiB usable (80.0 GiB h100_sxm minus 80.0 GiB reserved)" in lines[0]


def test_a_critic_that_cannot_fit_its_gpu_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    lines = refusal(capsys, ["hardware=h100_sxm", *BIG_PPO])
    assert len(lines) == 1, lines  # the actor, sharded over two GPUs, fits
    m = OOM.match(lines[0])
    assert m is not None, lines
    needed, usable, reserved = (float(g) for g in m.groups())
    hw = load_hardware("h100_sxm")
    assert usable == round(hw.usable_bytes / GiB, 1) and reserved == round(hw.reserved_bytes / GiB, 1)
    params = 4096 * 32 * (2 * 4096 + 2 * 1024 + 3 * 11008)  # attention and MLP weights, without embeddings
    assert needed > 16 * params / GiB > usable  # bf16 params + grads, fp32 master, two Adam moments
    assert "largest term: critic optimizer" in lines[0]


def test_without_a_hardware_profile_nothing_is_predicted() -> None:
    assert check(compose(BIG_PPO)).roles["critic"].gpu_ranks == (2,)


def test_the_cpu_profile_checks_the_node_ram() -> None:
    assert check(compose(["hardware=cpu"])).num_gpus == 2
    with pytest.raises(ConfigError) as e:
        check(compose(["hardware=cpu", "hardware.host_ram_bytes=1e9"]))
    assert len(e.value.problems) == 1 and re.match(
        r"hardware=cpu: host RAM: the busiest node needs [\d.]+ GiB .* > 0\.9 GiB per node", e.value.problems[0]), e.value.problems


def test_a_hardware_choice_outside_the_profiles_is_refused_naming_them(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``hardware=../model/tiny`` names a file of another group: Hydra would compose the model's
    fields into the hardware section, where nothing reads them."""
    profiles = available()
    assert refusal(capsys, ["hardware=../model/tiny"]) == [
        f"hardware: '../model/tiny' is not one of the presets in rlbatch/conf/hardware: {profiles}"]
    with pytest.raises(ConfigError, match=re.escape(f"hardware: no profile '../model/tiny'; available: {profiles}")):
        load_hardware("../model/tiny")  # the planner's hardware=<name>
    # The same section in a plain config (a run's config.yaml, the planner's candidates).
    tiny = default_config(tmp_path) | {"hardware": {"path": None, "arch": "qwen2", "hidden_size": 64}}
    (line,) = problems(tiny, runnable=False)
    assert line.startswith(f"hardware: unknown field(s) ['arch', 'hidden_size']: not a hardware profile (a profile is "
                           f"chosen with hardware=<name>, one of {profiles}); known fields: ['cache_bw', "), line
    (line,) = problems(default_config(tmp_path) | {"hardware": {"name": "../model/tiny"}}, runnable=False)
    assert line.startswith(f"hardware.name: '../model/tiny' is not a profile of rlbatch/conf/hardware (one of "
                           f"{profiles}); a profile of its own gives every field, missing ['kind', "), line


def test_memory_figures_without_a_profile_feed_the_vllm_checks_and_other_fields_are_refused() -> None:
    """docs/planner.md: without a profile name, host_ram_bytes and hbm_bytes alone (they feed the
    vLLM memory checks; nothing is predicted); any other field needs a profile."""
    cfg = compose(["+hardware.hbm_bytes=40e9", "+hardware.host_ram_bytes=1e12"])
    assert parse(cfg).config.hardware == HardwareConfig(None, host_ram_bytes=1e12, hbm_bytes=40e9)
    check(cfg)
    assert check(compose([])).num_gpus == 2 and parse(compose([])).config.hardware is None
    with pytest.raises(ConfigError) as e:
        check(compose(["+hardware.peak_flops=1e15"]))
    assert e.value.problems == [
        f"hardware: peak_flops=1000000000000000.0 without a profile name: without one only ['host_ram_bytes', "
        f"'hbm_bytes'] are read (by the vLLM memory checks); a profile is chosen with hardware=<name>, one of "
        f"{available()}, to predict with its fields"]
    with pytest.raises(ConfigError) as e:
        check(compose(["+hardware.hbm_bytes=-1"]))
    assert e.value.problems == ["hardware.hbm_bytes: must be > 0, got -1"]
    profile = parse(compose(["hardware=h100_sxm", "hardware.hbm_bytes=40e9"])).config.hardware
    assert profile is not None and profile.profile == load_hardware("h100_sxm", {"hbm_bytes": 40e9})
    assert profile.hbm_bytes == 40e9 and profile.host_ram_bytes == load_hardware("h100_sxm").host_ram_bytes
