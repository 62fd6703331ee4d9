"""``vllm`` inference engine: one in-process ``vllm.LLM`` per rank, on GPU or on vLLM's CPU build;
a worker of t ranks (``vllm:dXtY``) is t engines, one per rank, tensor-parallel in a world of their own.

    python -m rlbatch.launch roles.actor_infer.backend=vllm:d2 model.num_heads=2 model.num_kv_heads=1
    python -m rlbatch.launch roles.actor_infer.backend=vllm:d1t2 model.num_heads=2 model.num_kv_heads=1

- **generate**: prompts arrive repeated (a GRPO group is n copies of one prompt); each distinct
  prompt becomes one vLLM request with ``n`` samples, so the prompt is prefilled once and its KV
  blocks are shared. Requests carry no per-request seed (the same seed on duplicated prompts
  makes identical samples, and a seeded request whose prefill is chunked fails on CPU): the
  process RNG is seeded from ``SamplingParams.seed`` instead, which vLLM's sampler draws from.
  Log-probs are vLLM's ``processed_logprobs`` of the sampled token: after temperature and
  top-p, the distribution it was sampled from, as the hf engine records.
- **load_weights**: Hugging Face ``(name, tensor)`` pairs into vLLM's fused layout through its
  layerwise reload (one ``initialize_layerwise_reload`` ... ``finalize`` span per sync, across
  buckets); vLLM keeps references to a layer's tensors until the layer is complete, so a bucket
  that does not complete the sync is cloned (weight sync reuses one staging buffer). The prefix
  cache is reset after each sync.
- **load_adapters** (``model.lora``, ``model.lora.sync`` adapter or auto): vLLM starts with LoRA
  on (``enable_lora``, ``max_lora_rank`` the smallest vLLM allows at or above the rank) and the
  base weights it loads at start; a sync moves the adapters alone (PEFT's names), which become one
  LoRA adapter per policy version, built from the tensors in memory on each worker
  (``_add_adapter``: vLLM's own ``LoRAModel.from_lora_tensors``, no files) in place of the last.
  Every request is generated with the current version's ``LoRARequest``; before the first sync none
  (the adapters start at zero: the base model is the policy).
- **offload/reload**: vLLM's sleep mode on a GPU (level 1: weights to host, KV cache dropped;
  ``discard``: level 2, the weights dropped too, when a weight sync overwrites them next), what is
  asleep read from vLLM's executor itself (untested on a GPU here); vLLM's CPU build has none, so
  on CPU the state stays resident (zero bytes).
- **compile cache**: each engine gets a cache directory of its own, keyed by its world rank
  (``compile_cache_root``): vLLM keys its own by the rank in the engine's world, 0 for every
  one-rank engine of a node.
- **torch.distributed**: the engine runs in a world of its own (``vllm_world``): one rank at t=1,
  the worker's t peers (the role mesh's ``tp`` axis) at t>1, where vLLM's ``external_launcher``
  adopts it. Any subset of the job's ranks may hold a worker. Every peer gets the same prompts and
  seed and runs the same deterministic schedule, so all return the same outputs; every peer loads
  the full Hugging Face tensors of a sync and vLLM keeps its shard. See docs/vllm.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, TypedDict, cast

import torch

from rlbatch.engines.base import EngineContext, Generation, SamplingParams, TurnRequest
from rlbatch.engines.inference import hf_parameter_names, meta_model, rng_kept, tp_peers
from rlbatch.engines.model import load_model, model_dtype
from rlbatch.engines.offload import StaysResident, Transfer, free_device_bytes
from rlbatch.engines.vllm import images as vlm_images
from rlbatch.engines.vllm.limits import CPU_KV_CACHE_MB, LORA_RANKS
from rlbatch.engines.vllm.world import PrivateWorld, private_shm_names
from rlbatch.models import lora

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.config import VllmConfig
    from vllm.config.model import ModelDType
    from vllm.logprobs import LogprobsOnePosition
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.worker.gpu_worker import Worker

    from rlbatch.config.schema import LoraConfig
    from rlbatch.engines.vllm import VLLMArgs
    from rlbatch.loop.partial import KeptSample, KeptState

log = logging.getLogger(__name__)

TP_WORLD_TIMEOUT_S = 600.0
"""How long the tp peers of a worker wait for each other when their private world starts."""
_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_VLLM_DTYPES: dict[torch.dtype, ModelDType] = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                               torch.float32: "float32"}
"""vLLM's name of each dtype (it reads them as the dtypes themselves)."""
_SLEEP_TAGS = {"params": "weights", "kv_cache": "kv_cache"}
"""State kind -> vLLM's sleep tag."""
_NO_SLEEP = ("vllm engine on CPU: vLLM's CPU build has no sleep mode; its weights and KV cache stay resident "
             "(offload reports 0 bytes)")


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds adapters of ``rank``."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vllm engine: model.lora.rank {rank} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    return fits[0]


def check_tp(shape: dict[str, int], t: int) -> None:
    """vLLM splits query heads, key/value heads (or replicates them when t exceeds their number)
    and the MLP's columns over the t peers: refuse a t that does not divide them."""
    if t <= 1:
        return
    heads, kv, ffn = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    problems = []
    if heads % t:
        problems.append(f"num_attention_heads {heads} is not divisible by t={t}")
    if kv % t and t % kv:
        problems.append(f"num_key_value_heads {kv} neither divides nor is divisible by t={t}")
    if ffn % t:
        problems.append(f"intermediate_size {ffn} is not divisible by t={t}")
    if problems:
        raise ValueError(f"vllm engine: tensor parallelism over t={t} ranks cannot split this model: "
                         + "; ".join(problems))


