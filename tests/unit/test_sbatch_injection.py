"""A config value can only ever be the value of its own line in the sbatch script.

Every field that reaches the script, the srun command line in it or ``rank_env.sh`` is tried with
a hostile value: ``check`` refuses it before anything starts, naming the field and the character
(rlbatch.checks.cluster_rules). The script writer refuses the same values on its own when they
reach it some other way. The legal unusual values are in tests/unit/test_sbatch_golden.py's
``unusual_but_legal`` golden file.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf, open_dict

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.errors import ConfigError
from rlbatch.launch import prepare
from rlbatch.launch.__main__ import main as launch_main
from rlbatch.launch.slurm import export_lines, sbatch_script, submit

RUN_DIR = "/shared/runs/example"
NEWLINE = "the control character '\\n'"

HOSTILE: list[tuple[str, Any, str, str]] = [  # field set, value, field named, words in the message
    ("cluster.partition", "gpu\n#SBATCH --wrap=x", "cluster.partition", NEWLINE),
    ("cluster.partition", "gpu;touch x", "cluster.partition", "(' ;' not allowed)"),  # ';' and ' ': neither is Slurm's
    ("cluster.partition", "gpu,", "cluster.partition", "several separated by ','"),
    ("cluster.account", "proj\n#SBATCH --nodes=99", "cluster.account", NEWLINE),
    ("cluster.account", "proj one", "cluster.account", "(' ' not allowed)"),
    ("cluster.qos", "high\rx", "cluster.qos", "the control character '\\r'"),
    ("cluster.constraint", "a100\\\nx", "cluster.constraint", "a backslash"),
    ("cluster.constraint", "a100 && touch x", "cluster.constraint", "(' ' not allowed)"),
    ("cluster.job_name", "a\ntouch /tmp/x #", "cluster.job_name", NEWLINE),
    ("cluster.job_name", "a\\'b", "cluster.job_name", "a backslash"),
    ("cluster.job_name", "a\u2028b", "cluster.job_name", "the control character '\\u2028'"),
    ("cluster.mpi", "pmi2 --export=NONE", "cluster.mpi", "(' -=ENO' not allowed)"),
    ("cluster.sbatch_args", {"comment": "x\n#SBATCH --nodes=9"}, "cluster.sbatch_args.comment", NEWLINE),
    ("cluster.sbatch_args", {"comment": "x\\y"}, "cluster.sbatch_args.comment", "a backslash"),
    ("cluster.sbatch_args", {"a\n#SBATCH --wrap": "x"}, "cluster.sbatch_args", "is not an sbatch option name"),
    ("cluster.sbatch_args", {"exclusive\ntouch x #": True}, "cluster.sbatch_args", "is not an sbatch option name"),
    ("cluster.sbatch_args", {"Exclusive": True}, "cluster.sbatch_args", "is not an sbatch option name"),
    ("cluster.sbatch_args", {"wrap": "touch x"}, "cluster.sbatch_args.wrap", "rlbatch writes --wrap itself"),
    ("cluster.sbatch_args", {"nodes": 3}, "cluster.sbatch_args.nodes", "(from the placement)"),
    ("cluster.sbatch_args", {"ntasks_per_n": 3}, "cluster.sbatch_args.ntasks_per_n", "--ntasks-per-node itself"),
    ("cluster.sbatch_args", {"output": "/tmp/x"}, "cluster.sbatch_args.output", "--output itself"),
    ("cluster.sbatch_args", {"exclusive": False}, "cluster.sbatch_args.exclusive", "remove the key"),
    ("cluster.srun_args", ["--cpu-bind=none\ntouch x"], "cluster.srun_args[0]", NEWLINE),
    ("cluster.container_image", "img\ntouch x", "cluster.container_image", NEWLINE),
    ("cluster.container_mounts", "/a:/b\x00", "cluster.container_mounts", "the control character '\\x00'"),
    ("cluster.env", {"NOTES": "a\n#SBATCH --wrap=x"}, "cluster.env.NOTES", NEWLINE),
    ("cluster.env", {"A B": "x"}, "cluster.env", "is not an environment variable name"),
    ("cluster.network_interface", "ib0\nx", "cluster.network_interface", "one network interface name"),
    ("cluster.setup", ["#SBATCH --nodes=9"], "cluster.setup[0]", "which sbatch would read as a directive"),
    ("cluster.setup", ["module load x\n#PBS -q other"], "cluster.setup[0]", "'#PBS'"),
    ("cluster.setup", ["  #SBATCH --partition=other"], "cluster.setup[0]", "'#SBATCH'"),
    ("cluster.setup", ["echo \x1b[2J"], "cluster.setup[0]", "the control character '\\x1b'"),
    ("cluster.setup", ["echo 'open"], "cluster.setup", "is not complete shell by itself"),
    ("cluster.setup", ["if true; then"], "cluster.setup", "is not complete shell by itself"),
    ("cluster.setup", ["cat <<EOF"], "cluster.setup", "is not complete shell by itself"),
    ("cluster.setup", ["module load x \\"], "cluster.setup", "ends in a backslash"),
    ("run_dir", "/shared/runs/a\n#SBATCH --wrap=x", "run_dir", NEWLINE),
    ("run_dir", "/shared/runs/100%", "run_dir", "Slurm expands it in log file names"),
    ("run_dir", "/shared/runs/a\\b", "run_dir", "a backslash"),
    ("cluster.mem_gb", -1, "cluster.mem_gb", "-1"),  # the schema's range checks
]


@functools.cache
def _base() -> Any:
    return compose(["cluster=slurm", f"run_dir={RUN_DIR}"])


def slurm_config(**fields: Any) -> Any:
    cfg = copy.deepcopy(_base())  # composing takes most of a test's time
    with open_dict(cfg):
        for key, value in fields.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


@pytest.mark.parametrize(("field", "value", "named", "words"), HOSTILE,
                         ids=[f"{f}={v!r}"[:60] for f, v, _, _ in HOSTILE])
def test_a_hostile_value_is_refused_naming_its_field(field: str, value: Any, named: str, words: str) -> None:
    cfg = slurm_config(**{field: value})
    with pytest.raises(ConfigError) as e:
        check(cfg, runnable=False)
    mine = [p for p in e.value.problems if p.startswith(f"{named}:") or p.startswith(f"{named}.")]
    assert mine and any(words in p for p in mine), e.value.problems


def test_the_same_fields_are_free_on_a_local_run() -> None:
    # Nothing of cluster=local goes into a script: its env reaches mpiexec as a dict.
    cfg = compose([f"run_dir={RUN_DIR}", "cluster.partition='a b'", "cluster.job_name='x\ny'"])
    check(cfg, runnable=False)


def test_the_script_writer_refuses_what_the_check_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rlbatch.checks.validate.cluster_problems", lambda cfg: [])
    cfg = slurm_config(**{"cluster.partition": "gpu\n#SBATCH --wrap=x", "cluster.setup": ["#SBATCH --nodes=9"],
                          "cluster.sbatch_args": {"comment": "x\ntouch y"}})
    placement = check(cfg, runnable=False)  # the first line of defence is off
    with pytest.raises(ConfigError) as e:
        sbatch_script(cfg, placement, Path(RUN_DIR))
    assert [p.split(":", 2)[1].strip() for p in e.value.problems] == ["--partition", "option.comment", "setup[0]"]
    # A run directory that only became hostile when it was resolved (a symlink to '/x/100%').
    with pytest.raises(ConfigError, match="run_dir: '/shared/100%' contains '%'"):
        sbatch_script(slurm_config(), check(slurm_config(), runnable=False), Path("/shared/100%"))


def test_submit_refuses_it_before_making_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("rlbatch.checks.validate.cluster_problems", lambda cfg: [])
    run = tmp_path / "run"
    cfg = slurm_config(**{"run_dir": str(run), "cluster.job_name": "x\ntouch y #"})
    assert submit(cfg, check(cfg, runnable=False)) == 2
    assert "  - sbatch script: --job_name: 'x\\ntouch y #' contains the control character" in capsys.readouterr().err
    assert not run.exists()


def test_export_lines_quote_values_and_refuse_what_would_leave_the_line() -> None:
    assert export_lines({"A": "it's $HOME", "B": "x y"}) == ["export A='it'\"'\"'s $HOME'", "export B='x y'"]
    with pytest.raises(ConfigError, match=r"export A: the value 'x\\n#SBATCH --wrap=y' contains"):
        export_lines({"A": "x\n#SBATCH --wrap=y"})
    with pytest.raises(ConfigError, match="not an environment variable name"):
        export_lines({"A=1; touch x; B": "x"})


def test_prepare_writes_no_rank_env_for_a_hostile_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The user's own sbatch file (slurm/rlbatch.sbatch) sources rank_env.sh from prepare.
    run = tmp_path / "run"
    assert prepare.main(["cluster=slurm", f"run_dir={run}", "+cluster.env.NOTES='a\n#SBATCH --wrap=x'"]) == 2
    assert "cluster.env.NOTES: 'a\\n#SBATCH --wrap=x' contains the control character '\\n'" in capsys.readouterr().err
    assert not (run / prepare.RANK_ENV).exists()


def test_the_launcher_refuses_an_injected_partition_before_rendering(capsys: pytest.CaptureFixture[str]) -> None:
    code = launch_main(["dry_run=true", "cluster=slurm", f"run_dir={RUN_DIR}", "cluster.partition='gpu\n#SBATCH --wrap=x'"])
    out, err = capsys.readouterr()
    assert code == 2 and "#SBATCH" not in out
    assert err.splitlines()[1] == f"  - cluster.partition: 'gpu\\n#SBATCH --wrap=x' contains {NEWLINE}, which would end the line in the script"
