"""Hardware profiles: what one GPU (or one CPU "GPU rank") and its node can do.

Profiles live in ``rlbatch/conf/hardware/<name>.yaml``, one per machine class, every published number
with its source in a comment. ``load_hardware("h100_sxm")`` reads one; ``hardware.<field>=value``
arguments override single fields (``hardware.hbm_bytes=40e9``). All units are SI: bytes,
bytes/s in one direction, FLOP/s, seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.config import CONF_DIR
from rlbatch.config.bounds import Range, value_problem
from rlbatch.errors import ConfigError

HARDWARE_DIR = CONF_DIR / "hardware"
"""rlbatch/conf/hardware/, shipped inside the package like the rest of rlbatch/conf/."""


@dataclass(frozen=True)
class Hardware:
    """One machine class. ``kind='cpu'`` means GPU ranks are processes sharing the node's cores."""

    name: str
    kind: str
    """'gpu' or 'cpu'."""
    peak_flops: float
    """Dense matmul FLOP/s of one device in the compute dtype (bf16 on GPUs; fp32 per thread on CPU)."""
    hbm_bytes: float
    """Device memory of one GPU. On CPU profiles: unused (memory is the node's RAM, host_ram_bytes)."""
    hbm_bw: float
    """Device memory bandwidth (CPU: one thread's memcpy bandwidth)."""
    intra_bw: float
    """Per-GPU link bandwidth to GPUs of the same node, one direction (NVLink; CPU: gloo over loopback)."""
    inter_bw: float
    """Per-GPU bandwidth to other nodes, one direction (its NIC)."""
    pcie_bw: float
    """Pinned host<->device copy bandwidth of one GPU, one direction (CPU: memcpy)."""
    host_mem_bw: float
    """Host memory bandwidth of a node: concurrent offloads of its GPUs share it."""
    host_ram_bytes: float
    """Host RAM per node."""
    gpus_per_node: int = 8
    """Informational: cluster.gpus_per_node is what the planner uses."""
    intra_alpha_s: float = 10e-6
    """Latency of one collective hop inside a node."""
    inter_alpha_s: float = 20e-6
    """Latency of one collective hop between nodes."""
    op_overhead_s: float = 6e-6
    """Host-side cost of launching one kernel / dispatching one torch op."""
    reserved_bytes: float = 0.0
    """Device memory we cannot use (CUDA context, NCCL buffers, fragmentation)."""
    process_host_bytes: float = 0.0
    """Host RSS of one rank before it holds any model state."""
    cores_per_node: int = 0
    """CPU profiles: cores that all ranks of a node share (0 on GPU profiles: no sharing)."""
    wakeup_s: float = 0.0
    """CPU profiles: what a phase costs the controller per rank it commands when the node runs more
    processes (ranks, controller, CPU workers) than it has cores: the rank sleeps while it waits for
    a command and must be scheduled in among busy processes. 0 on GPU profiles (a core each)."""
    cache_bw: float = 0.0
    """CPU profiles: bytes per second one thread streams through an elementwise op whose tensors
    stay in cache (read plus written); 0: hbm_bw."""
    llc_bytes: float = 0.0
    """CPU profiles: last-level cache of a node. A pass whose working set, summed over the node's
    active ranks, fits in it streams at every rank's own rate; else the ranks share host_mem_bw.
    0: unknown, always shared."""
    mfu: float = 0.5
    """Prior: achieved fraction of peak_flops by a large matmul."""
    mbu: float = 0.8
    """Prior: achieved fraction of hbm_bw by a large streaming kernel."""
    link_eff: float = 0.8
    """Prior: achieved fraction of link bandwidth by a large collective."""

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def usable_bytes(self) -> float:
        """Device memory a rank may fill."""
        return self.hbm_bytes - self.reserved_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(Hardware)}
RANGES = {**{k: Range(gt=0) for k in ("peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "inter_bw", "pcie_bw",
                                      "host_mem_bw", "host_ram_bytes")},
          **{k: Range(gt=0, le=1) for k in ("mfu", "mbu", "link_eff")}}
"""The planner divides by the rates and sizes and scales by the efficiencies; every other number
is a size, a count or a time (``Range(ge=0)``). All are finite: ``nan`` compares false with every
limit and would pass every fit."""


DEVICE_PROFILES = {
    "NVIDIA H100 80GB HBM3": "h100_sxm",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100_80g",
}
"""``torch.cuda.get_device_name()`` -> profile. Exact names only: the PCIe and NVL variants of
the same chips have lower clocks or bandwidth, so a near match would overstate the peak."""


def profile_for_device(device_name: str) -> str | None:
    """The profile of a CUDA device by its name, or None when no profile describes it."""
    return DEVICE_PROFILES.get(device_name.strip())


def available() -> list[str]:
    """Names of the profiles in rlbatch/conf/hardware/."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def _coerce(name: str, value: Any, where: str) -> Any:
    kind = FIELDS[name].type
    try:
        if kind in ("float", float):
            return float(value)
        if kind in ("int", int):
            return int(float(value))
        return str(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: {name}={value!r} is not a {kind}") from None


def hardware_from_dict(data: dict[str, Any], where: str, overrides: dict[str, Any] | None = None) -> Hardware:
    """Build a Hardware from a mapping, naming the file in every problem."""
    data = {**data, **(overrides or {})}
    unknown = sorted(set(data) - set(FIELDS))
    problems = [f"{where}: unknown field(s) {unknown}; known fields: {sorted(FIELDS)}"] if unknown else []
    required = [n for n, f in FIELDS.items() if f.default is dataclasses.MISSING and n not in data]
    if required:
        problems.append(f"{where}: missing field(s) {required}")
    if problems:
        raise ConfigError(problems)
    values = {k: _coerce(k, v, where) for k, v in data.items()}
    if values["kind"] not in ("gpu", "cpu"):
        raise ConfigError(f"{where}: kind must be 'gpu' or 'cpu', got {values['kind']!r}")
    problems = [p for k, v in values.items() if isinstance(v, (int, float))
                and (p := value_problem(f"{where}: {k}", v, type(v), RANGES.get(k, Range(ge=0)))) is not None]
    if problems:
        raise ConfigError(problems)
    return Hardware(**values)


def load_hardware(name: str, overrides: dict[str, Any] | None = None) -> Hardware:
    """Load ``rlbatch/conf/hardware/<name>.yaml`` (or a path to a YAML file) with field overrides."""
    import yaml

    given_file = name.endswith((".yaml", ".yml"))
    path = Path(name) if given_file else HARDWARE_DIR / f"{name}.yaml"
    if not (path.is_file() if given_file else name in available()):  # a name is a profile's, never a path
        raise ConfigError(f"hardware: no profile {name!r}; available: {available()} (or give a path to a .yaml)")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"hardware: {path} must hold a mapping of fields")
    return hardware_from_dict(data, f"hardware {path.name}", overrides)
