"""Every launcher gives every rank the environment the config asks for; ``cluster.network_interface``
(NCCL's and gloo's socket interface) is validated before anything starts and cannot add a line to
the sbatch script."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from omegaconf import open_dict

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.errors import ConfigError
from rlbatch.launch.local import local_env
from rlbatch.launch.prepare import RANK_ENV
from rlbatch.launch.prepare import main as prepare

IFNAME = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}


def test_local_ranks_get_the_network_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in IFNAME:
        monkeypatch.delenv(var, raising=False)
    env = local_env(compose(["cluster.network_interface=ib0", "+cluster.env.NCCL_DEBUG=WARN"]))
    assert env.items() >= (IFNAME | {"NCCL_DEBUG": "WARN"}).items()
    assert not IFNAME.keys() & local_env(compose([])).keys()  # unset: NCCL and gloo choose


def test_a_hand_written_sbatch_script_sources_the_same_environment(run_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """slurm/rlbatch.sbatch sources <run_dir>/rank_env.sh, which prepare writes from the config."""
    run = run_root / "run"
    assert prepare(["program=selftest", "cluster=slurm", f"run_dir={run}", "cluster.network_interface=ib0",
                    "+cluster.env.MY_VAR='a \"b\" $x'"]) == 0
    assert capsys.readouterr().out.strip() == str(run)
    shown = subprocess.run(["bash", "-c", f"source {run / RANK_ENV} && env"], capture_output=True, text=True, check=True)
    env = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    assert env.items() >= (IFNAME | {"MY_VAR": 'a "b" $x', "RLBATCH_RUN_DIR": str(run), "MPIR_CVAR_NOLOCAL": "1"}).items()


def slurm_config(**cluster: Any) -> Any:
    """cluster=slurm with the given cluster fields set as they are (no override grammar between)."""
    cfg = compose(["cluster=slurm"])
    with open_dict(cfg):
        for key, value in cluster.items():
            cfg.cluster[key] = value
    return cfg


def problems(**cluster: Any) -> list[str]:
    with pytest.raises(ConfigError) as e:
        check(slurm_config(**cluster), runnable=False)
    return list(e.value.problems)


@pytest.mark.parametrize("name", ["ib0; rm -rf ~", "eth0\nsrun evil", "ib0 eth0", "'ib0'", "$(hostname)",
                                  "a_name_of_16_chr", "^docker", ""])
def test_a_network_interface_that_is_not_one_name_is_refused(name: str) -> None:
    assert problems(network_interface=name) == [
        f"cluster.network_interface: expected one network interface name such as 'ib0' or 'eth0' "
        f"(letters, digits, '_', '.', '-'; at most 15 characters), got {name!r}"]


def test_environment_names_that_are_not_identifiers_are_refused() -> None:
    assert problems(env={"OK_1": "x", "BAD\nsrun evil": "1", "A B": "2"}) == [
        "cluster.env: 'BAD\\nsrun evil' is not an environment variable name (letters, digits, '_')",
        "cluster.env: 'A B' is not an environment variable name (letters, digits, '_')"]


def test_the_interface_set_twice_must_agree() -> None:
    assert problems(network_interface="ib0", env={"GLOO_SOCKET_IFNAME": "eth0"}) == [
        "cluster.env.GLOO_SOCKET_IFNAME='eth0' disagrees with cluster.network_interface='ib0'; set one of them"]
    check(slurm_config(network_interface="ib0", env={"NCCL_SOCKET_IFNAME": "ib0"}), runnable=False)  # the same: fine
