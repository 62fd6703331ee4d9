"""Seconds per phase, as features that calibration weighs.

Every phase's time is a sum of features, each already in seconds at the profile's priors:

- ``roofline``: each kernel group takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth);
  decode steps are summed one by one, so a long-tail batch pays for its last sequence;
- ``overhead``: ops dispatched times ``op_overhead_s`` (what a tiny model or a CPU run is made of);
- ``comm``: exposed collective time from the alpha-beta formulas of ``comm.py``;
- ``transfer``: offload / reload / weight-copy bytes over the copy bandwidth;
- ``fixed`` (1 per phase) and ``transitions`` (state kinds moved): counts whose seconds only
  calibration knows.

``Coefficients`` (calibrate.py) multiply each feature per phase kind; with none, the priors hold.
Training FLOPs are 3x the forward (the usual 6 * params * tokens), 4x with recompute.
"""

from __future__ import annotations

import math

from rlbatch.config.hardware import Hardware
from rlbatch.config.schema import HEADS
from rlbatch.models.shape import OPS_PER_LAYER_FWD, OPS_PER_MODEL_FWD, ModelShape
from rlbatch.placement import BackendSpec
from rlbatch.plan import comm
from rlbatch.plan.activations import traffic_per_token
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.passes import Cut, Packing, adapted, varlen_rows
from rlbatch.plan.rates import Rates, cpu_attention_ops, rates, tp_link
from rlbatch.plan.workload import Workload

Features = dict[str, float]

LOSS_OPS = 60
"""Ops of the loss per micro-batch (log-probs, ratio, clip, KL, aggregation) and its backward."""
OPT_OPS_PER_TENSOR = 12
"""AdamW + grad-norm clipping ops per parameter tensor (foreach kernels loop over tensors)."""
SYNC_OPS_PER_TENSOR = 6
"""Weight sync per tensor: gather to full, cast, copy into the engine, bookkeeping."""
COPY_OPS_PER_TENSOR = 2
"""Offload / reload per tensor: one copy and one free or allocation."""
SAMPLE_OPS_PASS = 1.0
"""Host work per sample of a log-prob pass: the store's get and put, ``pack``, ``unpack``
(measured the same way: 4.9-6.6 us)."""
SAMPLE_OPS_TRAIN = 3.0
"""Host work per sample of a training call: its advantage tensor, the store's get of five fields,
``pack`` per mini-batch (measured the same way: 15-19 us)."""
SHARD_COLLECTIVE_OPS = 450
"""Host cost of one FSDP2 collective on a CPU profile beyond the link's latency: copy-in, the gloo
call, copy-out, the hooks, and waiting for the peer that ranks sharing cores makes likely. Measured
on the cpu profile's VM with a unit per layer (27 collectives per two-mini-batch train call of the
2-layer model): d2 training and log-prob passes cost about 2.7 ms per collective more than d1."""
WORKER_OPS = 4
"""The controller's work per rank it commands in a phase: pickle and send the command, receive and
unpickle the reply (a few op-equivalents)."""
REWARD_OPS_PER_SAMPLE = 20
"""A rule reward per sample: decode, parse, compare (a few Python-level op equivalents)."""
SANDBOX_EXEC_CPU_S = 0.05
"""CPU seconds of one sandboxed execution of a small program and its tests (a fresh interpreter in
its own namespaces): ~0.05 s on the cpu profile's VM (tools/bench/sandbox.py; docs/benchmarks.md)."""


def _fwd_ops(shape: ModelShape, p: int) -> int:
    # a vision tower's blocks (on the first stage) cost about a decoder layer's host work each
    tower = shape.tower.depth + 1 if shape.tower is not None else 0
    return (math.ceil(shape.layers / p) + tower) * OPS_PER_LAYER_FWD + OPS_PER_MODEL_FWD


