"""rlbatch's vLLM engine against bare ``vllm.LLM.generate``: what the engine API costs.

    python tools/bench/vllm_engine.py [--prompts 64 --samples 8 --prompt-len 128 --new-tokens 128 --repeats 5]

One process, one random-init Qwen2 directory (tools/bench/vllm_common.py), the same prompts:
``VLLMEngine.generate`` (built with ``build_engine("vllm", ...)``, as a rank builds it) and a bare
``vllm.LLM`` started with the arguments the engine gives vLLM, sent what a vLLM user would send:
one request per distinct prompt with ``n`` samples, the sampled token's log-prob, the same seed.
The two run alternately, ``--repeats`` times each after one warm-up call each; prints both
times, the generated tokens (the same on both sides: same requests, same seed), and the ratio
engine / bare (target <= 1.10).
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
    common.add_workload_flags(p, prompts=64, samples=8, prompt_len=128, new_tokens=128, repeats=5)
    p.add_argument("--kv-cache-mb", type=int, default=512)
    common.add_model_flags(p, hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=8192)
    a = p.parse_args(argv)
    common.set_threads(a.threads)

    import torch
    from vllm import LLM
    from vllm import SamplingParams as VSampling
    from vllm.inputs import TokensPrompt

    from rlbatch.engines.base import SamplingParams
    from rlbatch.engines.vllm import VLLMArgs
    from rlbatch.engines.vllm.world import PrivateWorld

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        params = common.make_model_dir(Path(tmp), a)
        cfg = common.model_config(Path(tmp))
        args = VLLMArgs(kv_cache_mb=a.kv_cache_mb, dtype="fp32")
        engine = common.build("vllm", args, cfg, a.seed)
        bare_world = PrivateWorld()  # a one-rank torch world of its own, as the engine's
        with bare_world.active():
            llm = LLM(model=tmp, tokenizer=tmp, dtype=torch.float32, seed=a.seed, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
                      enforce_eager=True, logprobs_mode="processed_logprobs", distributed_executor_backend="uni",
                      tensor_parallel_size=1, kv_cache_memory_bytes=args.kv_cache_mb << 20)

    distinct = common.prompts(a.prompts, a.prompt_len, a.vocab, a.seed)
    repeated = [pr for pr in distinct for _ in range(a.samples)]
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=a.seed)
    requests = [TokensPrompt(prompt_token_ids=pr) for pr in distinct]
    vsp = VSampling(n=a.samples, max_tokens=a.new_tokens, temperature=1.0, top_p=1.0, top_k=0, logprobs=0)

    def ours() -> int:
        return sum(len(g.tokens) for g in engine.generate(repeated, sp))

    def bare() -> int:
        torch.manual_seed(a.seed)
        with bare_world.active():
            out = llm.generate(requests, vsp, use_tqdm=False)
        return sum(len(c.token_ids) for r in out for c in r.outputs)

    print(f"model: {params / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads, vocab {a.vocab}), "
          f"{a.threads} threads; {a.prompts} prompts x {a.samples} samples, {a.prompt_len}-token prompts, "
          f"{a.new_tokens} new tokens; {common.load_average()}", flush=True)
    times: dict[str, list[float]] = {"engine": [], "bare": []}
    tokens: dict[str, int] = {}
    for i in range(a.repeats + 1):  # the first round warms both up and is not counted
        for name, fn in (("engine", ours), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("engine", ours)):
            start = time.perf_counter()
            tokens[name] = fn()
            if i:
                times[name].append(time.perf_counter() - start)
    for name in times:
        print(f"{name:7s} {common.summary(times[name])}; {tokens[name]} tokens generated, "
              f"{tokens[name] / statistics.median(times[name]):.0f} tokens/s", flush=True)
    ratio = statistics.median(times["engine"]) / statistics.median(times["bare"])
    print(f"ratio engine / bare (median): {ratio:.3f}x (min/min {min(times['engine']) / min(times['bare']):.3f}x); "
          f"{common.load_average()}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
