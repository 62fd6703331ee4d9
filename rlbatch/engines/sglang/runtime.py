"""What the sglang engine calls and reads of SGLang (which is untyped): ``sglang.Engine``
(``SGLangRuntime``), its tokenizer manager's controls (``TokenizerControl``) and its outputs
(``SGLangOutput``). Types only: importing this imports neither torch's models nor SGLang."""

from __future__ import annotations

import asyncio
from typing import NotRequired, Protocol, TypedDict

import torch


class VersionSpan(TypedDict):
    version: str
    start: int
    end: int


class _MetaInfo(TypedDict):
    output_token_logprobs: list[tuple[float, int, str | None]]
    """(log-prob, token id, its text: None without SGLang's tokenizer) of each generated token."""
    weight_versions: NotRequired[list[VersionSpan]]
    """The weights' version label of each run of output tokens [start, end)."""


class SGLangOutput(TypedDict):
    """What rlbatch reads of one of ``sglang.Engine.generate``'s outputs (given token ids)."""

    output_ids: list[int]
    meta_info: _MetaInfo


class Flushed(Protocol):
    success: bool


class TokenizerControl(Protocol):
    """What the sglang engine calls of SGLang's tokenizer manager (``sglang.Engine.tokenizer_manager``)
    while weights land mid-generation: coroutines on the engine's event loop, taking SGLang's request
    objects (``sglang.srt.managers.io_struct``)."""

    async def pause_generation(self, obj: object) -> None: ...

    async def continue_generation(self, obj: object) -> None: ...

    async def begin_weight_update(self, obj: object, request: None) -> tuple[bool, str]: ...

    async def update_weights_from_tensor(self, obj: object, request: None) -> tuple[bool, str]: ...

    async def end_weight_update(self, obj: object, request: None) -> tuple[bool, str]: ...

    async def update_weight_version(self, obj: object) -> None: ...

    async def flush_cache(self, timeout_s: float | None = None) -> Flushed: ...


class SGLangRuntime(Protocol):
    """What rlbatch calls of ``sglang.Engine``."""

    loop: asyncio.AbstractEventLoop
    tokenizer_manager: TokenizerControl

    def shutdown(self) -> None: ...

    async def async_generate(self, *, input_ids: list[list[int]], sampling_params: list[dict[str, float | int | bool]],
                             return_logprob: bool) -> list[SGLangOutput]: ...

    def generate(self, *, input_ids: list[list[int]], sampling_params: list[dict[str, float | int | bool]],
                 return_logprob: bool) -> list[SGLangOutput]: ...

    def collective_rpc(self, method: str, **kwargs: object) -> None: ...

    def begin_weight_update(self) -> None: ...

    def update_weights_from_tensor(self, *, named_tensors: list[tuple[str, torch.Tensor]],
                                   flush_cache: bool) -> tuple[bool, str]: ...

    def end_weight_update(self) -> None: ...

    def release_memory_occupation(self, *, tags: list[str]) -> None: ...

    def resume_memory_occupation(self, *, tags: list[str]) -> None: ...