def _dp_link(layout: Layout, r: RoleLayout, hw: Hardware) -> tuple[int, comm.Link]:
    """Size and link of the role's data-parallel (FSDP sharding) group: stride t, d*c ranks."""
    b = r.backend
    assert b is not None
    n = b.d * b.c
    return n, comm.link(hw, layout.group_spans_nodes(r.name, b.t, n))


def _fully_sharded(r: RoleLayout) -> bool:
    """FSDP or ZeRO-3: parameters are gathered unit by unit for every pass (its cost model's)."""
    return cost_of(r.engine).gathers_each_pass(r)


def _sharding_collectives(r: RoleLayout, shape: ModelShape, train: bool, n: int) -> int:
    """FSDP / ZeRO-3 collectives per micro-batch: an all-gather per unit forward, again in
    backward, and a reduce-scatter per unit; none on one rank."""
    if n <= 1 or not _fully_sharded(r):
        return 0
    return cost_of(r.engine).units(r, shape) * (3 if train else 1)


def _engine_comm(r: RoleLayout, shape: ModelShape, e: int, hw: Hardware, layout: Layout, mb: int, s: float,
                 train: bool) -> tuple[float, float]:
    """(per micro-batch sharding comm that overlaps compute, per micro-batch TP/EP comm that does not)."""
    b = r.backend
    assert b is not None
    n, dl = _dp_link(layout, r, hw)
    P = shape.params
    overlapped, exposed = 0.0, 0.0
    if _fully_sharded(r):
        # One all-gather per sharded unit (each decoder layer and the root), forward and again in
        # backward (reshard_after_forward), and one fp32 reduce-scatter per unit: latency per unit.
        units = cost_of(r.engine).units(r, shape)
        gathers = 2 if train else 1
        overlapped = gathers * units * comm.all_gather(e * P / b.t / units, n, dl)
        if train:
            overlapped += units * comm.reduce_scatter(4 * P / b.t / units, n, dl)
    if b.t > 1:
        per = (4 if train else 2) * math.ceil(shape.layers / b.p)
        exposed += per * comm.all_reduce(mb * s * shape.hidden * e, b.t, tp_link(layout, r, hw))
    ep = b.ffn.e if b.ffn is not None else b.e
    if shape.experts and ep > 1:
        per = (4 if train else 2) * math.ceil(shape.layers / b.p)
        tok = mb * s * max(1, shape.experts_per_token) * shape.hidden * e
        exposed += per * comm.all_to_all(tok, ep, comm.link(hw, layout.group_spans_nodes(r.name, b.t, ep)))
    if b.p > 1:
        exposed += (4 if train else 2) * comm.broadcast(mb * s * shape.hidden * e / b.t, 2, comm.link(hw, False))
    return overlapped, exposed


def _bubble(b: BackendSpec, micro: int) -> float:
    """1F1B pipeline: (m + p - 1) / m stage-times for m micro-batches."""
    return (micro + b.p - 1) / micro if b.p > 1 else 1.0


