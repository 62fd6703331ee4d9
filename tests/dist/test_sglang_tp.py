"""A tensor-parallel SGLang worker (sglang:d1t2) on SGLang's CPU engine with the stand-ins of
tests/stand_ins: tests/dist/scripts/sglang_tp.py (greedy output equal to transformers' before and
after a bucketed sync, behaviour log-probs, the follower's generations the leader's). The scaled-down
AReaL preset that trains with it (roles=areal_4rank) was run by hand: docs/sglang.md."""

from __future__ import annotations

import pytest

from tests.conftest import STAND_INS
from tests.dist.test_mechanisms import mpirun

pytestmark = [pytest.mark.dist, pytest.mark.full]


def test_tensor_parallel_sglang_worker_matches_transformers() -> None:
    out = mpirun("sglang_tp.py", 2, path=(STAND_INS,))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("sglang tp ok") == 2, out.stdout[-2000:]