def _model_shape(cfg: PretrainedConfig) -> dict[str, int]:
    """What ``check_tp`` reads from a transformers config (a vision-language model's: its text model's)."""
    cfg = cfg.get_text_config()
    heads = int(cfg.num_attention_heads)
    return {"num_attention_heads": heads, "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "intermediate_size": int(cfg.intermediate_size)}


def compile_cache_root(world_rank: int, env: Mapping[str, str] = os.environ) -> str:
    """vLLM's cache root (``VLLM_CACHE_ROOT``) for the engine on ``world_rank``: a directory of its
    own under the job's root (``VLLM_CACHE_ROOT``, else vLLM's default ``$XDG_CACHE_HOME/vllm`` or
    ``~/.cache/vllm``). vLLM keys its torch.compile cache (with Inductor's and Triton's beneath it)
    by the engine's rank in its own world: 0 for every one-rank engine of a node, 0..t-1 for every
    worker, so without this the engines of a node compile into the same directories at once. The
    world rank is the same in the next run of the job, which finds its compiled graphs again."""
    base = env.get("VLLM_CACHE_ROOT") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "vllm")
    return os.path.join(os.path.expanduser(base), f"rank{world_rank}")


@contextmanager
def _launcher_env(tp_rank: int, device: torch.device, cache_root: str | None = None) -> Iterator[None]:
    """vLLM's external launcher reads its rank from RANK and its device from LOCAL_RANK: the
    private world's rank and this rank's own GPU while vLLM starts; the caller's values after.
    ``cache_root``: the engine's own ``VLLM_CACHE_ROOT`` (vLLM reads it while it starts, and keeps
    what it read once started)."""
    names = ("RANK", "LOCAL_RANK", "VLLM_CACHE_ROOT")
    saved = {n: os.environ.get(n) for n in names}
    os.environ["RANK"] = str(tp_rank)
    os.environ["LOCAL_RANK"] = str(device.index or 0) if device.type == "cuda" else str(tp_rank)
    if cache_root is not None:
        os.environ["VLLM_CACHE_ROOT"] = cache_root
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def one_rank_executor() -> type:
    """vLLM's one-process executor (``uni``), on this rank's own GPU. vLLM's own takes its worker's
    device index from ``DeviceConfig``, which holds the device type alone (``cuda``, so GPU 0): on a
    node where every rank sees every GPU, each rank's t=1 engine would start on GPU 0 and make it
    the rank's current device. This one takes the index from ``LOCAL_RANK``, which
    ``_launcher_env`` sets to the rank's GPU while the engine starts (0 on CPU, as vLLM's)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class OneRankExecutor(UniProcExecutor):
        def _distributed_args(self) -> tuple[str, int, int]:
            init_method, rank, _ = super()._distributed_args()
            return init_method, rank, int(os.environ["LOCAL_RANK"])

    return OneRankExecutor


class _LLMArgs(TypedDict, total=False):
    """The arguments of ``vllm.LLM`` this engine sets."""

    model: str
    tokenizer: str
    dtype: ModelDType
    seed: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    enforce_eager: bool
    logprobs_mode: str
    distributed_executor_backend: str | type
    tensor_parallel_size: int
    max_model_len: int
    enable_lora: bool
    max_lora_rank: int
    max_loras: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    enable_sleep_mode: bool
    async_scheduling: bool
    limit_mm_per_prompt: dict[str, int]


class _AdapterArg(TypedDict, total=False):
    lora_request: LoRARequest


class VLLMEngine:
    lora: LoraConfig | None = None
    """``model.lora`` when a sync brings the adapters alone (``load_adapters``), else None."""
    adapter_version = 0
    """The policy version whose adapters vLLM generates with (0: none yet, the base model)."""
    _lora_request: LoRARequest | None = None
    _stale_prefix = False
    vlm = False
    """The model is a vision-language model (Qwen2-VL / Qwen2.5-VL): prompts may carry images."""
    """Weights were loaded while requests held the prefix cache, which vLLM could not reset then."""
    between_steps: Callable[[], int | None] | None = None
    """Set while a generation may take weights mid-way (``algo.in_flight_updates``,
    ``rlbatch.loop.weightsync.landing``): called before every engine step; a call that returns a
    version has loaded that version's weights (through ``load_weights``)."""

    def __init__(self, ctx: EngineContext) -> None:
        a: VLLMArgs = ctx.args
        self.device, self.tokenizer = ctx.device, ctx.tokenizer
        self.on_cpu = ctx.device.type != "cuda"
        dtype = model_dtype(ctx.model.dtype, ctx.device) if a.dtype == "auto" else _DTYPE_NAMES[a.dtype]
        self.tp_ranks, self.tp_rank = tp_peers(ctx.mesh)
        self.updates_in_flight = bool(ctx.algo.in_flight_updates)
        self.recompute_kv = ctx.algo.in_flight_kv == "recompute"
        """Weights landed mid-generation: the sequences in flight are prefilled again under them
        (vLLM's ``reset_prefix_cache(reset_running_requests=True)``), else their KV cache is kept."""
        self._requests = 0  # serial of the requests of in-flight generations
        # partial rollouts (``generate_some``): requests kept across calls
        self._kept: dict[str, tuple[int, list[int]]] = {}  # request id -> (sample id, token versions so far)
        self._finished: dict[int, Generation] = {}  # finished, not returned yet
        self._prompt: dict[str, list[int]] = {}  # request id -> its sample's prompt (a checkpoint keeps it)
        self._latest: dict[str, CompletionOutput] = {}  # request id -> its cumulative output after the last step
        self._before: dict[str, tuple[list[int], list[float]]] = {}  # restored: tokens, log-probs before the resume
        self._restore: list[KeptSample] = []  # restored (or read by a checkpoint) unfinished, added by the next call
        self._group_done: dict[int, int] = {}  # group id -> its samples finished
        self._ready: list[int] = []  # whole groups finished, in finishing order, not returned yet
        self._kept_version = 0  # the weights the kept requests last stepped with
        self._group = 1  # samples per group of the kept requests
        self.bound = int(ctx.algo.max_staleness) if ctx.algo.partial_rollouts else None
        """Partial rollouts: a kept group one of whose tokens is more than this many versions older than
        the weights held can no longer be trained (a batch trains at a version no older; the
        controller drops the group, ``rlbatch.loop.ahead.past_the_bound``). ``generate_some`` stops it
        (``_stop_stale``) instead of generating it to its end."""
        self.world = PrivateWorld()
        self._turns: set[int] = set()  # keys of turn requests in flight (``submit``, ``poll``)
        # this engine loads adapters (its EngineSpec.loads_adapters)
        self.lora = ctx.model.lora if lora.sync_form(ctx.model.lora, True) == "adapter" else None
        self.expected_adapters: dict[str, torch.Size] = {}
        t = len(self.tp_ranks)
        tmp = None
        if ctx.model.path:
            from transformers import AutoConfig

            path = str(ctx.model.path)
            check_tp(_model_shape(AutoConfig.from_pretrained(path)), t)
            self.expected = vlm_images.parameter_names(ctx.model) or hf_parameter_names(ctx.model)
            if self.lora is not None:
                self.expected_adapters = lora.adapter_shapes(meta_model(ctx.model), self.lora)
        else:  # random init: the same weights as every other role's (same seed), in a directory for vLLM
            model = load_model(ctx.model, ctx.tokenizer, ctx.seed, torch.float32)
            check_tp(_model_shape(model.config), t)
            self.expected = {n for n, _ in model.named_parameters()}
            path = tmp = tempfile.mkdtemp(prefix="rlbatch-vllm-")
            with self.world.active():  # transformers saves on torch rank 0 only, when a world exists
                model.save_pretrained(tmp)
                ctx.tokenizer.save_pretrained(tmp)
                vlm_images.save_processor(ctx.model, ctx.tokenizer, tmp)  # a VLM's processor files
            if self.lora is not None:  # wraps the model in place: after it is saved
                self.expected_adapters = lora.adapter_shapes(model, self.lora)
            del model
        kwargs = _LLMArgs(
            model=path, tokenizer=path, dtype=_VLLM_DTYPES[dtype], seed=ctx.seed, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
            enforce_eager=a.enforce_eager or (self.on_cpu and not a.cpu_compile), logprobs_mode="processed_logprobs",
        )
        if t > 1:  # the worker's t peers: a private world of their own that vLLM adopts
            kwargs |= {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": t}
            key = f"rlbatch-vllm/{ctx.role}/tp" + "-".join(map(str, self.tp_ranks))
            self.world.join(key, self.tp_rank, t, "gloo" if self.on_cpu else "nccl", TP_WORLD_TIMEOUT_S)
        else:
            kwargs |= {"distributed_executor_backend": one_rank_executor(), "tensor_parallel_size": 1}
        if a.max_model_len:
            kwargs["max_model_len"] = a.max_model_len
        if self.lora is not None:  # one adapter at a time: the current policy version's
            kwargs |= {"enable_lora": True, "max_lora_rank": max_lora_rank(int(self.lora.rank)), "max_loras": 1}
        self.vlm = vlm_images.is_vlm_dir(path)
        if self.vlm:  # images per prompt, no video (rlbatch.engines.vllm.images)
            kwargs["limit_mm_per_prompt"] = vlm_images.MM_LIMITS
        if a.kv_cache_mb or self.on_cpu:
            kwargs["kv_cache_memory_bytes"] = (a.kv_cache_mb or CPU_KV_CACHE_MB) << 20
        if not self.on_cpu:
            kwargs |= {"gpu_memory_utilization": a.gpu_memory_utilization, "enable_sleep_mode": True}
        if self.updates_in_flight:  # no step queued ahead: the tokens of a step are of the weights it started with
            kwargs["async_scheduling"] = False
        # Engine core in this process (no background process to ship weights to).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        start = time.perf_counter()
        try:
            from vllm import LLM

            cache_root = compile_cache_root(self.tp_ranks[self.tp_rank])
            with (rng_kept(), self.world.active(), _launcher_env(self.tp_rank, ctx.device, cache_root),
                  private_shm_names(t > 1 and self.on_cpu)):
                self.llm: LLM = LLM(**kwargs)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        # vLLM's shutdown ends with destroy_process_group() on the default group, which in torch
        # destroys every group of the process, the program's included: it must not run at exit
        # (after the program's teardown) nor in the program's world. ``close`` frees the engine.
        getattr(self.llm.llm_engine.engine_core, "_finalizer").detach()  # noqa: B009 (private)
        log.info("vLLM %s engine started in %.1fs (%s, %s, %s, t=%d%s)", ctx.role, time.perf_counter() - start,
                 "CPU" if self.on_cpu else str(ctx.device), dtype, "eager" if kwargs["enforce_eager"] else "compiled", t,
                 f", tp rank {self.tp_rank} of world ranks {list(self.tp_ranks)}" if t > 1 else "")
        self._received: set[str] = set()
        self._adapter_parts: dict[str, torch.Tensor] = {}  # adapters of a sync under way (``load_adapters``)
        self._weights_lost = False
        """The weights were discarded (level-2 sleep) and no complete sync has loaded them since."""
        self._resident = StaysResident(log, _NO_SLEEP)

    def _core(self) -> EngineCore:
        """vLLM's engine core, which runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        return cast("InprocClient", self.llm.llm_engine.engine_core).engine_core

    def close(self) -> None:
        """Stop the engine core (its executor and scheduler) and let its memory go; vLLM's one-rank
        world is left to process exit. The engine is unusable afterwards."""
        core = self._core()
        with self.world.active():
            core.model_executor.shutdown()
            core.scheduler.shutdown()

    # -- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: Sequence[Sequence[vlm_images.ImageLike]] | None = None) -> list[Generation]:
        """``images``: each prompt's images (PIL or encoded bytes; ``prompts`` are the processor's ids,
        ``rlbatch.engines.vllm.images``), or None for text prompts."""
        self._check_no_partial_sync()
        self._check_awake()
        if self._stale_prefix:  # nothing runs now: the blocks of the previous weights can go
            with self.world.active():
                self._stale_prefix = self.llm.reset_prefix_cache() is False
        if self.between_steps is not None:
            if images is not None:
                raise NotImplementedError("vllm engine: image prompts with weights landing mid-generation")
            return self._generate_in_flight(prompts, params, self.between_steps)
        groups = vlm_images.group_prompts(prompts, images)  # distinct prompt (ids, images) -> positions
        greedy = params.temperature <= 0
        # vLLM refuses n>1 when greedy: a greedy group is its prompt's copies as requests of n=1
        # (all the same answer; the prefix cache still shares the prompt).
        units = [[r] for rows in groups.values() for r in rows] if greedy else list(groups.values())
        requests = vlm_images.requests(prompts, images, [rows[0] for rows in units],
                                       self.tokenizer if images is not None else None)
        sampling = [_sampling(params, len(rows)) for rows in units]
        torch.manual_seed(params.seed)  # vLLM's sampler draws from the process RNG
        with self.world.active():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, **self._adapter())
        if images is not None:  # vLLM expanded each image's pad to the processor's prompt
            vlm_images.check_prompts(prompts, images, [rows[0] for rows in units], [o.prompt_token_ids for o in outputs])
        out: list[Generation | None] = [None] * len(prompts)
        for rows, result in zip(units, outputs, strict=True):
            for row, completion in zip(rows, sorted(result.outputs, key=lambda c: c.index), strict=True):
                out[row] = _generation(completion, [params.version] * len(completion.token_ids))
        assert all(g is not None for g in out)
        return out  # type: ignore[return-value]

    def _generate_in_flight(self, prompts: list[list[int]], params: SamplingParams,
                            between_steps: Callable[[], int | None]) -> list[Generation]:
        """``generate`` with weights landing between engine steps: each sample one request (each
        with its own output, the prefix cache still sharing a group's prompt), driven step by step.
        Before each step ``between_steps`` may load new weights; the tokens a step samples carry the
        version of the weights it ran with. The sequences in flight go on from their KV cache as it
        is, or, with ``algo.in_flight_kv=recompute``, are preempted and prefilled again (prompt and
        tokens so far) under the new weights."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        sampling = _sampling(params, 1)  # cumulative outputs: the tokens so far after every step
        rows: dict[str, int] = {}
        torch.manual_seed(params.seed)  # vLLM's sampler draws from the process RNG
        with self.world.active():
            for row, prompt in enumerate(prompts):
                self._requests += 1
                rid = f"gen-{self._requests}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), sampling, **self._adapter())
                rows[rid] = row
        version = params.version
        stamps: dict[str, list[int]] = {rid: [] for rid in rows}
        done: dict[str, CompletionOutput] = {}
        while len(done) < len(rows):
            landed = between_steps()  # outside vLLM's world: a sync's broadcast runs in the program's
            with self.world.active():
                if landed is not None:
                    version = landed
                    if self.recompute_kv:
                        self.llm.reset_prefix_cache(reset_running_requests=True)
                results = engine.step()
                self._step_kept(results, version)  # partial rollouts' kept requests step along
                for result in results:
                    if result.request_id not in rows:
                        continue
                    completion = cast("RequestOutput", result).outputs[0]
                    got = stamps[result.request_id]
                    got += [version] * (len(completion.token_ids) - len(got))
                    if result.finished:
                        done[result.request_id] = completion
        return [_generation(done[rid], stamps[rid]) for rid in sorted(rows, key=rows.__getitem__)]

    @torch.no_grad()
    def generate_some(self, keys: list[int], prompts: list[list[int]], params: SamplingParams, group: int,
                      take: int) -> list[tuple[int, Generation]]:
        """Partial rollouts (``algo.partial_rollouts``): one request per sample (``keys``: the sample
        ids, ``group`` consecutive ids of one prompt) joins the requests kept from earlier calls, and
        the engine steps until ``take`` whole groups have finished. Those are returned (the first
        to finish; on a tie, the lower group id first), sorted by sample id. The rest stay in the
        engine: unfinished requests are not stepped until the next call goes on with them (under
        whatever weights landed meanwhile), finished groups past ``take`` wait for the next call.
        Each token carries the version of the weights that sampled it: a kept sample's tokens may
        span several versions. Weights land between steps as in ``generate`` (``between_steps``).
        Kept groups that can no longer be trained are stopped and returned too, beside the ``take``
        asked for (``_stop_stale``)."""
        from vllm.inputs import TokensPrompt

        self._check_no_partial_sync()
        self._check_awake()
        if take < 0 or group < 1:
            raise ValueError(f"generate_some: take {take} must be >= 0 and group {group} >= 1")
        engine = self.llm.llm_engine
        with self.world.active():
            if self._stale_prefix:  # resets only once no request holds blocks (no kept request left)
                self._stale_prefix = self.llm.reset_prefix_cache() is False
            if self.recompute_kv and self._kept and params.version != self._kept_version:
                self.llm.reset_prefix_cache(reset_running_requests=True)  # weights loaded between calls
            sampling = _sampling(params, 1)  # cumulative outputs: the tokens so far after every step
            torch.manual_seed(params.seed)  # vLLM's sampler draws from the process RNG
            for kept in self._restore:  # restored from a checkpoint: prompt and tokens so far prefilled
                rid = f"part-{kept['key']}"
                left = params.max_new_tokens - len(kept["tokens"])
                if left < 1:
                    raise ValueError(f"generate_some: restored sample {kept['key']} has {len(kept['tokens'])} tokens "
                                     f"and is unfinished, but max_new_tokens is {params.max_new_tokens}")
                engine.add_request(rid, TokensPrompt(prompt_token_ids=kept["prompt"] + kept["tokens"]),
                                   _sampling(replace(params, max_new_tokens=left), 1), **self._adapter())
                self._kept[rid] = (kept["key"], list(kept["versions"]))
                self._prompt[rid] = list(kept["prompt"])
                self._before[rid] = (list(kept["tokens"]), list(kept["logprobs"]))
            self._restore = []
            for key, prompt in zip(keys, prompts, strict=True):
                rid = f"part-{key}"
                if rid in self._kept or key in self._finished:
                    raise ValueError(f"generate_some: sample {key} is already kept by the engine")
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), sampling, **self._adapter())
                self._kept[rid] = (key, [])
                self._prompt[rid] = list(prompt)
        version = params.version
        self._group = group
        stopped = self._stop_stale(version)  # groups that cannot be trained, returned beside those asked for
        while len(self._ready) < take:
            if not self._kept:
                if stopped:  # the rest stopped as stale: what finished, and those
                    break
                raise RuntimeError(f"generate_some: {len(self._ready)} whole groups of {group} finished and no request "
                                   f"is left to finish {take}")
            landed = self.between_steps() if self.between_steps is not None else None
            with self.world.active():
                if landed is not None:
                    version = landed
                    if self.recompute_kv:
                        self.llm.reset_prefix_cache(reset_running_requests=True)
                self._step_kept(engine.step(), version)
            if landed is not None:
                stopped += self._stop_stale(version)
        self._kept_version = version
        out: list[tuple[int, Generation]] = []
        for g in [*self._ready[:take], *stopped]:
            del self._group_done[g]
            for key in sorted(k for k in self._finished if k // group == g):
                out.append((key, self._finished.pop(key)))
                del self._prompt[f"part-{key}"]
        self._ready = self._ready[take:]
        return sorted(out, key=lambda kg: kg[0])

    def _stop_stale(self, version: int) -> list[int]:
        """Stop the kept groups that can no longer be trained under weights of ``version``: one of
        their samples holds a token more than ``bound`` versions older. Their unfinished requests are
        aborted and each such sample kept as it is (its tokens so far); the group goes back with this
        call's answer beside the whole groups asked for, and the controller drops it, counted
        (``train/stale_dropped``), as it drops any stale group. A group one of whose samples has no
        token yet is left to run (a sample's first token decides nothing, and an empty one would
        reach the phases that read the answer before the drop). Returns the groups stopped."""
        if self.bound is None or not self._kept:
            return []
        oldest: dict[int, int] = {}
        running: dict[int, list[str]] = {}
        for rid, (key, stamps) in self._kept.items():
            g = key // self._group
            running.setdefault(g, []).append(rid)
            oldest[g] = min(oldest.get(g, version), stamps[0] if stamps else version)
        for key, gen in self._finished.items():
            if key // self._group in running and gen.versions:
                oldest[key // self._group] = min(oldest[key // self._group], gen.versions[0])
        stale = [g for g, rids in running.items() if version - oldest[g] > self.bound
                 and all(self._kept[rid][1] for rid in rids)]
        if not stale:
            return []
        rids = [rid for g in stale for rid in running[g]]
        for rid in rids:
            sample = self._kept_sample(rid)
            self._finished[sample["key"]] = Generation(sample["tokens"], sample["logprobs"], sample["versions"])
        with self.world.active():
            self.llm.llm_engine.abort_request(rids)
        for rid in rids:
            del self._kept[rid]
            self._latest.pop(rid, None)
            self._before.pop(rid, None)
        for g in stale:
            self._group_done[g] = self._group
        log.info("partial rollouts: %d group(s) stopped at version %d, a token of theirs older than %d versions "
                 "(they cannot be trained)", len(stale), version, self.bound)
        return sorted(stale)

    def _step_kept(self, results: list[RequestOutput | PoolingRequestOutput], version: int) -> None:
        """Record an engine step's tokens of the kept requests (sampled by ``version``), and the
        groups it finished whole (``_ready``, lower group id first)."""
        whole: list[int] = []
        for result in results:
            if result.request_id not in self._kept:
                continue
            rid = result.request_id
            key, stamps = self._kept[rid]
            completion = cast("RequestOutput", result).outputs[0]
            before, before_lp = self._before.get(rid, ([], []))
            stamps += [version] * (len(before) + len(completion.token_ids) - len(stamps))
            self._latest[rid] = completion
            if result.finished:
                del self._kept[rid], self._latest[rid]
                self._before.pop(rid, None)
                gen = _generation(completion, stamps[len(before):])
                self._finished[key] = Generation(before + gen.tokens, before_lp + gen.logprobs, stamps)
                g = key // self._group
                self._group_done[g] = self._group_done.get(g, 0) + 1
                if self._group_done[g] == self._group:
                    whole.append(g)
        self._ready += sorted(whole)

    def kept(self) -> int:
        """Samples the engine keeps across ``generate_some`` calls: unfinished, or finished and not returned."""
        return len(self._kept) + len(self._finished) + len(self._restore)

    def kept_state(self) -> KeptState:
        """What the engine holds between two ``generate_some`` calls, for a checkpoint: each kept
        sample's prompt, tokens so far with their log-probs and versions; the unfinished ones in
        the order vLLM's scheduler holds them (running, then waiting).

        The engine then holds them as a restored one does (``restore_kept``): the unfinished requests
        are aborted and the prefix cache reset, and the next call adds each again, in that order,
        as a request whose prompt is its prompt and tokens so far. So the run that wrote the
        checkpoint and the one resumed from it go on from the same state (vLLM's CPU sampler draws
        from the process RNG for the batch as a whole; preempting the requests instead, with
        ``reset_prefix_cache(reset_running_requests=True)``, did not sample what new requests of the
        same tokens do). The cost: the unfinished samples' prompts and tokens are prefilled once more, under
        the weights then held (with ``in_flight_kv=keep`` their earlier tokens' KV cache is then the
        current weights', as with ``recompute``)."""
        if self._kept:
            parked = [self._kept_sample(rid) for rid in self._scheduled_order()]
            with self.world.active():
                self.llm.llm_engine.abort_request(list(self._kept))
                self._stale_prefix = self.llm.reset_prefix_cache() is False
            for rid in self._kept:
                del self._prompt[rid]
            self._kept, self._latest, self._before = {}, {}, {}
            self._restore = parked + self._restore
        samples = list(self._restore)
        for key, gen in self._finished.items():
            done: KeptSample = {"key": key, "prompt": list(self._prompt[f"part-{key}"]), "tokens": list(gen.tokens),
                                "logprobs": list(gen.logprobs), "versions": list(gen.versions), "finished": True}
            samples.append(done)
        state: KeptState = {"samples": samples, "group": self._group, "ready": list(self._ready),
                            "version": self._kept_version}
        return state

    def restore_kept(self, state: KeptState) -> None:
        """Hold again what ``kept_state`` read (into an engine that holds nothing): the finished
        samples as they were, the unfinished ones added by the next ``generate_some`` call before its
        own, each a request whose prompt is its prompt and tokens so far (its log-probs and versions
        so far kept beside it), generating the tokens it has left."""
        if self.kept():
            raise RuntimeError(f"vllm engine: restoring kept samples into an engine that keeps {self.kept()}")
        self._group, self._ready, self._kept_version = int(state["group"]), list(state["ready"]), int(state["version"])
        with self.world.active():
            self._stale_prefix = self.llm.reset_prefix_cache() is False
        self._restore = [s for s in state["samples"] if not s["finished"]]
        self._group_done = {}
        for s in state["samples"]:
            if s["finished"]:
                self._finished[s["key"]] = Generation(list(s["tokens"]), list(s["logprobs"]), list(s["versions"]))
                self._prompt[f"part-{s['key']}"] = list(s["prompt"])
                g = s["key"] // self._group
                self._group_done[g] = self._group_done.get(g, 0) + 1

    def _kept_sample(self, rid: str) -> KeptSample:
        key, stamps = self._kept[rid]
        before, before_lp = self._before.get(rid, ([], []))
        latest = self._latest.get(rid)
        gen = _generation(latest, stamps[len(before):]) if latest is not None else Generation([], [], [])
        sample: KeptSample = {"key": key, "prompt": list(self._prompt[rid]), "tokens": before + gen.tokens,
                              "logprobs": before_lp + gen.logprobs, "versions": list(stamps), "finished": False}
        return sample

    def _scheduled_order(self) -> list[str]:
        """The kept unfinished requests in the order vLLM's scheduler holds them: running, then
        waiting (the order they are prefilled again in after a preemption); the order they were
        added in where the scheduler cannot be read."""
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None:
            return list(self._kept)
        order = [r.request_id for r in (*scheduler.running, *scheduler.waiting) if r.request_id in self._kept]
        return order + [rid for rid in self._kept if rid not in set(order)]

    # -- turns: requests that join and leave the running batch (rlbatch.engines.base.Turns) -------

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        """Add requests to vLLM's running batch, each with its own seed (its tokens do not depend on
        what else runs), returned by ``poll`` when they finish."""
        from vllm.inputs import TokensPrompt

        self._check_no_partial_sync()
        self._check_awake()
        with self.world.active():
            for r in requests:
                if r.key in self._turns:
                    raise ValueError(f"turn request {r.key} is already in flight")
                self.llm.llm_engine.add_request(f"turn-{r.key}", TokensPrompt(prompt_token_ids=list(r.tokens)),
                                                _sampling(params, 1, seed=r.seed, final_only=True), **self._adapter())
                self._turns.add(r.key)

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out: list[tuple[int, Generation]] = []
        with self.world.active():
            while self._turns:
                for result in self.llm.llm_engine.step():
                    if result.finished and result.request_id.startswith("turn-"):
                        key = int(result.request_id.removeprefix("turn-"))
                        self._turns.discard(key)
                        # a generating model's output (vLLM types ``step`` for pooling models too)
                        completion = cast("RequestOutput", result).outputs[0]
                        out.append((key, _generation(completion, [])))
                if out or not block:
                    break
        return out

    def in_flight(self) -> int:
        return len(self._turns)

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a bucket of a sync. The first bucket opens vLLM's layerwise reload, the bucket that
        completes the model's names closes it (and resets the prefix cache). Buckets before that
        are cloned: vLLM reads them when their layers complete, after this call returns."""
        chunk = list(named)
        unknown = [n for n, _ in chunk if n not in self.expected]
        if unknown:
            raise KeyError(f"vllm engine: weights {unknown[:5]} are not parameters of the model")
        first = not self._received
        self._received |= {n for n, _ in chunk}
        last = self._received >= self.expected
        if not last:
            chunk = [(n, t.detach().clone()) for n, t in chunk]
        with self.world.active():
            self.llm.collective_rpc(_load_bucket, args=(chunk, first, last))
            if last:
                self._received = set()
                self._weights_lost = False
                # refused while requests hold blocks (weights landed mid-generation): done before the next
                self._stale_prefix = self.llm.reset_prefix_cache() is False
                if self.vlm:  # vLLM keeps images' vision-tower outputs by image across requests
                    self.llm.llm_engine.reset_encoder_cache()
        return sum(t.numel() * t.element_size() for _, t in chunk)

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None  # vLLM fuses and (on CPU) repacks its weights: no view of them in HF layout

    @torch.no_grad()
    def load_adapters(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a bucket of a sync of adapters (PEFT's names, ``rlbatch.models.lora.adapter_name``).
        Buckets are copied (a sync reuses its staging buffer) until every adapter has come; then they
        become the next policy version's LoRA adapter on every worker, in place of the last, and the
        prefix cache is reset. Returns the bytes loaded."""
        if self.lora is None:
            raise RuntimeError("vllm engine: adapters synced into an engine started without them (model.lora.sync)")
        chunk = list(named)
        wrong = [(n, tuple(t.shape)) for n, t in chunk if self.expected_adapters.get(n) != t.shape]
        if wrong:
            raise KeyError(f"vllm engine: {wrong[:3]} are not the adapters of the model (by name and shape, e.g. "
                           f"{next(iter(self.expected_adapters.items()), None)})")
        for n, t in chunk:
            self._adapter_parts[n] = t.detach().clone()
        if self._adapter_parts.keys() >= self.expected_adapters.keys():
            if self._turns:
                raise RuntimeError(f"vllm engine: an adapter sync while {len(self._turns)} turn requests run on the "
                                   f"previous version's adapters")
            from vllm.lora.request import LoRARequest

            version, tensors = self.adapter_version + 1, self._adapter_parts
            self._adapter_parts = {}
            with self.world.active():
                self.llm.collective_rpc(_add_adapter, args=(version, tensors, lora.adapter_config(self.lora)))
                self.llm.reset_prefix_cache()
            # vLLM asks for a path; the adapter is already registered under its id and never read from it
            self._lora_request = LoRARequest(f"rlbatch-policy-v{version}", version, f"rlbatch://policy/v{version}")
            self.adapter_version = version
        return sum(t.numel() * t.element_size() for _, t in chunk)

    def _adapter(self) -> _AdapterArg:
        """A request's adapter (``lora_request``) once a sync has brought one; nothing before."""
        return {} if self._lora_request is None else {"lora_request": self._lora_request}

    def _check_no_partial_sync(self) -> None:
        if self._received:
            missing = sorted(self.expected - self._received)
            raise RuntimeError(f"vllm engine: generate during an incomplete weight sync; not yet received: {missing[:5]} "
                               f"({len(missing)} in all)")
        if self.lora is not None and self._adapter_parts:
            missing = sorted(self.expected_adapters.keys() - self._adapter_parts.keys())
            raise RuntimeError(f"vllm engine: generate during an incomplete adapter sync; not yet received: "
                               f"{missing[:5]} ({len(missing)} in all)")

    # -- device state -------------------------------------------------------------------------
    # What is asleep is read from vLLM's executor (its ``sleeping_tags``), never kept beside it: vLLM
    # ignores some calls with no more than a warning (``sleep`` while the weights sleep, the whole
    # ``wake_up(tags)`` when one of the tags is awake), and a record of the calls made drifts from
    # what vLLM did. Reachable states: all awake, the KV cache asleep (after a sync woke the weights
    # or a KV-only offload), or both asleep; waking the KV cache wakes the weights with it.

    @property
    def state_kinds(self) -> tuple[str, ...]:
        return ("params", "kv_cache")

    def asleep(self) -> set[str]:
        """The state kinds vLLM holds asleep (its executor's tags)."""
        tags = self._core().model_executor.sleeping_tags
        return {k for k, tag in _SLEEP_TAGS.items() if tag in tags}

    def offload(self, kinds: Iterable[str]) -> Transfer:
        """GPU: vLLM's level-1 sleep when the weights go (weights to pinned host memory, KV cache
        dropped); the KV cache alone is released with the weights left in place."""
        return self._put_away(kinds, level=1)

    def discard(self, kinds: Iterable[str]) -> Transfer:
        """Like ``offload``, but the weights are dropped, not copied (level-2 sleep): for when the
        next use of them is a weight sync, which overwrites them all. Generating before a complete
        sync has loaded them again is refused. With adapters synced alone (``load_adapters``) a sync
        brings no base weights: they are kept (``offload``'s level 1)."""
        return self._put_away(kinds, level=1 if self.lora is not None else 2)

    def _put_away(self, kinds: Iterable[str], level: int) -> Transfer:
        go = {k for k in kinds if k in self.state_kinds}
        if self.on_cpu:
            return self._resident() if go else Transfer()
        go -= self.asleep()
        if not go:
            return Transfer()
        start, free = time.perf_counter(), free_device_bytes(self.device)
        with self.world.active():
            if "params" in go:
                self.llm.sleep(level=level)
            else:  # the KV cache alone: pause the scheduler (level 0), then release its memory
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
        missed = go - self.asleep()
        if missed:
            raise RuntimeError(f"vllm engine: vLLM left {sorted(missed)} awake after sleep (asleep: {sorted(self.asleep())})")
        if "params" in go and level == 2:
            self._weights_lost = True
        freed = free_device_bytes(self.device) - free
        return Transfer(max(0, freed), time.perf_counter() - start, 0)

    def reload(self, kinds: Iterable[str]) -> Transfer:
        """GPU: wake up the asked kinds that are asleep (``weights``/``kv_cache`` tags; the weights
        with the KV cache); the prefix cache is reset once the KV cache is back, since its contents
        were dropped."""
        want = {k for k in kinds if k in self.state_kinds}
        if "kv_cache" in want:
            want.add("params")  # a KV cache is of use only beside the weights
        if self.on_cpu:
            return Transfer()
        wake = want & self.asleep()
        if not wake:
            return Transfer()
        start, free = time.perf_counter(), free_device_bytes(self.device)
        with self.world.active():
            self.llm.wake_up(tags=sorted(_SLEEP_TAGS[k] for k in wake))
            if "kv_cache" in wake:
                self.llm.reset_prefix_cache()
        still = wake & self.asleep()
        if still:
            raise RuntimeError(f"vllm engine: vLLM did not wake {sorted(still)} (asleep: {sorted(self.asleep())})")
        taken = free - free_device_bytes(self.device)
        return Transfer(max(0, taken), time.perf_counter() - start, 0)

    def _check_awake(self) -> None:
        """vLLM with any state asleep holds its scheduler paused and would wait for ever; with the
        weights discarded it would generate from whatever the memory holds."""
        if self.on_cpu:
            return
        asleep = self.asleep()
        if asleep:
            raise RuntimeError(f"vllm engine: generate while vLLM holds {sorted(asleep)} asleep (the phase must reload "
                               f"them first)")
        if self._weights_lost:
            raise RuntimeError("vllm engine: generate after its weights were discarded (level-2 sleep, because a weight "
                               "sync was announced to come first) and before a complete sync loaded them again")


def _sampling(params: SamplingParams, n: int, seed: int | None = None, final_only: bool = False) -> VllmSamplingParams:
    """vLLM's sampling parameters for ``params``: n samples of one prompt, log-probs of the sampled
    tokens under the distribution they are drawn from, the whole vocabulary (top_k 0), greedy at
    temperature 0. ``seed``: the request's own generator (None: the process RNG). ``final_only``:
    the engine's step reports the request once, finished (``LLM.generate`` sets it itself)."""
    from vllm import SamplingParams as VSampling
    from vllm.sampling_params import RequestOutputKind

    greedy = params.temperature <= 0
    return VSampling(n=n, max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
                     top_p=1.0 if greedy else params.top_p, top_k=0, logprobs=0, stop=list(params.stop_strings) or None,
                     seed=seed, skip_special_tokens=False,
                     output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE)


def _generation(completion: CompletionOutput, versions: list[int]) -> Generation:
    """A vLLM completion as a ``Generation``: its tokens, the log-prob of each, and the policy
    version of each (empty: not recorded)."""
    tokens = list(completion.token_ids)
    if versions and len(versions) != len(tokens):
        raise RuntimeError(f"vllm engine: {len(versions)} token versions recorded for {len(tokens)} tokens")
    return Generation(tokens, [_logprob(step, tok) for tok, step in zip(tokens, completion.logprobs or [], strict=True)],
                      versions)


def _logprob(step: LogprobsOnePosition | None, token: int) -> float:
    """The log-prob of ``token``, sampled at a step of a completion (``SamplingParams.logprobs=0``:
    vLLM gives the sampled token's at every step)."""
    if step is None:
        raise RuntimeError("vllm engine: a completion step without log-probs")
    return float(step[token].logprob)


class _LoadsWeights(Protocol):
    """A vLLM model: it loads (name, tensor) pairs under the checkpoint's names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


def _load_bucket(worker: Worker, chunk: list[tuple[str, torch.Tensor]], first: bool, last: bool) -> None:
    """Runs on the vLLM worker: one bucket of a layerwise reload (``reload_weights`` split in three)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        if first:
            initialize_layerwise_reload(model)
        cast("_LoadsWeights", model).load_weights(iter(chunk))
        if last:
            finish_layerwise_reload(model, worker.vllm_config)


def _add_adapter(worker: Worker, version: int, tensors: dict[str, torch.Tensor], config: dict[str, object]) -> None:
    """Runs on the vLLM worker: ``tensors`` (the whole adapters, PEFT's names; a tp worker keeps its
    shard when it activates them) as LoRA adapter ``version``, every other adapter removed. What vLLM's
    own ``WorkerLoRAManager._load_adapter`` does from a directory, from memory instead."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config | {"vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    dtype = cast("torch.dtype", manager.lora_config.lora_dtype)  # vLLM resolves 'auto' (or a name) when it starts
    adapter = LoRAModel.from_lora_tensors(version, tensors, helper, device="cpu", dtype=dtype,
                                          model_vocab_size=manager.vocab_size,
                                          weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                          skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    for old in manager.list_adapters():
        manager.remove_adapter(old)
    manager._adapter_manager.add_adapter(adapter)


def finish_layerwise_reload(model: torch.nn.Module, vllm_config: VllmConfig) -> None:
    """Close a layerwise reload: vLLM's ``finalize_layerwise_reload``, then the repacking it misses
    on CPU (``_reprocess_tied_head``, ``_reprocess_cpu_experts``)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, vllm_config.model_config)
    _reprocess_tied_head(model)
    _reprocess_cpu_experts(model)


def _reprocess_cpu_experts(model: torch.nn.Module) -> None:
    """A Mixture-of-Experts layer's post-load processing, re-run by the reload, skips the experts'
    own step once its kernel is built (``fused_experts.process_weights_after_loading``, to keep
    captured CUDA-graph addresses). On CPU that step packs the routed experts' weights into the
    grouped-GEMM layout the kernel reads: skipped, the reloaded weights stay in checkpoint layout
    and the layer computes garbage, without an error. Re-run it for vLLM's CPU experts."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernels
        return
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)


def _reprocess_tied_head(model: torch.nn.Module) -> None:
    """A tied lm_head shares the embedding's weight but is a layer of its own, which the reload
    never sees load anything: on CPU it keeps the GEMM kernel packed from the old weight at start-up
    (``dispatch_cpu_unquantized_gemm``). Re-run its post-load processing from the shared weight.
    A vision-language model (Qwen2-VL) holds the head in its ``language_model``."""
    model = getattr(model, "language_model", model)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
