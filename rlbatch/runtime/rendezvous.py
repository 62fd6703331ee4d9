"""Pick the torch.distributed rendezvous port: derived from the job id, checked before use.

Two jobs on one node get different starting points (different job ids), and a port that is
taken is skipped, so neither a fixed port nor a neighbour's job can block a start.
"""

from __future__ import annotations

import socket
import zlib

PROBES = 64


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def candidate_ports(job_id: str | None, port_range: tuple[int, int]) -> list[int]:
    """Ports to try, in order: a job-id-derived start, then the following ports (wrapping)."""
    low, high = int(port_range[0]), int(port_range[1])
    span = high - low
    start = zlib.crc32((job_id or "local").encode()) % span
    return [low + (start + i) % span for i in range(min(PROBES, span))]


def choose_port(job_id: str | None, port_range: tuple[int, int]) -> int:
    for port in candidate_ports(job_id, port_range):
        if port_is_free(port):
            return port
    low, high = port_range
    raise RuntimeError(f"no free port among {PROBES} tried in cluster.port_range [{low}, {high}) for job {job_id}")
