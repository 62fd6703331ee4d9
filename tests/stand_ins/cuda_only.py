"""Stand-ins for the CUDA-only parts SGLang imports, so that SGLang's CPU engine runs on a machine
without a GPU (tests only; docs/sglang.md lists what they replace as untested on GPU).

- ``sgl_kernel``: no CPU build is on PyPI (its wheels link CUDA libraries). With
  ``SGLANG_USE_CPU_ENGINE=1`` some SGLang modules import its ``*_cpu`` kernels at import time; on
  a CPU without AMX the generate and weight-update paths never call them (SGLang's layers take
  their pure-torch ``forward_native``). Here every ``*_cpu`` name exists and raises when called;
  any other name is missing, so SGLang's ``try: from sgl_kernel import ...`` fallbacks still
  choose the torch path.
- ``torchvision``: SGLang imports it at start-up for its multimodal configs and processors (text
  models never call it); PyPI's build links CUDA and breaks ``import transformers`` on a CPU torch,
  so it is not installed. Here every module and name of it exists; calling or instantiating any of
  them raises.

The finder answers only in a process that runs SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``
in the environment when the import happens; the sglang engine sets it before importing SGLang):
elsewhere, e.g. a training rank, transformers still finds no torchvision.

``install()`` puts the finder on ``sys.meta_path``; ``sitecustomize`` beside this file calls it at
interpreter start, so SGLang's scheduler and detokenizer processes (which import SGLang afresh)
get it too when this directory is on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

STAND_IN = True


class StandInCalled(RuntimeError):
    """A stand-in of a CUDA-only library was called: this path needs the real library (a GPU)."""


def _raiser(qualname: str) -> Any:
    def called(*_args: Any, **_kwargs: Any) -> Any:
        raise StandInCalled(f"{qualname} is a test stand-in (tests/stand_ins/cuda_only.py): this path needs the real "
                            f"CUDA library")

    called.__name__ = called.__qualname__ = qualname.rsplit(".", 1)[-1]
    return called


class _AnyMeta(type):
    """A class whose every attribute is another such class (``InterpolationMode.BICUBIC``,
    ``T.Compose``): usable in definitions and default arguments, raising when instantiated."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _any_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *_args: Any, **_kwargs: Any) -> Any:
        raise StandInCalled(f"{cls.__qualname__} is a test stand-in (tests/stand_ins/cuda_only.py): this path needs the "
                            f"real torchvision")


def _any_class(qualname: str) -> type:
    return _AnyMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "torchvision"})


class _AnyModule(ModuleType):
    """A torchvision module: every name in it exists (a stand-in class)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _any_class(f"{self.__name__}.{name}")


class _KernelModule(ModuleType):
    """sgl_kernel: its ``*_cpu`` kernels exist and raise when called; nothing else does."""

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_cpu"):
            return _raiser(f"sgl_kernel.{name}")
        raise AttributeError(f"module 'sgl_kernel' (test stand-in) has no attribute {name!r}")


class _Loader(importlib.abc.Loader):
    def __init__(self, cls: type[ModuleType]) -> None:
        self.cls = cls

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = self.cls(spec.name)
        module.__path__ = []  # a package: its submodules come from the finder too
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["STAND_IN"] = True
        if module.__name__ == "torchvision":
            module.__dict__["__version__"] = "0.0+stand-in"


class StandInFinder(importlib.abc.MetaPathFinder):
    """Finds ``torchvision`` (and its submodules) and ``sgl_kernel`` when nothing earlier on
    ``sys.meta_path`` does: an installed real library wins."""

    ROOTS = {"torchvision": _AnyModule, "sgl_kernel": _KernelModule}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        root = fullname.partition(".")[0]
        if root not in self.ROOTS or os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            return None
        if root == "sgl_kernel" and fullname != root:
            return None  # submodules of sgl_kernel are CUDA paths: let their imports fail
        return importlib.machinery.ModuleSpec(fullname, _Loader(self.ROOTS[root]), is_package=True)


def install() -> None:
    """Append the finder to ``sys.meta_path`` (after the path finders, so a real install wins)."""
    if not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(StandInFinder())


def uninstall() -> None:
    """Take the finder off ``sys.meta_path`` and forget the stand-in modules it made, so the rest of
    a test process imports as without them."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, StandInFinder)]
    made = [n for n, m in sys.modules.items() if n.partition(".")[0] in StandInFinder.ROOTS
            and isinstance(m, (_AnyModule, _KernelModule))]
    for name in made:
        del sys.modules[name]
    checks = sys.modules.get("transformers.utils.import_utils")  # its answers while the stand-in was there
    for fn in ("is_torchvision_available", "is_torchvision_v2_available", "is_torchvision_greater_or_equal"):
        clear = getattr(getattr(checks, fn, None), "cache_clear", None)
        if clear is not None:
            clear()
