"""Environments and tools by name, and user ones by ``module:attr``.

    ENVS   name -> env class (``rlbatch.envs.base.Env``), built-ins as 'module:Class' paths
    TOOLS  name -> tool factory ``(cfg: Mapping) -> Tool``, called once per env host with the
           run's plain config (the python tool reads ``sandbox``)

A name in the config is registered here (by rlbatch, or by a module in ``plugins`` with
``register_env`` / ``register_tool``); ``env.name`` may also be a plugin path
``'mylab.envs:MyEnv'`` (a tool is called by its registered name, so it has no path form). A path's
module part is checked against the dotted-name pattern and imported with importlib, the attribute
read with getattr; nothing is evaluated. Both resolve at validation time, before anything
starts. Torch-free.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

from rlbatch.config.schema import RLBatchConfig
from rlbatch.envs.base import Tool

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # rlbatch.plugins' pattern
_ATTR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

ENVS: dict[str, str | type] = {
    "running_sum": "rlbatch.envs.running_sum:RunningSum",
    "lookup": "rlbatch.envs.lookup:Lookup",
    "frozenlake": "rlbatch.envs.frozenlake:FrozenLake",
}
ToolFactory = Callable[[RLBatchConfig], Tool]
"""A tool's factory: the run's config in, the tool out (built once per host)."""
TOOLS: dict[str, str | ToolFactory] = {
    "python": "rlbatch.envs.python_tool:python_tool",
}

T = TypeVar("T")
F = TypeVar("F", bound=ToolFactory)


@overload
def register_env(name: str, cls: None = None) -> Callable[[type[T]], type[T]]: ...
@overload
def register_env(name: str, cls: type[T]) -> type[T]: ...
def register_env(name: str, cls: type[T] | None = None) -> type[T] | Callable[[type[T]], type[T]]:
    """``register_env('mine', MyEnv)``, or ``@register_env('mine')`` on the class."""
    if cls is not None:
        ENVS[name] = cls
        return cls

    def decorate(c: type[T]) -> type[T]:
        ENVS[name] = c
        return c

    return decorate


@overload
def register_tool(name: str, factory: None = None) -> Callable[[F], F]: ...
@overload
def register_tool(name: str, factory: F) -> F: ...
def register_tool(name: str, factory: F | None = None) -> F | Callable[[F], F]:
    """``register_tool('search', factory)``, or ``@register_tool('search')`` on the factory."""
    if factory is not None:
        TOOLS[name] = factory
        return factory

    def decorate(f: F) -> F:
        TOOLS[name] = f
        return f

    return decorate


class UnknownName(ValueError):
    """A name in the config that resolves to nothing usable; the message says why."""


def _import(path: str, what: str) -> Any:  # whatever the plugin module holds: its users check it
    module, _, attr = path.partition(":")
    if not _MODULE.fullmatch(module) or not _ATTR.fullmatch(attr):
        raise UnknownName(f"{path!r} is not a registered {what} nor a plugin path 'package.module:Name' "
                         f"(dotted identifiers, one ':')")
    try:
        loaded = importlib.import_module(module)
    except Exception as e:  # whatever the plugin raises is the reason, not a traceback
        raise UnknownName(f"importing {module!r} for {path!r} failed: {type(e).__name__}: {e}"[:400]) from e
    if not hasattr(loaded, attr):
        raise UnknownName(f"module {module!r} has no attribute {attr!r}")
    return getattr(loaded, attr)


def _lookup(name: object, table: Mapping[str, str | type], what: str, load: bool) -> object:
    """The registered or plugin target of ``name``; with ``load=False`` only the name's form is
    checked (None returned for a plugin path)."""
    if not isinstance(name, str) or len(name) > 300:
        raise UnknownName(f"expected the name of a {what}, got {type(name).__name__} {name!r}"[:200])
    if name in table:
        target = table[name]
        return _import(target, what) if isinstance(target, str) and load else target
    if ":" not in name:
        raise UnknownName(f"{name!r} is not a registered {what}; registered: {sorted(table)} "
                         f"(or a plugin path 'package.module:Name')")
    if not load:
        module, _, attr = name.partition(":")
        if not _MODULE.fullmatch(module) or not _ATTR.fullmatch(attr):
            raise UnknownName(f"{name!r} is not a registered {what} nor a plugin path 'package.module:Name' "
                             f"(dotted identifiers, one ':')")
        return None
    return _import(name, what)


def resolve_env(name: object, load: bool = True) -> type | None:
    """The env class ``name`` stands for: a class with ``reset`` and ``step``. Raises UnknownName
    saying why not. ``load=False``: the name's form only (no import)."""
    cls = _lookup(name, ENVS, "environment", load)
    if cls is None or isinstance(cls, str):
        return None
    if not isinstance(cls, type):
        raise UnknownName(f"{name!r} is a {type(cls).__name__}, not an environment class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise UnknownName(f"{name!r} ({cls.__module__}.{cls.__qualname__}) has no {' or '.join(missing)} method: "
                         f"an environment implements reset(task, seed) -> str and step(action) -> StepResult")
    return cls


def resolve_tool(name: object, load: bool = True) -> ToolFactory | None:
    """The factory of registered tool ``name`` (``(cfg) -> tool``; the policy calls the tool by this
    name, so a user tool is registered by a module in ``plugins``, not named by path). Raises
    UnknownName saying why not."""
    if not isinstance(name, str) or name not in TOOLS:
        raise UnknownName(f"{name!r} is not a registered tool; registered: {sorted(TOOLS)} (a module in plugins "
                          f"adds one with rlbatch.envs.registry.register_tool)"[:300])
    factory = TOOLS[name]
    if isinstance(factory, str):
        if not load:
            return None
        factory = _import(factory, "tool")
    if not callable(factory):
        raise UnknownName(f"{name!r} is a {type(factory).__name__}, not a tool factory (cfg) -> tool")
    return factory
