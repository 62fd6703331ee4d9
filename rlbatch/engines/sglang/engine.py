"""``sglang`` inference engine: one offline ``sglang.Engine`` per data-parallel rank (``sglang:dN``).

    python -m rlbatch.launch roles.actor_infer.backend=sglang:d2

- **processes**: SGLang's Engine is not one process: it spawns a scheduler (which holds the model
  and the KV cache) and a detokenizer, and talks to them over local ZMQ sockets. They belong to the
  rank that built the engine; no server port is opened. Its scheduler runs a torch.distributed
  world of its own over a free local port; torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` would make
  it wait for an agent store that does not exist, so it is removed from the environment. The
  scheduler sleeps while idle (``sleep_on_idle``) instead of polling through the phases it sits out.
- **generate**: one request per prompt row (a GRPO group's copies share their prefix through
  SGLang's radix cache, so the prompt's KV is computed once). The behaviour log-prob of each token
  is SGLang's ``output_token_logprobs``: under the temperature-scaled distribution it samples from
  (greedy: the raw one). Sampling draws from the scheduler process's RNGs, which each call reseeds
  with its ``SamplingParams.seed`` (the scheduler's ``rlbatch_reseed`` RPC, from rlbatch's SGLang
  plugin: ``sglang_plugin``), as the vllm engine seeds its own process: a resumed run's samples are
  the uninterrupted run's. (SGLang's per-request ``sampling_seed`` needs its deterministic
  inference mode, which it refuses with CPU attention.)
- **load_weights**: Hugging Face ``(name, tensor)`` pairs through ``update_weights_from_tensor``
  (SGLang's own name mapping, fused layouts included), one call per bucket; the first bucket of a
  sync opens SGLang's ``begin_weight_update`` bracket, the bucket that completes the model's names
  closes it (``end_weight_update``) and flushes the radix cache. A bucket is cloned before it is
  sent (SGLang moves a CPU tensor's storage into shared memory to pass it to its scheduler, and a
  sync reuses its staging buffer).
- **weights mid-generation** (``algo.in_flight_updates``, one rank per worker): while
  ``between_steps`` is set, a generation runs on SGLang's event loop beside a look for a sync every
  millisecond; a sync that has begun lands with SGLang's scheduler paused (``in_place`` with
  ``algo.in_flight_kv=keep``, ``retract`` with ``recompute``), received on a thread of its own, and
  each token's version is the label SGLang recorded for it (``rlbatch.engines.sglang.in_flight``).
  SGLang's overlap scheduler is off then, so no step runs ahead of a pause.
- **offload/reload**: on a GPU, ``release_memory_occupation``/``resume_memory_occupation`` by tag
  (``weights``, ``kv_cache``; SGLang's memory saver, with a host copy of the weights so a resume
  brings them back exactly). Untested on a GPU here. On CPU SGLang has no memory saver: the state
  stays resident (zero bytes).
- **the process**: SGLang's Engine reconfigures the process it starts in (the root logger, SIGTERM
  and SIGQUIT handlers, the asyncio loop policy, multiprocessing's start method); the rank's own
  are put back after it (``_process_kept``).
- **on CPU**: ``SGLANG_USE_CPU_ENGINE=1``, torch-native attention, no CUDA graphs, fp32 by
  default, a KV cache of ``kv_cache_tokens`` tokens. SGLang's CPU engine imports some CUDA-only
  modules (``sgl_kernel``'s CPU kernels, torchvision) that no CPU wheel provides; tests bring
  stand-ins for them (tests/stand_ins, docs/sglang.md).
- **tensor parallelism** (``sglang:dXtY``, t > 1): SGLang runs an engine's t tensor-parallel
  ranks as scheduler processes it spawns itself, so a worker of t rlbatch ranks holds one engine,
  on its first rank (the leader): ``Engine(tp_size=t)`` on the worker's GPUs (``base_gpu_id`` the
  leader's, consecutive on its node: the rules refuse other layouts before start). The other
  ranks (followers, ``SGLangFollower``) hold no model: each generate call receives the leader's
  generations over MPI (the leader sends them as it returns its own), so every rank of the worker
  holds the samples, as a vLLM worker's do; weight buckets and offloads are the leader's alone.
  With in-flight updates a follower joins each sync as it begins, while it waits (it is in the sync
  group), and the leader's buckets go to each of its t schedulers. On CPU each scheduler process
  is given the rank's cores (``SGLANG_CPU_OMP_THREADS_BIND``; SGLang otherwise wants a NUMA node
  per tp rank) and reduces over gloo.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.inference import hf_parameter_names, rng_kept, tp_peers
from rlbatch.engines.model import load_model, model_dtype
from rlbatch.engines.offload import StaysResident, Transfer, free_device_bytes
from rlbatch.engines.sglang import SGLangArgs
from rlbatch.engines.sglang.in_flight import InFlightHook, Landings, span_versions
from rlbatch.engines.sglang.runtime import SGLangOutput, SGLangRuntime
from rlbatch.engines.vllm.world import PrivateWorld

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ARG_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TAGS = {"params": "weights", "kv_cache": "kv_cache"}
"""State kind -> SGLang's memory-occupation tag."""
_NO_SAVER = ("sglang engine on CPU: SGLang's memory saver needs CUDA; its weights and KV cache stay resident "
             "(offload reports 0 bytes)")