def forward_pass(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware, layout: Layout,
                 cut: Cut, tensors: int = 0, opt_bytes: float = 0.0, working_set: float = math.inf) -> Features:
    """A log-prob pass or the training of one role (``cut.train``) on its busiest rank, cut into
    model calls as ``cut`` (``rlbatch.plan.passes``) says."""
    b = r.backend
    assert b is not None
    t, p, c = b.t, b.p, b.c
    train = cut.train
    rt = rates(hw, layout, layout.ranks_per_node(r.ranks), working_set)
    if cut.packed is not None:
        return _packed_pass(r, shape, w, e, hw, layout, cut, cut.packed, tensors, opt_bytes, rt)
    mb, seqs, pb = cut.micro, cut.seqs, cut.padded_budget
    s = w.seq_len / c
    repeats = w.epochs if train else 1
    calls = repeats * math.ceil(seqs / mb)
    mult = _train_mult(r, w) if train else 1.0
    tokens, rows, models = cut.tokens, cut.rows, cut.models
    flops = calls * tokens * shape.fwd_flops_per_token(w.seq_len / 2) * mult / (t * p)
    flops += repeats * seqs * tower_flops(r, w, train) / (t * p)  # prompts with images are never shared
    vocab = 1 if r.name in HEADS else shape.vocab
    rows *= calls
    # Weights are read once per model call (and again in backward); activations stream through
    # elementwise ops (traffic_per_token) forward and about as much again backward.
    passes = 2 if train else 1
    byts = calls * passes * (models * e * shape.params / (t * p) + tokens * traffic_per_token(shape, e, t) / p)
    byts += rows * vocab / t * (e + 8 + (4 + e if train else 0))
    roof = max(flops / rt.flops, byts / rt.bw)
    micro = math.ceil(seqs / (cut.updates * mb)) if train and pb else w.grad_accum if train else math.ceil(seqs / mb)
    roof *= _bubble(b, micro)
    # Backward runs in autograd's C++ engine: about as much host work as the Python forward.
    ops = calls * (models * _fwd_ops(shape, p) * passes + (LOSS_OPS if train else 10))
    # Attention problems: one per sequence and head in its (full or response) call, plus one per
    # distinct prompt when prompts are shared; backward about twice the forward.
    calls_per_seq = 1.0 + (w.distinct_prompts(mb) / mb if models == 2 else 0.0)
    per_seq = (SAMPLE_OPS_TRAIN if train else SAMPLE_OPS_PASS) + (
        cpu_attention_ops(shape, p) * calls_per_seq * (3 if train else 1) if hw.is_cpu else 0.0)
    samples = repeats * seqs * per_seq * hw.op_overhead_s * rt.slow
    overlapped, exposed = _engine_comm(r, shape, e, hw, layout, mb, s, train)
    return _finish(r, shape, w, e, hw, layout, train, tensors, opt_bytes, rt, calls, roof, ops, samples,
                   overlapped, exposed)


def tower_flops(r: RoleLayout, w: Workload, train: bool) -> float:
    """FLOPs of a vision-language model's vision tower on one sequence's images in a pass: its
    forward, and in training its backward only when the tower trains (a frozen tower's inputs need
    no gradient either)."""
    return w.vision_flops * (_train_mult(r, w) if train and w.train_vision else 1.0)


def _train_mult(r: RoleLayout, w: Workload) -> float:
    """FLOPs of a trained token over a forward's: the backward's input and weight gradients (2x),
    a recomputed forward (1x more); with model.lora the policy's frozen weights get no gradient
    (the adapters' are negligible): the backward is the input gradients alone."""
    backward = 1.0 if adapted(r, w) else 2.0
    return 1.0 + backward + (1.0 if w.recompute else 0.0)


