"""Weights that land in the middle of an sglang engine's generation (``algo.in_flight_updates``,
one rank per worker; docs/async.md). ``Landings`` runs the generation and the syncs that land in it:

- the generation is a task on SGLang's event loop (``Engine.async_generate`` on ``engine.loop``),
  and beside it a look every ``POLL_S`` for a sync that has begun (``InFlightHook.pending``);
- when one has, SGLang's scheduler is paused between two of its steps (the tokenizer manager's
  ``pause_generation``): mode ``in_place`` with ``algo.in_flight_kv=keep`` (the requests and their KV
  cache stay; the weights load without a cache flush, which SGLang refuses while requests hold
  it), ``retract`` with ``recompute`` (the requests go back to the waiting queue with their tokens,
  the cache is flushed with the sync's last bucket, and prompt and tokens so far are prefilled
  again under the new weights);
- the sync is received on a thread of its own (``InFlightHook.receive``, which loads through the
  engine's ``load_weights``): each bucket goes to SGLang as a coroutine on the loop, which keeps
  running to serve SGLang's replies (``begin``/``update``/``end``, SGLang's weight-update bracket);
- the weights are labelled with the sync's version and the scheduler continues. SGLang records
  where each live request's label changed (``meta_info["weight_versions"]``): those spans are the
  tokens' versions (``span_versions``);
- with ``keep`` the radix cache, which holds the old weights' KV, is flushed as the generation ends,
  so no later request reuses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch

from rlbatch.engines.sglang.runtime import SGLangOutput, SGLangRuntime, VersionSpan

log = logging.getLogger(__name__)

POLL_S = 0.001
"""Seconds between two looks for a weight sync while a generation runs."""

FLUSH_WAIT_S = 60.0
"""Seconds SGLang's scheduler may take to go idle after a generation, before its cache is flushed."""

_T = TypeVar("_T")


class InFlightHook(Protocol):
    """``between_steps`` as the sglang engine uses it (``rlbatch.loop.weightsync.InFlightHook``):
    whether a sync has begun, at once; then, once the generation is paused, receive it (through
    ``load_weights``) and return its version."""

    def pending(self) -> bool: ...

    def receive(self) -> int: ...


class Landings:
    """One engine's generations with weights landing in them (module doc)."""

    def __init__(self, engine: SGLangRuntime, device: torch.device, tp: int = 1) -> None:
        self.engine, self.device, self.tp = engine, device, tp
        """``tp``: the engine's tensor-parallel schedulers, each of which takes a bucket's own copy."""
        self.recompute_kv = False
        """The generation running retracts its requests for a sync (``recompute``), else pauses in place."""
        self.active = False
        """A sync lands now: ``load_weights`` sends its buckets through ``begin``/``update``/``end``."""
        self._receiver: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.shutdown()

    def generate(self, ids: list[list[int]], sampling: list[dict[str, float | int | bool]], version: int,
                 hook: InFlightHook, recompute_kv: bool) -> list[SGLangOutput]:
        """SGLang's outputs for ``ids``, its weights (of ``version``) labelled first, so that every span
        SGLang reports is labelled with a version."""
        self.recompute_kv = recompute_kv
        return self.engine.loop.run_until_complete(self._generate(ids, sampling, version, hook))

    async def _generate(self, ids: list[list[int]], sampling: list[dict[str, float | int | bool]], version: int,
                        hook: InFlightHook) -> list[SGLangOutput]:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        control = self.engine.tokenizer_manager
        await control.update_weight_version(UpdateWeightVersionReqInput(new_version=str(version),
                                                                        abort_all_requests=False))
        task = asyncio.ensure_future(self.engine.async_generate(input_ids=ids, sampling_params=sampling,
                                                                return_logprob=True))
        landed = False
        try:
            while not task.done():
                if hook.pending():
                    await self._land(hook)
                    landed = True
                await asyncio.wait({task}, timeout=POLL_S)
        except BaseException:
            task.cancel()  # SGLang aborts the requests of a cancelled generation
            await asyncio.gather(task, return_exceptions=True)
            raise
        outputs = task.result()
        if landed and not self.recompute_kv:  # the radix cache holds the old weights' KV: no later request reuses it
            # the scheduler may still hold the finished batch for a step: SGLang flushes once it is idle
            flushed = await control.flush_cache(timeout_s=FLUSH_WAIT_S)
            if not flushed.success:
                raise RuntimeError(f"sglang engine: SGLang did not flush its cache within {FLUSH_WAIT_S:.0f}s after a "
                                   f"generation that weights landed in (its scheduler never went idle)")
        return outputs

    async def _land(self, hook: InFlightHook) -> int:
        """Pause, receive the sync on the receiver's thread while this loop serves SGLang's replies,
        label the weights with its version, continue."""
        from sglang.srt.managers.io_struct import (
            ContinueGenerationReqInput,
            PauseGenerationReqInput,
            UpdateWeightVersionReqInput,
        )

        control = self.engine.tokenizer_manager
        await control.pause_generation(PauseGenerationReqInput(mode="retract" if self.recompute_kv else "in_place"))
        try:
            if self._receiver is None:
                self._receiver = ThreadPoolExecutor(1, thread_name_prefix="rlbatch-sglang-sync")
            self.active = True
            try:
                version = await asyncio.get_running_loop().run_in_executor(self._receiver, self._receive, hook)
            finally:
                self.active = False
            await control.update_weight_version(UpdateWeightVersionReqInput(new_version=str(version),
                                                                            abort_all_requests=False))
        finally:  # empty_cache: the transient allocations of the load back to the GPU (nothing to do on CPU)
            await control.continue_generation(ContinueGenerationReqInput(torch_empty_cache=self.device.type == "cuda"))
        log.debug("sglang engine: weights of version %d landed mid-generation", version)
        return version

    def _receive(self, hook: InFlightHook) -> int:
        """On the receiver's thread: the sync (its broadcast on this rank's device) into ``load_weights``."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a thread's current device is its own
        return hook.receive()

    # -- a sync's buckets, from the receiver's thread ------------------------------------------

    def _on_loop(self, call: Coroutine[object, object, _T]) -> _T:
        """Run ``call`` on SGLang's loop (running in the generating thread) and wait for it."""
        return asyncio.run_coroutine_threadsafe(call, self.engine.loop).result()

    def begin(self) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._on_loop(self.engine.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None))

    def update(self, chunk: list[tuple[str, torch.Tensor]], last: bool) -> tuple[bool, str]:
        """One bucket: the request SGLang's ``Engine.update_weights_from_tensor`` builds (the bucket
        serialized once per tensor-parallel scheduler, each of which takes its own). After the last,
        the cache is flushed when the requests were retracted; kept, they hold it (``_generate``
        flushes it after them)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(chunk) for _ in range(self.tp)],
            flush_cache=last and self.recompute_kv)
        return self._on_loop(self.engine.tokenizer_manager.update_weights_from_tensor(request, None))

    def end(self) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self._on_loop(self.engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))


def span_versions(spans: list[VersionSpan] | None, count: int) -> list[int]:
    """Each of ``count`` tokens' version from SGLang's spans (contiguous from 0, labelled with ints)."""
    versions: list[int] = []
    for span in spans or []:
        if span["start"] != len(versions) or not span["version"].lstrip("-").isdigit():
            raise RuntimeError(f"sglang engine: weight version spans {spans} do not label {count} tokens in order "
                               f"with policy versions")
        versions += [int(span["version"])] * (span["end"] - span["start"])
    if len(versions) != count:
        raise RuntimeError(f"sglang engine: weight version spans {spans} cover {len(versions)} tokens of {count}")
    return versions
