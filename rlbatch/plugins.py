"""Plugins: Python modules named in the config (``plugins: [my_pkg.engines]``), imported by name
before the configuration is validated and again on every rank, so that what they register
(engines in ``rlbatch.engines.registry``, algorithm parts in ``rlbatch.algos.registry``) exists
wherever it is looked up. Names are checked against a dotted-name pattern and imported with
importlib, never evaluated.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def load_plugins(names: Iterable[object]) -> list[str]:
    """Import every plugin; returns one problem line per name that is not a module name or fails to import."""
    problems = []
    for name in names:
        if not isinstance(name, str) or not _MODULE.fullmatch(name):
            problems.append(f"plugins: {name!r} is not a Python module name (e.g. my_package.engines)")
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure of the plugin's own code is reported, not raised
            problems.append(f"plugins: importing {name!r} failed: {type(e).__name__}: {e}"[:300])
    return problems
