"""Rendezvous ports come from the job id, inside the configured range, and busy ones are skipped."""

from __future__ import annotations

import socket

from rlbatch.runtime.rendezvous import candidate_ports, choose_port


def test_ports_derive_from_job_id_within_range() -> None:
    a = candidate_ports("1001", (20000, 40000))
    b = candidate_ports("1002", (20000, 40000))
    assert a[0] != b[0], "two jobs on one node must not start from the same port"
    assert all(20000 <= p < 40000 for p in a + b)
    assert candidate_ports("1001", (20000, 40000)) == a, "the same job id gives the same ports on every rank"


def test_busy_port_is_skipped() -> None:
    first = candidate_ports("busy-job", (30000, 30010))[0]
    with socket.socket() as s:
        s.bind(("", first))
        s.listen()
        chosen = choose_port("busy-job", (30000, 30010))
    assert chosen != first
    assert 30000 <= chosen < 30010
