"""rlbatch's vLLM engine against its hf engine on a long-response workload, one process.

    python tools/bench/vllm_vs_hf.py [--prompts 64 --samples 8 --prompt-len 128 --new-tokens 256 --repeats 1]

Both engines are built through the engine API (``build_engine``) from one random-init Qwen2
directory (tools/bench/vllm_common.py: ~26M parameters, head_dim 64, a 16k-token vocabulary so
responses run to the cap) and generate the same GRPO-shaped batch: every prompt repeated
``--samples`` times, temperature 1, ``--new-tokens`` at most. One small call each warms them up
(vLLM's first call sets up its kernels); then they run alternately ``--repeats`` times each.
Prints generated tokens per second of each (responses end at EOS, so the counts differ a
little), and the ratio vLLM / hf.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout
from tools.bench import vllm_common as common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_workload_flags(p, prompts=64, samples=8, prompt_len=128, new_tokens=256, repeats=1)
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=512, help="vLLM: sequences decoded together")
    common.add_model_flags(p, hidden=384, layers=6, heads=6, kv_heads=2, ffn=1536, vocab=16384)
    a = p.parse_args(argv)
    common.set_threads(a.threads)

    from rlbatch.engines.base import SamplingParams
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.vllm import VLLMArgs

    with tempfile.TemporaryDirectory(prefix="bench-vllm-hf-") as tmp:
        params = common.make_model_dir(Path(tmp), a)
        cfg = common.model_config(Path(tmp))
        engines = {
            "hf": common.build("hf", HFArgs(), cfg, a.seed),
            "vllm": common.build("vllm", VLLMArgs(kv_cache_mb=a.kv_cache_mb, max_num_seqs=a.max_num_seqs,
                                                  dtype="fp32"), cfg, a.seed),
        }
    distinct = common.prompts(a.prompts, a.prompt_len, a.vocab, a.seed)
    batch = [pr for pr in distinct for _ in range(a.samples)]
    print(f"model: {params / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads of "
          f"{a.hidden // a.heads}, vocab {a.vocab}), {a.threads} threads; {a.prompts} prompts x {a.samples} samples, "
          f"{a.prompt_len}-token prompts, {a.new_tokens} new tokens; {common.load_average()}", flush=True)
    for e in engines.values():  # warm-up
        e.generate(batch[:2], SamplingParams(max_new_tokens=4, seed=a.seed))
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(a.repeats):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for name in order:
            start = time.perf_counter()
            gens = engines[name].generate(batch, SamplingParams(max_new_tokens=a.new_tokens, seed=a.seed + i))
            seconds = time.perf_counter() - start
            tokens = sum(len(g.tokens) for g in gens)
            rates[name].append(tokens / seconds)
            print(f"{name:5s} {seconds:7.1f} s  {tokens} tokens  {tokens / seconds:8.0f} tokens/s  "
                  f"(mean response {tokens / len(batch):.0f} tokens)", flush=True)
    med = {n: statistics.median(r) for n, r in rates.items()}
    print(f"tokens/s (median of {a.repeats}): vllm {med['vllm']:.0f}, hf {med['hf']:.0f}; "
          f"ratio vllm / hf: {med['vllm'] / med['hf']:.2f}x; {common.load_average()}")
    engines["vllm"].close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