def engine_kwargs(args: SGLangArgs, path: str, dtype: torch.dtype, seed: int, device: torch.device,
                  tp: int = 1, in_flight: bool = False) -> dict[str, str | int | float | bool]:
    """``sglang.Engine``'s arguments for a worker's engine (``args``: ``SGLangArgs``) of ``tp``
    tensor-parallel ranks, on ``device`` and the tp - 1 GPUs after it; ``in_flight``: weights land
    mid-generation (``algo.in_flight_updates``)."""
    on_cpu = device.type != "cuda"
    kwargs: dict[str, str | int | float | bool] = dict(
        model_path=path, skip_tokenizer_init=True, dtype=_DTYPE_NAMES[dtype], random_seed=seed,
        mem_fraction_static=args.mem_fraction_static, max_running_requests=args.max_num_seqs,
        chunked_prefill_size=args.max_num_batched_tokens, tp_size=tp, log_level="error",
        # without it an idle scheduler polls its sockets without pause, a CPU core busy through
        # every phase the engine sits out (training, log-probs)
        sleep_on_idle=True,
    )
    if in_flight:  # no batch launched ahead of a pause: the tokens of a step are of the weights it ran with
        kwargs["disable_overlap_schedule"] = True
    if args.kv_cache_tokens or on_cpu:
        kwargs["max_total_tokens"] = args.kv_cache_tokens or CPU_KV_CACHE_TOKENS
    if args.max_model_len:
        kwargs["context_length"] = args.max_model_len
    if on_cpu:
        kwargs |= {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True}
    else:  # the memory saver (release/resume) with a host copy of the weights, on this rank's GPU
        kwargs |= {"device": "cuda", "base_gpu_id": device.index or 0, "enable_memory_saver": True,
                   "enable_weights_cpu_backup": True}
    return kwargs


