"""Placement: the device_mapping and backend languages, and ``place()``. Pure Python, no torch."""

from rlbatch.placement.backend import BackendSpec, ParallelDims, parse_backend
from rlbatch.placement.device_mapping import parse_device_mapping
from rlbatch.placement.place import place
from rlbatch.placement.placement import Placement, ProcessKind, ProcessSlot, RolePlacement, SlurmRequest

__all__ = [
    "BackendSpec", "ParallelDims", "Placement", "ProcessKind", "ProcessSlot",
    "RolePlacement", "SlurmRequest", "parse_backend", "parse_device_mapping", "place",
]
