"""The scheduler environment is read in one place, from one table."""

from __future__ import annotations

import pytest

from rlbatch.runtime.env import VARS, expand_hostlist, read_env


def test_slurm_task_environment() -> None:
    env = read_env({
        "SLURM_JOB_ID": "42", "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "6", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "2", "PMI_RANK": "4",
    })
    assert env.under_slurm
    assert (env.job_id, env.slurm_procid, env.slurm_localid, env.slurm_nodeid) == ("42", 4, 1, 1)
    assert env.slurm_restart_count == 2
    assert env.first_node == "n1"
    assert env.mpi_rank == 4


def test_local_mpiexec_environment() -> None:
    env = read_env({"PMI_RANK": "3", "PMI_SIZE": "4", "RLBATCH_JOB_ID": "local-1"})
    assert not env.under_slurm
    assert (env.mpi_rank, env.mpi_size, env.job_id) == (3, 4, "local-1")
    assert env.slurm_restart_count == 0
    assert env.first_node is None


def test_first_variable_in_the_table_wins() -> None:
    assert VARS["job_id"][0] == "SLURM_JOB_ID"
    env = read_env({"SLURM_JOB_ID": "7", "RLBATCH_JOB_ID": "local-9"})
    assert env.job_id == "7"


@pytest.mark.parametrize(("spec", "hosts"), [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[1-2],b5,c[9-10]", ["a1", "a2", "b5", "c9", "c10"]),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


def test_cpu_device_env_only_for_ranks_on_the_cpu() -> None:
    from rlbatch.runtime.env import CPU_DEVICE_ENV, cpu_device_env

    assert cpu_device_env("cpu") == CPU_DEVICE_ENV and int(CPU_DEVICE_ENV["MALLOC_MMAP_THRESHOLD_"]) >= 1 << 30
    assert cpu_device_env("cuda") == {}