def cpu_threads_bind(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tp`` ranks: each the cores this process
    may run on. SGLang reads it to pin its own CPU kernels (AMX, Arm); without it, it asks for a
    NUMA node per tp rank even where those kernels are not used."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return "|".join([cores] * tp)


CPU_KV_CACHE_TOKENS = 16384
"""CPU: the KV cache's tokens when ``kv_cache_tokens`` is 0. SGLang sizes it otherwise from the
node's memory times ``mem_fraction_static``, which takes minutes to allocate and most of a shared node."""


KEPT_SIGNALS = (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT, signal.SIGCHLD)


@contextmanager
def _process_kept() -> Iterator[None]:
    """SGLang's Engine reconfigures the process it starts in: the root logger (``basicConfig(force=True)``
    at its own level and format), SIGTERM and SIGQUIT handlers (its event loop's, and one that kills
    the process tree when a child of SGLang's fails), the signal wakeup fd, the asyncio event loop
    policy (uvloop) and multiprocessing's start method (``spawn``, forced). The rank's own are put
    back: its failure handling and the other engines in the process (vLLM's workers start with the
    process's start method) are the run's, not SGLang's."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {s: signal.getsignal(s) for s in KEPT_SIGNALS}
    policy = asyncio.get_event_loop_policy()
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        if threading.current_thread() is threading.main_thread():  # where SGLang sets them (and Python allows it)
            for s, handler in signals.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        asyncio.set_event_loop_policy(policy)
        multiprocessing.set_start_method(method, force=True)


RESULT_TAG = 24
"""MPI tag of a tensor-parallel worker's generations, leader to followers (the control plane uses
11-12, the env role 21-22, multi-turn lockstep 23)."""


def build(ctx: EngineContext) -> SGLangEngine | SGLangFollower:
    """The worker's engine on its first rank; a follower of it on the others (module doc)."""
    ranks, index = tp_peers(ctx.mesh)
    return SGLangEngine(ctx, ranks) if index == 0 else SGLangFollower(ctx, ranks[0])


