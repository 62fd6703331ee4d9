"""Every YAML under rlbatch/conf/ composes with Hydra and places what it says; bad overrides are
ConfigErrors. Whether this build can run each preset is tests/unit/test_presets.py's subject:
the placement checks here use ``check(cfg, runnable=False)``, as the planner does."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbatch import ConfigError
from rlbatch.checks.validate import check
from rlbatch.config.compose import CONF_DIR, compose


def _default_groups() -> list[str]:
    """The config groups rlbatch/conf/config.yaml composes (other groups serve other tools)."""
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    return [next(iter(d)) for d in defaults if isinstance(d, dict)]


# Discovered, so a new YAML (or a new group in config.yaml) is covered without editing this file.
GROUPS = _default_groups()
GROUP_FILES = sorted((group, path.stem) for group in GROUPS for path in (CONF_DIR / group).glob("*.yaml"))

# Choices that cannot run alone and what they need beside them.
COMPANIONS: dict[tuple[str, str], list[str]] = {}
FILE_DATA = ["model.path=/x", "data.path=/y"]
"""For configs that read a local dataset (data.name=file); nothing is read while validating."""


def compose_choice(group: str, name: str) -> Any:
    overrides = [f"{group}={name}", *COMPANIONS.get((group, name), [])]
    cfg = compose(overrides)
    return compose([*overrides, *FILE_DATA]) if cfg.data.name == "file" else cfg


def test_conf_groups_are_discovered() -> None:
    groups = {g for g, _ in GROUP_FILES}
    assert {"roles", "cluster", "algo", "model", "data", "experiment"} <= groups == set(GROUPS)
    assert len([n for g, n in GROUP_FILES if g == "roles"]) >= 10


def test_the_default_config_validates() -> None:
    p = check(compose([]))
    assert {"actor_train", "actor_infer", "reference"} <= set(p.roles)


@pytest.mark.parametrize(("group", "name"), GROUP_FILES, ids=[f"{g}={n}" for g, n in GROUP_FILES])
def test_every_conf_file_composes_and_places(group: str, name: str) -> None:
    cfg = compose_choice(group, name)
    placement = check(cfg, runnable=False)
    assert placement.num_gpus >= 1
    assert "actor_train" in placement.roles and "actor_infer" in placement.roles


def test_gsm8k_needs_its_paths() -> None:
    with pytest.raises(ConfigError) as e:
        check(compose(["experiment=gsm8k"]), runnable=False)
    text = "\n".join(e.value.problems)
    assert "data.path" in text and "model.path" in text
    check(compose(["experiment=gsm8k", *FILE_DATA]), runnable=False)


# The reference examples under rlbatch/conf/roles must place what their comments promise.
ROLE_EXPECTATIONS = {
    "roll_disaggregated_24gpu": dict(gpus=24, nodes=3, worlds={"actor_train": 16, "actor_infer": 8},
                                     ranks={"actor_train": range(0, 16), "actor_infer": range(16, 24)}),
    "roll_mixed_cpu_sandbox": dict(gpus=16, nodes=2, worlds={"actor_train": 16, "actor_infer": 6, "code_sandbox": 8},
                                   ranks={"actor_train": range(0, 16), "actor_infer": range(0, 12)}),
    "roll_colocated_8gpu": dict(gpus=8, nodes=1, worlds={"actor_train": 8, "actor_infer": 8},
                                ranks={"actor_train": range(8), "actor_infer": range(8)}),
    "roll_disaggregated_8gpu": dict(gpus=8, nodes=1, worlds={"actor_train": 4, "actor_infer": 4},
                                    ranks={"actor_train": range(0, 4), "actor_infer": range(4, 8)}),
    "areal_16gpu": dict(gpus=16, nodes=2, worlds={"actor_train": 8, "actor_infer": 2},
                        ranks={"actor_train": range(8, 16), "actor_infer": range(0, 8)}),
    "areal_megatron_16gpu": dict(gpus=16, nodes=2, worlds={"actor_train": 16}, ranks={"actor_train": range(16)}),
    "areal_moe_hybrid_32gpu": dict(gpus=32, nodes=4, worlds={"actor_train": 32}, ranks={"actor_train": range(32)}),
}


@pytest.mark.parametrize("name", sorted(ROLE_EXPECTATIONS))
def test_reference_role_files_place_what_they_say(name: str) -> None:
    exp = ROLE_EXPECTATIONS[name]
    p = check(compose([f"roles={name}"]), runnable=False)
    assert (p.num_gpus, p.num_nodes) == (exp["gpus"], exp["nodes"])
    for role, world in exp["worlds"].items():
        assert p.role(role).world_size == world, role
    for role, ranks in exp["ranks"].items():
        assert p.role(role).gpu_ranks == tuple(ranks), role


def test_mixed_cpu_sandbox_file_spreads_cpu_workers() -> None:
    p = check(compose(["roles=roll_mixed_cpu_sandbox"]), runnable=False)
    assert p.role("actor_infer").num_gpus_per_worker == 2
    # The controller and the reward worker take one CPU slot on each node; 8 sandboxes split 4/4.
    assert p.role("reward").nodes == (1,)
    assert Counter(p.role("code_sandbox").nodes) == {0: 4, 1: 4}


def test_hybrid_file_reference_inherits_the_hybrid_layout() -> None:
    p = check(compose(["roles=areal_moe_hybrid_32gpu"]), runnable=False)
    assert p.role("reference").backend == p.role("actor_train").backend
    assert p.role("actor_train").backend is not None and p.role("actor_train").backend.is_hybrid


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("roles.actor_train.foo=1", "foo"),
        ("+roles.actor_train.foo=1", "foo"),  # '+' gets past Hydra; place() still refuses it
        ("algo.nope=1", "nope"),
        ("+algo.nope=1", "nope"),
        ("+model.nope=1", "nope"),
        ("+data.nope=1", "nope"),
        ("+nope=1", "nope"),
        ("cluster.gpu_per_node=4", "gpu_per_node"),
        ("+cluster.gpu_per_node=4", "gpu_per_node"),
        ("nope=1", "nope"),
        ("roles=does_not_exist", "does_not_exist"),
        ("cluster.gpus_per_node=eight", "eight"),
        ("algo.lr=fast", "fast"),
        ("roles.actor_train.num_gpus_per_worker=1.5", "1.5"),
    ],
)
def test_bad_overrides_are_config_errors(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        check(compose([override]))
    assert named in str(e.value)


def test_an_unknown_field_is_one_problem_not_a_cascade() -> None:
    with pytest.raises(ConfigError) as e:
        check(compose(["+roles.actor_train.foo=1"]))
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith("roles.actor_train: unknown field(s) ['foo']")


def test_override_errors_reach_check_through_the_config() -> None:
    with pytest.raises(ConfigError, match="listed more than once"):
        check(compose(['roles.actor_train.device_mapping="[0, 0]"']))
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        check(compose(["roles.actor_infer.backend=tgi:d2"]))


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["algo.samples_per_prompt=1"], "needs at least 2 samples per prompt"),
        (["algo=ppo", "roles.critic.enabled=false"], "algo.name=ppo needs the critic role"),
        (["roles.reference.enabled=false"], "algo.kl_coef=0.01 needs the reference role"),
        (["algo.prompts_per_step=3", "algo.samples_per_prompt=3"], "9 samples cannot be split evenly"),
        (["algo.name=dpo"], "algo.name: 'dpo' is not a registered algorithm (program); registered: ['dapo', "),
        (["cluster.name=k8s"], "cluster.name: 'k8s' is not one of"),
        (["algo.top_p=0"], "algo.top_p: must be in (0, 1]"),
        (["cluster.port_range=[80,90]"], "cluster.port_range"),
        (["steps=0"], "steps: must be >= 1, got 0"),
    ],
)
def test_non_placement_problems(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        check(compose(overrides))
    assert any(fragment in p for p in e.value.problems), e.value.problems


def test_conf_dir_is_inside_the_package() -> None:
    import rlbatch

    assert CONF_DIR == Path(rlbatch.__file__).resolve().parent / "conf"
    assert (CONF_DIR / "config.yaml").is_file()
