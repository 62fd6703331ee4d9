"""rlbatch's vLLM general plugin for Qwen2-VL / Qwen2.5-VL without torchvision: the entry point
``rlbatch_vlm`` of group ``vllm.general_plugins`` (pyproject.toml), which vLLM loads in each of its
processes (the engine's, its engine core and workers, and the subprocess where it inspects a model's
class: ``vllm.model_executor.models.registry._run``) before it imports a model. With ``VLLM_PLUGINS``
set (vLLM's whitelist), name ``rlbatch_vlm`` in it.

vLLM's CPU build is installed here without torchvision (PyPI's torchvision links CUDA and breaks
``import transformers`` on a CPU-only machine: docs/vllm.md). transformers' Qwen2-VL image
processing has a PIL backend that needs no torchvision, but vLLM's Qwen2-VL path reaches three
places that do. The plugin bridges each one only where it is broken, detected from what transformers
itself reports (``is_torchvision_available``) and what is already imported, never assumed; with a
working torchvision (a CUDA build of vLLM) ``register`` changes nothing:

1. **smart_resize's module.** ``vllm.model_executor.models.qwen2_vl`` (and Qwen2.5-VL's, through it)
   imports ``smart_resize`` from ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, the
   torchvision image processor's module, whose first lines import torchvision: the model module fails
   to import. vLLM uses the function only to count image tokens; the PIL module defines the same one.
   The plugin makes that module name resolve to a module holding the PIL module's ``smart_resize``
   and ``Qwen2VLImageProcessorPil`` (as ``Qwen2VLImageProcessor``), through an import hook that acts
   on that one name and only when torchvision cannot be imported.
2. **The processor.** vLLM builds the Hugging Face processor with
   ``Qwen2VLProcessor.from_pretrained`` (Qwen2.5-VL: ``Qwen2_5_VLProcessor``'s), which without
   torchvision fails (it loads a video processor, and its constructor checks the video processor's
   class, which transformers registers only with torchvision). The plugin makes those two classes'
   ``from_pretrained`` build rlbatch's image-only processor (``rlbatch.models.vlm.load_processor``:
   the model's tokenizer, its image processor on the PIL backend, its chat template), a subclass of
   the same class, so vLLM's ``isinstance`` checks pass. Only when transformers reports torchvision
   unavailable, and only for those two classes exactly (subclasses load as before).
3. **video_processor.valid_kwargs.** vLLM lists the processor keyword arguments it accepts per
   modality the model declares, Qwen2-VL's video included
   (``get_supported_mm_processor_kwargs`` reads ``processor.video_processor.valid_kwargs``). The
   processor of 2 gets a ``video_processor`` that carries transformers' ``VideosKwargs`` as its
   ``valid_kwargs`` and refuses to process a video, naming why. Only on the processors 2 builds.

Videos stay unsupported on a machine without torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

SMART_RESIZE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The torchvision-backed module vLLM's Qwen2-VL imports ``smart_resize`` from."""
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
PROCESSOR_CLASSES = {"transformers.models.qwen2_vl.processing_qwen2_vl": "Qwen2VLProcessor",
                     "transformers.models.qwen2_5_vl.processing_qwen2_5_vl": "Qwen2_5_VLProcessor"}
"""Module -> the processor class vLLM builds with ``from_pretrained``."""
_MARK = "_rlbatch_image_only"
"""Set on a class whose ``from_pretrained`` the plugin replaced (so a second ``register`` does not wrap it twice)."""


def torchvision_importable() -> bool:
    """Whether ``import torchvision`` can find the package (what the torchvision-backed module needs)."""
    return importlib.util.find_spec("torchvision") is not None


def transformers_has_video() -> bool:
    """Whether transformers builds video processors (it registers them only with torchvision)."""
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def register() -> None:
    """vLLM calls this in each of its processes at start-up (``vllm.plugins.load_general_plugins``);
    it may run more than once in a process. Installs what is needed, nothing where nothing is."""
    if not torchvision_importable() and SMART_RESIZE_MODULE not in sys.modules:
        _install(_SmartResizeFinder())
    if not transformers_has_video():
        for module_name in PROCESSOR_CLASSES:
            module = sys.modules.get(module_name)
            if module is not None:  # imported before the plugin loaded: patch it now
                _image_only_from_pretrained(module)
        _install(_ProcessorFinder())


def _install(finder: importlib.abc.MetaPathFinder) -> None:
    if not any(type(f) is type(finder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)


class _SmartResizeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``SMART_RESIZE_MODULE`` to the PIL image processor's functions (redirection 1)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == SMART_RESIZE_MODULE else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pil = importlib.import_module(PIL_MODULE)
        module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        module.__doc__ = (f"rlbatch.engines.vllm.vlm_plugin: {PIL_MODULE}'s smart_resize and image processor "
                          f"under this name (torchvision is not installed)")


class _ProcessorFinder(importlib.abc.MetaPathFinder):
    """Loads the processor modules of ``PROCESSOR_CLASSES`` as they are, then replaces their class's
    ``from_pretrained`` (redirection 2)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PROCESSOR_CLASSES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchAfterLoad(spec.loader)
        return spec


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        _image_only_from_pretrained(module)


def _image_only_from_pretrained(module: ModuleType) -> None:
    cls = getattr(module, PROCESSOR_CLASSES[module.__name__])
    if getattr(cls, _MARK, False):
        return
    original = cls.from_pretrained

    def from_pretrained(klass: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        if klass is not cls:  # a subclass (rlbatch's image-only processors among them): as before
            return original.__func__(klass, path, *args, **kwargs)
        return image_only_processor(str(path), kwargs.get("tokenizer"))

    cls.from_pretrained = classmethod(from_pretrained)
    setattr(cls, _MARK, True)


class NoVideoProcessor:
    """Stands where a Qwen-VL processor keeps its video processor, in one built without torchvision:
    it names the video keyword arguments vLLM asks for (redirection 3) and processes no video."""

    def __init__(self) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("videos need transformers' video processor, which needs torchvision "
                                  "(not installed here): image prompts only")


def image_only_processor(model_dir: str, tokenizer: Any = None) -> Any:
    """What ``Qwen2VLProcessor.from_pretrained(model_dir, tokenizer=...)`` gives once the plugin is in:
    rlbatch's image-only processor of ``model_dir`` (with ``tokenizer`` in place of the directory's,
    as vLLM passes its own), with a ``NoVideoProcessor``."""
    from rlbatch.models.vlm import load_processor

    processor = load_processor(model_dir)
    if tokenizer is not None:
        template = processor.chat_template
        assert template is None or isinstance(template, str), "load_processor's template is the tokenizer's string"
        processor = type(processor)(processor.image_processor, tokenizer, chat_template=template)
    processor.video_processor = NoVideoProcessor()
    return processor
