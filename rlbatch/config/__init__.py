"""Configuration: the typed schema (``schema``, with its ``bounds`` and the sandbox's ``limits``),
its registration with Hydra (``register``), plain-mapping helpers (``plain``), ``load``, and the
presets' directory (``CONF_DIR``).

The bottom layer: it imports nothing of rlbatch outside this package, and every package may import
it. Validation, which asks placement, engines and the planner, is ``rlbatch.checks`` above them.
"""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""rlbatch/conf/: the YAML presets, shipped inside the package (package data), so an installed
rlbatch (wheel, ``pip install .``, editable) composes its config from any working directory."""