class SGLangEngine:
    between_steps: InFlightHook | None = None
    """Set while a generation may take weights mid-way (``algo.in_flight_updates``,
    ``rlbatch.loop.weightsync.landing``; module doc)."""

    def __init__(self, ctx: EngineContext, ranks: tuple[int, ...] = ()) -> None:
        a: SGLangArgs = ctx.args
        self.device = ctx.device
        self.recompute_kv = ctx.algo.in_flight_kv == "recompute"
        """Weights land mid-generation: the requests are retracted and prefilled again under them
        (SGLang's pause mode ``retract``), else they go on from their KV cache (``in_place``)."""
        self.on_cpu = ctx.device.type != "cuda"
        self.comm, self.followers = ctx.comm, list(ranks[1:])
        tp = max(1, len(ranks))
        dtype = model_dtype(ctx.model.dtype, ctx.device) if a.dtype == "auto" else _ARG_DTYPES[a.dtype]
        if self.on_cpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's own switch; without it device 'cpu' is unknown
            if tp > 1:
                os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tp)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # inherited by SGLang's scheduler (module doc)
        tmp = None
        if ctx.model.path:
            path = str(ctx.model.path)
            self.expected = hf_parameter_names(ctx.model)
        else:  # random init: the same weights as every other role's (same seed), in a directory for SGLang
            model = load_model(ctx.model, ctx.tokenizer, ctx.seed, torch.float32)
            self.expected = {n for n, _ in model.named_parameters()}
            path = tmp = tempfile.mkdtemp(prefix="rlbatch-sglang-")
            with PrivateWorld().active():  # transformers saves on torch rank 0 only, when a world exists
                model.save_pretrained(tmp)
            del model
        start = time.perf_counter()
        try:
            import sglang

            with rng_kept(), _process_kept():
                self.engine: SGLangRuntime = sglang.Engine(**engine_kwargs(
                    a, path, dtype, ctx.seed, ctx.device, tp, in_flight=bool(ctx.algo.in_flight_updates)))
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("SGLang %s engine started in %.1fs (%s, %s, t=%d)", ctx.role, time.perf_counter() - start,
                 "CPU" if self.on_cpu else str(ctx.device), dtype, tp)
        self._received: set[str] = set()
        self._asleep: set[str] = set()
        self._resident = StaysResident(log, _NO_SAVER)
        self.landings = Landings(self.engine, self.device, tp)

    def close(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes. The engine is unusable afterwards."""
        self.landings.close()
        self.engine.shutdown()

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self._check_ready()
        greedy = params.temperature <= 0
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": 0.0 if greedy else params.temperature,
                    "top_p": 1.0 if greedy else params.top_p, "top_k": -1, "skip_special_tokens": False}
        if params.stop_strings:
            raise ValueError("sglang engine: stop_strings need SGLang's tokenizer, which this engine does not start "
                             "(it works on token ids)")
        self._reseed(params.seed)
        ids, per_prompt = [list(p) for p in prompts], [dict(sampling)] * len(prompts)
        if self.between_steps is not None:
            outputs = self.landings.generate(ids, per_prompt, params.version, self.between_steps, self.recompute_kv)
            generations = [_generation(o, params.version, landed=True) for o in outputs]
        else:
            outputs = self.engine.generate(input_ids=ids, sampling_params=per_prompt, return_logprob=True)
            generations = [_generation(o, params.version) for o in outputs]
        if self.followers:
            from rlbatch.runtime.control import send_obj  # MPI: not at import (SGLang's processes import this module)

            assert self.comm is not None, "a tensor-parallel worker's leader sends over EngineContext.comm"

            for rank in self.followers:
                send_obj(self.comm, generations, rank, RESULT_TAG)
        return generations

    def _reseed(self, seed: int) -> None:
        """Seed the scheduler's RNGs for the next call (rlbatch's SGLang plugin, ``sglang_plugin``)."""
        from rlbatch.engines.sglang.plugin import RESEED

        try:
            self.engine.collective_rpc(RESEED, seed=int(seed))
        except AssertionError as e:  # SGLang asserts the RPC's success
            hint = (": rlbatch's SGLang plugin is registered when rlbatch is installed (pip install -e ., the entry "
                    "point 'sglang.srt.plugins: rlbatch') and must be named in SGLANG_PLUGINS where that is set"
                    if "attribute" in str(e) else "")
            raise RuntimeError(f"sglang engine: SGLang's scheduler failed {RESEED}({seed}): {e}{hint}") from e

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a bucket of a sync (module doc). Returns the bytes loaded."""
        chunk = [(n, t.detach().clone()) for n, t in named]
        unknown = [n for n, _ in chunk if n not in self.expected]
        if unknown:
            raise KeyError(f"sglang engine: weights {unknown[:5]} are not parameters of the model")
        mid = self.landings.active  # a sync landing mid-generation: from the receiver's thread
        if not self._received:
            if mid:
                self.landings.begin()
            else:
                self.engine.begin_weight_update()
        self._received |= {n for n, _ in chunk}
        last = self._received >= self.expected
        ok, message = (self.landings.update(chunk, last) if mid
                       else self.engine.update_weights_from_tensor(named_tensors=chunk, flush_cache=last))
        if not ok:
            raise RuntimeError(f"sglang engine: SGLang refused a weight bucket: {message}")
        if last:
            if mid:
                self.landings.end()
            else:
                self.engine.end_weight_update()
            self._received = set()
        return sum(t.numel() * t.element_size() for _, t in chunk)

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None  # the weights live in SGLang's scheduler process, fused

    def _check_ready(self) -> None:
        if self._received:
            missing = sorted(self.expected - self._received)
            raise RuntimeError(f"sglang engine: generate during an incomplete weight sync; not yet received: "
                               f"{missing[:5]} ({len(missing)} in all)")
        if self._asleep:
            raise RuntimeError(f"sglang engine: generate while SGLang holds {sorted(self._asleep)} released (the phase "
                               f"must reload them first)")

    # -- device state -------------------------------------------------------------------------

    @property
    def state_kinds(self) -> tuple[str, ...]:
        return ("params", "kv_cache")

    def offload(self, kinds: Iterable[str]) -> Transfer:
        """GPU: release the asked kinds (SGLang's memory saver; the weights keep a host copy)."""
        go = {k for k in kinds if k in self.state_kinds} - self._asleep
        if not go:
            return Transfer()
        if self.on_cpu:
            return self._resident()
        start, free = time.perf_counter(), free_device_bytes(self.device)
        self.engine.release_memory_occupation(tags=sorted(_TAGS[k] for k in go))
        self._asleep |= go
        return Transfer(max(0, free_device_bytes(self.device) - free), time.perf_counter() - start, 0)

    def discard(self, kinds: Iterable[str]) -> Transfer:
        """As ``offload``: SGLang's memory saver keeps the host copy either way."""
        return self.offload(kinds)

    def reload(self, kinds: Iterable[str]) -> Transfer:
        """GPU: resume the asked kinds that were released (the KV cache with the weights)."""
        want = {k for k in kinds if k in self.state_kinds}
        if "kv_cache" in want:
            want.add("params")  # a KV cache is of use only beside the weights
        wake = want & self._asleep
        if not wake:
            return Transfer()
        start, free = time.perf_counter(), free_device_bytes(self.device)
        self.engine.resume_memory_occupation(tags=sorted(_TAGS[k] for k in wake))
        self._asleep -= wake
        return Transfer(max(0, free - free_device_bytes(self.device)), time.perf_counter() - start, 0)