def _packed_pass(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware, layout: Layout, cut: Cut,
                 pk: Packing, tensors: int, opt_bytes: float, rt: Rates) -> Features:
    """``forward_pass`` under a token budget: real tokens only, one row per micro-batch (``pk``).
    The LM head runs at the scored positions only. In bf16/fp16 (a GPU) attention is varlen's, each
    sample's own; in fp32 sdpa's dense [N, N] mask makes a row's attention cost N^2 (every key of
    the row, not only its sample's) and its mask is written and read in every layer."""
    b = r.backend
    assert b is not None
    t, p = b.t, b.p
    train, seqs, updates = cut.train, cut.seqs, cut.updates
    repeats = w.epochs if train else 1
    calls = repeats * updates * pk.calls
    tokens, head = repeats * updates * pk.tokens, repeats * updates * pk.head
    mult = _train_mult(r, w) if train else 1.0
    vocab = 1 if r.name in HEADS else shape.vocab
    lm_head = 2.0 * shape.vocab * shape.hidden  # in matmul_params: charged at the scored positions only
    row = pk.tokens / pk.calls  # decoder positions of a row, on average
    varlen = varlen_rows(e)  # attention within each sample, no mask; else over the whole row
    ctx = w.prompt_len + w.response_mean if varlen else row
    flops = (tokens * (shape.fwd_flops_per_token(ctx) - lm_head) + head * 2.0 * vocab * shape.hidden) * mult / (t * p)
    flops += repeats * seqs * tower_flops(r, w, train) / (t * p)
    passes = 2 if train else 1
    mask = 0.0 if varlen else row * row * (1 + 2 * e * math.ceil(shape.layers / p))  # written once, read per layer
    byts = calls * passes * (e * shape.params / (t * p) + mask) + passes * tokens * traffic_per_token(shape, e, t) / p
    byts += head * vocab / t * (e + 8 + (4 + e if train else 0))
    roof = max(flops / rt.flops, byts / rt.bw) * _bubble(b, pk.calls)
    ops = calls * (_fwd_ops(shape, p) * passes + (LOSS_OPS if train else 10))
    # one attention problem per row and head (counted in its flops), host work per sample as padded
    per_seq = SAMPLE_OPS_TRAIN if train else SAMPLE_OPS_PASS
    samples = (repeats * seqs * per_seq + (calls * cpu_attention_ops(shape, p) * (3 if train else 1) if hw.is_cpu else 0.0)
               ) * hw.op_overhead_s * rt.slow
    overlapped, exposed = _engine_comm(r, shape, e, hw, layout, 1, row, train)
    return _finish(r, shape, w, e, hw, layout, train, tensors, opt_bytes, rt, calls, roof, ops, samples,
                   overlapped, exposed)


def _finish(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware, layout: Layout, train: bool,
            tensors: int, opt_bytes: float, rt: Rates, calls: int, roof: float, ops: float, samples: float,
            overlapped: float, exposed: float) -> Features:
    """A pass's communication and, in training, the optimizer steps, from its per-call figures."""
    b = r.backend
    assert b is not None
    t, p = b.t, b.p
    n, dl = _dp_link(layout, r, hw)
    if hw.is_cpu:  # gloo works on the rank's own cores: sharding comm does not hide behind compute
        collectives = calls * _sharding_collectives(r, shape, train, n)
        comm_s = calls * (exposed + overlapped) + collectives * SHARD_COLLECTIVE_OPS * hw.op_overhead_s * rt.slow
    else:
        comm_s = calls * exposed + max(calls * overlapped - roof, 0.0) + calls * overlapped / max(1, shape.layers)
    if train:
        steps = w.optimizer_steps
        roof += steps * 2 * opt_bytes / rt.bw  # Adam reads and writes every state byte once
        ops += steps * OPT_OPS_PER_TENSOR * tensors
        comm_s += steps * comm.all_reduce(8, n * t * p, dl)  # gradient-norm scalar
        if cost_of(r.engine).reduces_each_step(r):
            # Once per optimizer step: reduce-scatter grads and all-gather updated params over dp,
            # overlapped with the last backward (Megatron's overlap_grad_reduce).
            P = shape.params / (t * p)
            dpc = comm.reduce_scatter(4 * P, n, dl) + comm.all_gather(e * P, n, dl)
            comm_s += steps * max(0.0, dpc - roof / max(1, steps * w.grad_accum))
    return {"roofline": roof, "overhead": ops * hw.op_overhead_s * rt.slow, "comm": comm_s, "samples": samples,
            "fixed": 1.0}


def command(workers: int, hw: Hardware, layout: Layout) -> float:
    """Seconds the controller adds to a phase for the ranks it commands: their messages, and on a
    CPU node with more processes (ranks, controller, CPU workers) than cores, one wake-up each:
    a rank waiting for its command is asleep and must be scheduled in."""
    procs = min(layout.num_gpus, layout.gpus_per_node) + 1 + sum(r.world_size for r in layout.roles.values() if not r.is_gpu)
    wake = hw.wakeup_s if hw.is_cpu and procs > max(1, hw.cores_per_node) else 0.0
    return workers * (WORKER_OPS * hw.op_overhead_s + wake)


