"""Engines: the model-holding half of each role. Small Protocols (``base``), chosen by the backend
string through the registry (``registry``).

Each built-in engine is a package of its own (``rlbatch/engines/<name>/``): its ``__init__`` holds the
spec and typed engine_args and registers them with the one ``register(EngineSpec(...))`` line a
plugin writes; the engine and its rules are modules beside it, imported by name when first used.
Importing ``rlbatch.engines`` (any module of it) registers the built-ins, in this order."""

import importlib

BUILT_IN = ("fsdp", "megatron", "deepspeed", "vllm", "sglang", "hf")
"""The engines that ship with rlbatch (torch-free to register: validation reads their specs)."""

for _name in BUILT_IN:
    importlib.import_module(f"{__name__}.{_name}")
