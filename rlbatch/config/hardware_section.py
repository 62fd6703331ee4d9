"""The ``hardware`` section of a config (docs/planner.md), read by ``rlbatch.config.parse`` into
``HardwareConfig``.

``hardware=<profile>`` composes a profile of rlbatch/conf/hardware (its ``name`` and every field),
``hardware.<field>=<value>`` overrides one of them: the section is that profile with its fields
over it (``load_hardware``). A name that is no profile there with every field given is a profile of
its own. Without a name, ``+hardware.host_ram_bytes=...`` and ``+hardware.hbm_bytes=...`` give
memory figures alone, which only the vLLM memory checks read; any other field needs a profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from rlbatch.config.bounds import value_problem
from rlbatch.config.hardware import FIELDS, RANGES, Hardware, available, hardware_from_dict, load_hardware
from rlbatch.errors import ConfigError

MEMORY = ("host_ram_bytes", "hbm_bytes")
"""The fields a section without a profile name may give."""


@dataclass(frozen=True)
class HardwareConfig:
    """The ``hardware`` section as the parse reads it."""

    profile: Hardware | None = None
    """What the planner predicts with (``check`` at launch): the named profile with the section's
    fields over it, or a profile of its own; None for memory figures alone."""
    host_ram_bytes: float | None = None
    """Host RAM per node: the profile's, else the section's own; None: not given."""
    hbm_bytes: float | None = None
    """Memory of one GPU: the profile's, else the section's own; None: not given."""


def read_hardware(node: object, problems: list[str]) -> HardwareConfig | None:
    """The section typed (None: no section, or one refused), its problems appended to ``problems``."""
    if node is None or (isinstance(node, Mapping) and not node):
        return None
    profiles = available()
    choose = f"a profile is chosen with hardware=<name>, one of {profiles}"
    if not isinstance(node, Mapping):
        problems.append(f"hardware: expected a mapping of a profile's fields ({choose}), got "
                        f"{type(node).__name__} {node!r}"[:300])
        return None
    given = {str(k): v for k, v in node.items() if v is not None}
    if unknown := sorted(k for k in given if k not in FIELDS):
        problems.append(f"hardware: unknown field(s) {unknown}: not a hardware profile ({choose}); known fields: "
                        f"{sorted(FIELDS)}")
        return None
    name = given.pop("name", None)
    try:
        if name is None:
            return _memory_only(given, choose)
        profile = _profile(name, given, profiles)
    except ConfigError as e:
        problems.extend(e.problems)
        return None
    return HardwareConfig(profile, profile.host_ram_bytes, profile.hbm_bytes)


def _profile(name: object, given: dict[str, object], profiles: list[str]) -> Hardware:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"hardware.name: expected the name of a profile, one of {profiles}, got "
                          f"{type(name).__name__} {name!r}"[:300])
    if name in profiles:
        return load_hardware(name, given)
    missing = [k for k, f in FIELDS.items() if f.default is dataclasses.MISSING and k != "name" and k not in given]
    if missing:
        raise ConfigError(f"hardware.name: {name!r} is not a profile of rlbatch/conf/hardware (one of {profiles}); "
                          f"a profile of its own gives every field, missing {missing}"[:400])
    return hardware_from_dict({"name": name, **given}, "hardware")


def _memory_only(given: dict[str, object], choose: str) -> HardwareConfig:
    if other := [f"{k}={v!r}" for k, v in given.items() if k not in MEMORY]:
        raise ConfigError(f"hardware: {', '.join(other)} without a profile name: without one only {list(MEMORY)} are "
                          f"read (by the vLLM memory checks); {choose}, to predict with its fields"[:400])
    values: dict[str, float] = {}
    for k, v in given.items():
        number = _number(v)
        if (problem := value_problem(f"hardware.{k}", number, float, RANGES[k])) is not None:
            raise ConfigError(problem)
        assert isinstance(number, (int, float))
        values[k] = float(number)
    return HardwareConfig(None, values.get("host_ram_bytes"), values.get("hbm_bytes"))


def _number(v: object) -> object:
    """A number written as text (``40e9`` in YAML without a dot) as a float; anything else as it is."""
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v