def reward(r: RoleLayout | None, w: Workload, hw: Hardware) -> Features:
    """Rule rewards on CPU workers: a few op-equivalents of Python per sample, spread over workers."""
    workers = r.world_size if r is not None else 1
    per = math.ceil(w.sequences / max(1, workers))
    return {"overhead": per * REWARD_OPS_PER_SAMPLE * hw.op_overhead_s, "fixed": 1.0}


def execute(r: RoleLayout | None, w: Workload, hw: Hardware, cpus: int = 1) -> Features:
    """The code sandbox: one execution per sample, each worker running as many at once as its
    cores (``cluster.cpus_per_task``; a fresh interpreter is CPU-bound). Outcomes cached from
    earlier steps are not counted: an upper bound."""
    workers = r.world_size if r is not None else 1
    per = math.ceil(w.sequences / max(1, workers))
    return {"overhead": per * SANDBOX_EXEC_CPU_S / max(1, cpus), "fixed": 1.0}


def sync(train: RoleLayout, infer: RoleLayout, shape: ModelShape, e: int, hw: Hardware, layout: Layout,
         tensors: int, params: float | None = None) -> Features:
    """Ship actor_train's weights to actor_infer: gather full tensors, then copy in-process
    (colocated: same GPUs) or broadcast to the inference GPUs (disaggregated). ``params`` and
    ``tensors``: what moves (the adapters alone with ``model.lora`` into an engine that loads them;
    default every weight)."""
    bt, bi = train.backend, infer.backend
    assert bt is not None and bi is not None
    size = e * (shape.params if params is None else params)
    rt = rates(hw, layout, layout.ranks_per_node(train.ranks))
    n, dl = _dp_link(layout, train, hw)
    # rlbatch's fsdp engine gathers a one-unit model without mixed precision (CPU) in one collective;
    # otherwise full tensors are gathered one parameter at a time: a collective latency per tensor.
    one = hw.is_cpu and cost_of(train.engine).units(train, shape) == 1
    per = 1 if one else max(1, tensors)
    comm_s = per * (comm.all_gather(size / bt.t / per, n, dl) + comm.all_gather(size / per, bt.t * bt.p, tp_link(layout, train, hw)))
    load = size / (bi.t * bi.p)
    if layout.colocated(train.name, infer.name):
        transfer = 2 * load / rt.bw  # read the gathered tensor, write the engine's copy
    else:
        group = list(train.ranks[:1]) + list(infer.ranks)
        comm_s += comm.broadcast(size, len(group), comm.link(hw, layout.nodes_of(group) > 1))
        transfer = 2 * load / rt.bw
    ops = SYNC_OPS_PER_TENSOR * tensors
    return {"comm": comm_s, "transfer": transfer, "overhead": ops * hw.op_overhead_s * rt.slow, "fixed": 1.0}


def copy_bw(hw: Hardware, layout: Layout, concurrent: int) -> float:
    """Host<->device copy bandwidth of one GPU while ``concurrent`` GPUs of its node copy too."""
    if hw.is_cpu:
        return rates(hw, layout, concurrent).bw
    return min(hw.pcie_bw, hw.host_mem_bw / max(1, concurrent)) * hw.link_eff


def transition(nbytes: float, count: int, tensors: int, hw: Hardware, layout: Layout, concurrent: int) -> Features:
    """One offload or reload on one GPU: bytes over the copy bandwidth, per-tensor ops, per-kind fixed cost."""
    if not count:
        return {}
    ops = COPY_OPS_PER_TENSOR * tensors * count
    slow = rates(hw, layout, concurrent).slow
    return {"transfer": nbytes / copy_bw(hw, layout, concurrent), "overhead": ops * hw.op_overhead_s * slow,
            "transitions": float(count)}
