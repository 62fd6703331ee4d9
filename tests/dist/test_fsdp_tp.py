"""The fsdp engine with tensor parallelism (``fsdp:dXtY``), context parallelism (``fsdp:dXcZ``) or
both (``fsdp:dXtYcZ``) against data parallelism alone, with gloo on CPU: ``scripts/fsdp_tp.py`` says what each run checks."""

from __future__ import annotations

import pytest

from tests.dist.test_mechanisms import mpirun

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(("ranks", "args"), [pytest.param(2, (), marks=pytest.mark.full),
                                             pytest.param(4, ("equality-only",), marks=pytest.mark.full),
                                             pytest.param(2, ("cp",), marks=pytest.mark.full),
                                             (4, ("equality-only", "cp-tp")),  # the fast tier's: t and c at once
                                             pytest.param(2, ("lora",), marks=pytest.mark.full)],
                         ids=["d1t2-vs-d2", "d2t2-vs-d4", "d1c2-vs-d2", "d1t2c2-vs-d4", "d1t2-vs-d2-lora"])
def test_fsdp_tensor_parallel_trains_like_data_parallel_shares_checkpoints_and_resumes_bitwise(
        ranks: int, args: tuple[str, ...]) -> None:
    out = mpirun("fsdp_tp.py", ranks, *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("fsdp tp ok") == ranks, out.stdout[-2000:]
    assert out.stdout.count(" == fsdp:d") == ranks, out.stdout[-2000:]
    assert out.stdout.count("reward scores within") == (ranks if "cp" in args else 0), out.stdout[-2000:]