class SGLangFollower:
    """A tensor-parallel worker's rank other than the first: SGLang runs this rank's share of the
    model in a scheduler process of the leader's engine, so here there is no model, and each
    generate call returns the generations the leader sends for the same call (module doc)."""

    state_kinds: tuple[str, ...] = ()
    between_steps: Callable[[], int | None] | None = None
    """Set while a generation may take weights mid-way (``algo.in_flight_updates``,
    ``rlbatch.loop.weightsync.landing``). The follower is in the sync group, so while it waits for
    the leader's generations it joins each sync that begins (this call receives it, and the leader's
    engine loads it), as the leader takes it between two of its engine's steps."""

    def __init__(self, ctx: EngineContext, leader: int) -> None:
        if ctx.comm is None:
            raise ValueError(f"sglang engine, role {ctx.role}: a tensor-parallel worker's follower needs the world's "
                             f"MPI communicator (EngineContext.comm)")
        self.comm, self.leader = ctx.comm, leader
        log.info("SGLang %s: tensor-parallel follower of rank %d's engine", ctx.role, leader)

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        from rlbatch.runtime.control import recv_obj

        # With in-flight updates, a sync that begins meanwhile is joined (received with the leader).
        generations: list[Generation] = recv_obj(self.comm, self.leader, RESULT_TAG, None,
                                                 f"the generations of rank {self.leader}'s sglang engine",
                                                 meanwhile=self.between_steps)
        if len(generations) != len(prompts):
            raise RuntimeError(f"sglang engine: rank {self.leader} generated for {len(generations)} prompts, this "
                               f"follower was asked for {len(prompts)}")
        return generations

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        return 0  # the leader's engine loads every tensor-parallel rank's share

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def discard(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()


def _generation(output: SGLangOutput, version: int, landed: bool = False) -> Generation:
    """One SGLang output as a ``Generation``: its tokens, the log-prob of each, and each one's
    version: ``version`` throughout, or, where weights could land (``landed``), the version label of
    the span SGLang reports it in (``Landings.generate`` labels every load)."""
    tokens = [int(t) for t in output["output_ids"]]
    steps = output["meta_info"]["output_token_logprobs"]
    if [int(s[1]) for s in steps] != tokens:
        raise RuntimeError(f"sglang engine: log-probs for tokens {[s[1] for s in steps][:5]}, generated {tokens[:5]}")
    versions = span_versions(output["meta_info"].get("weight_versions"), len(tokens)) if landed else [version] * len(tokens)
    return Generation(tokens, [float(s[0]) for s in steps], versions)
