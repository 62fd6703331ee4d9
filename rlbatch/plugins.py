"""Plugins: Python modules named in the config (``plugins: [my_pkg.engines]``), imported by name
before the configuration is validated and again on every rank, so that what they register
(engines in ``rlbatch.engines.registry``, algorithm parts in ``rlbatch.algos.registry``) exists
wherever it is looked up. Names are checked against a dotted-name pattern and imported with
importlib, never evaluated.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def import_plugins(names: object) -> list[str]:
    """Import each module in ``plugins`` by name (they register engines and algorithm parts);
    the problems, one per plugin that is not a module name or fails to import. ``names``: the
    config's ``plugins`` as given, checked here (a list or tuple of names, or None)."""
    if names is None:
        return []
    if not isinstance(names, (list, tuple)):
        return [f"plugins: expected a list of module names, got {type(names).__name__} {names!r}"[:200]]
    problems = []
    for name in names:
        if not isinstance(name, str) or len(name) > 200 or not _MODULE_NAME.fullmatch(name):
            problems.append(f"plugins: {name!r} is not a Python module name (dotted identifiers, "
                            f"e.g. 'mylab.rlbatch_plugin')"[:240])
            continue
        if (problem := _import(name)) is not None:
            problems.append(problem)
    return problems


def _import(name: str) -> str | None:
    """Import one plugin; its problem line when it raises or exits (a module that parses the
    command line at import, say): what it printed on the way out is kept for the line, not shown."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            importlib.import_module(name)
    except SystemExit as e:
        said = " ".join((err.getvalue() or out.getvalue()).split())
        return (f"plugins: importing {name!r} exited (SystemExit {e.code!r}) instead of registering what it "
                f"provides{f'; it printed: {said}' if said else ''}")[:400]
    except Exception as e:  # whatever the plugin raises is its problem line, not a traceback
        return f"plugins: importing {name!r} failed: {type(e).__name__}: {e}"[:400]
    sys.stdout.write(out.getvalue())  # an import that succeeds keeps what it printed
    sys.stderr.write(err.getvalue())
    return None
