"""Measure this machine for the ``cpu`` hardware profile (the one planner module that imports torch).

    .venv/bin/python -m rlbatch.plan.measure            # prints YAML lines for rlbatch/conf/hardware/cpu.yaml

On a CPU-only run every "GPU rank" is a process with ``cluster.cpus_per_task`` torch threads,
so the profile needs what one such thread achieves: fp32 matmul FLOP/s, the cost of one small
torch op (dispatcher + Python: what dominates a tiny model), memcpy bandwidth (offload, reload
and in-process weight sync are host-to-host copies here), and gloo's all-reduce latency and
bandwidth between two local processes. Numbers are the best of a few repeats (timing noise only
makes things slower).
"""

from __future__ import annotations

import os
import time
from typing import Any


def _best(fn: Any, repeats: int = 5, inner: int = 1) -> float:
    """Best wall time of ``inner`` calls of ``fn``, divided by ``inner``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def matmul_flops(threads: int) -> dict[int, float]:
    """fp32 FLOP/s of square matmuls of several sizes with ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    for n in (64, 256, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        inner = max(1, int(2e8 // (2 * n**3)))
        out[n] = 2 * n**3 / _best(lambda a=a, b=b: torch.mm(a, b), inner=inner)
    return out


def op_overhead() -> float:
    """Seconds for one tiny elementwise op: the per-op floor every kernel of a tiny model pays."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(64), torch.randn(64)
    return _best(lambda: torch.add(a, b), inner=20000)


def memcpy_bw(threads: int, nbytes: int = 256 << 20) -> float:
    """Bytes per second of one large tensor copy (bytes copied / time)."""
    import torch

    torch.set_num_threads(threads)
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)
    return nbytes / _best(lambda: dst.copy_(src))


def cache_bw(nbytes: int = 1 << 20) -> float:
    """Bytes read plus written per second by one thread's elementwise op on tensors that stay in cache."""
    import torch

    torch.set_num_threads(1)
    a, b, c = (torch.randn(nbytes // 4) for _ in range(3))
    return 3 * nbytes / _best(lambda: torch.mul(a, b, out=c), inner=50)


def per_sample_host(n: int = 512) -> dict[str, float]:
    """Seconds per sample of the host work around a pass (what the planner's SAMPLE_OPS_* stand for): the
    sample store's puts and gets, left padding, ``pack`` and ``unpack``, on GRPO-shaped samples."""
    import torch

    from rlbatch.engines.batch import distinct_prompts, left_padded, pack, unpack
    from rlbatch.runtime.dataplane import SampleStore

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    prompts = [[1, 4 + k // 32 % 10, 14, 4, 17] for k in range(n)]  # groups of 32 samples
    store = SampleStore()

    def generate() -> None:
        left_padded(prompts, 0)
        distinct_prompts(prompts)
        tensors = {tuple(p): torch.tensor(p) for p in prompts}
        for sid, p in enumerate(prompts):
            store.put(sid, "prompt", tensors[tuple(p)])
            store.put(sid, "response", torch.tensor([5, 2]))

    generate()
    ids = list(range(n))

    def logprobs() -> None:
        b = pack(store.get(ids, ["prompt", "response"]), 0, cpu, share_prompts=True)
        for sid, v in zip(ids, unpack(torch.zeros(n, 2), b.lengths), strict=True):
            store.put(sid, "old_logprobs", v)
            store.put(sid, "ref_logprobs", v)

    logprobs()

    def train() -> None:
        for sid in ids:
            store.put(sid, "advantage", torch.tensor(0.5))
        s = store.get(ids, ["prompt", "response", "old_logprobs", "ref_logprobs", "advantage"])
        pack(s[: n // 2], 0, cpu, share_prompts=True)
        pack(s[n // 2 :], 0, cpu, share_prompts=True)

    return {k: _best(f) / n for k, f in (("generate", generate), ("logprobs", logprobs), ("train", train))}


def attention_problem(seqs: int = 512, heads: int = 4) -> float:
    """Seconds per (sequence, head) of one scaled_dot_product_attention over a response token on
    its prompt's cache (rates.CPU_ATTN_OPS): a tiny model's attention is many small problems."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    q, k, v = torch.randn(seqs, heads, 1, 16), torch.randn(seqs, heads, 6, 16), torch.randn(seqs, heads, 6, 16)
    mask = torch.ones(seqs, 1, 1, 6, dtype=torch.bool)
    return _best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), inner=10) / (seqs * heads)


def _gloo_worker(rank: int, port: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for n in (1, 16 << 20):  # 4 bytes and 64 MiB of fp32
        x = torch.ones(n)
        dist.all_reduce(x)
        dist.barrier()
        res[n * 4] = _best(lambda x=x: dist.all_reduce(x), repeats=5, inner=20 if n == 1 else 1)
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def gloo_allreduce() -> tuple[float, float]:
    """(alpha seconds, link bytes/s) of a 2-process gloo ring all-reduce, from t = 2(n-1)a + 2(n-1)/n S/B."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    small, big = res[4], res[64 << 20]
    alpha = small / 2  # n = 2: 2(n-1) = 2 latency terms
    bw = (64 << 20) / max(big - 2 * alpha, 1e-9)  # 2(n-1)/n = 1 for n = 2
    return alpha, bw


def main() -> None:
    import torch

    from rlbatch.config.hardware import load_hardware

    mm1, mm2 = matmul_flops(1), matmul_flops(2)
    ovh = op_overhead()
    cp1, cp2 = memcpy_bw(1), memcpy_bw(2)
    cache = cache_bw()
    alpha, bw = gloo_allreduce()
    host, attn = per_sample_host(), attention_problem()
    print(f"# measured by: .venv/bin/python -m rlbatch.plan.measure  (torch {torch.__version__}, {os.cpu_count()} cores)")
    print("# fp32 matmul FLOP/s, 1 thread, by size: " + ", ".join(f"{n}: {v:.3g}" for n, v in mm1.items()))
    print("# fp32 matmul FLOP/s, 2 threads, by size: " + ", ".join(f"{n}: {v:.3g}" for n, v in mm2.items()))
    print(f"peak_flops: {max(mm1.values()):.4g}")
    print(f"op_overhead_s: {ovh:.3g}")
    print(f"# memcpy 1 thread {cp1:.3g} B/s, 2 threads {cp2:.3g} B/s")
    print(f"hbm_bw: {cp1:.4g}")
    print(f"pcie_bw: {cp1:.4g}")
    print(f"host_mem_bw: {max(cp1, cp2):.4g}")
    print(f"cache_bw: {cache:.4g}")
    print(f"intra_alpha_s: {alpha:.3g}")
    unit = load_hardware("cpu").op_overhead_s  # the op-equivalent rlbatch/plan/timing.py counts in
    print(f"# planner constants (rlbatch/plan/timing.py, generation.py, rates.py) in op-equivalents of the cpu "
          f"profile's {unit * 1e6:.1f} us:")
    print("#   SAMPLE_OPS_GENERATE/PASS/TRAIN: " + ", ".join(f"{k} {v * 1e6:.1f} us = {v / unit:.2g}" for k, v in host.items()))
    print(f"#   CPU_ATTN_OPS: {attn * 1e6:.2f} us = {attn / unit:.2g}")
    print(f"intra_bw: {bw:.4g}")


if __name__ == "__main__":
    main()
