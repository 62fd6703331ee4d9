"""rlbatch's SGLang engine against bare ``sglang.Engine.generate``, and against rlbatch's vLLM engine.

    python tools/bench/sglang_engine.py [--prompts 32 --samples 8 --prompt-len 64 --new-tokens 64 --repeats 3] [--vllm]

One process, one random-init Qwen2 directory (tools/bench/vllm_common.py), the same prompts:
``SGLangEngine.generate`` (built with ``build_engine("sglang", ...)``, as a rank builds it) and a
bare ``sglang.Engine`` started with the arguments the engine gives SGLang, sent what an SGLang user
would send: the prompts' token ids with ``n`` samples each and the sampled tokens' log-probs. The
two run alternately, ``--repeats`` times each after one warm-up call each; prints both times and
the ratio engine / bare (target <= 1.10). ``--vllm``: rlbatch's vLLM engine on the same workload
too (its own start-up; tokens/s printed beside). Sampled, so the token counts of the sides differ
a little (responses end at EOS).

On a machine without a GPU SGLang's CPU engine needs the stand-ins of tests/stand_ins
(docs/sglang.md): this script loads them, here and in SGLang's processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable from a checkout
from tools.bench import vllm_common as common  # noqa: E402


def _stand_ins() -> None:
    """The CUDA-only stand-ins, in this process and (``PYTHONPATH``) in SGLang's."""
    where = str(ROOT / "tests" / "stand_ins")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (where, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, where)
    import cuda_only

    cuda_only.install()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_workload_flags(p, prompts=32, samples=8, prompt_len=64, new_tokens=64, repeats=3)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--vllm", action="store_true", help="rlbatch's vllm engine on the same workload too")
    common.add_model_flags(p, hidden=256, layers=4, heads=4, kv_heads=2, ffn=1024, vocab=8192)
    a = p.parse_args(argv)
    common.set_threads(a.threads)
    _stand_ins()

    import sglang
    import torch

    from rlbatch.engines.base import SamplingParams
    from rlbatch.engines.sglang import SGLangArgs
    from rlbatch.engines.sglang.engine import engine_kwargs
    from rlbatch.engines.vllm import VLLMArgs

    engines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        params = common.make_model_dir(Path(tmp), a)
        cfg = common.model_config(Path(tmp))
        args = SGLangArgs(kv_cache_tokens=a.kv_cache_tokens, dtype="fp32")
        engines["engine"] = common.build("sglang", args, cfg, a.seed)
        bare = sglang.Engine(**engine_kwargs(args, tmp, torch.float32, a.seed, torch.device("cpu")))
        if a.vllm:
            engines["vllm"] = common.build("vllm", VLLMArgs(kv_cache_mb=512, dtype="fp32"), cfg, a.seed)

    distinct = common.prompts(a.prompts, a.prompt_len, a.vocab, a.seed)
    repeated = [pr for pr in distinct for _ in range(a.samples)]
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=a.seed)
    bare_sp = {"n": a.samples, "max_new_tokens": a.new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1}

    def run_bare() -> int:
        out = bare.generate(input_ids=distinct, sampling_params=bare_sp, return_logprob=True)
        return sum(len(o["output_ids"]) for o in out)

    fns = {name: (lambda e=e: sum(len(g.tokens) for g in e.generate(repeated, sp))) for name, e in engines.items()}
    fns["bare"] = run_bare
    print(f"model: {params / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads, vocab {a.vocab}), "
          f"{a.threads} threads; {a.prompts} prompts x {a.samples} samples, {a.prompt_len}-token prompts, "
          f"{a.new_tokens} new tokens; {common.load_average()}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    order = list(fns)
    for i in range(a.repeats + 1):  # the first round warms every side up and is not counted
        for name in order if i % 2 == 0 else reversed(order):
            start = time.perf_counter()
            tokens[name] = fns[name]()
            if i:
                times[name].append(time.perf_counter() - start)
    for name in times:
        print(f"{name:7s} {common.summary(times[name])}; {tokens[name]} tokens generated, "
              f"{tokens[name] / statistics.median(times[name]):.0f} tokens/s", flush=True)
    ratio = statistics.median(times["engine"]) / statistics.median(times["bare"])
    print(f"ratio engine / bare (median): {ratio:.3f}x (min/min {min(times['engine']) / min(times['bare']):.3f}x); "
          f"{common.load_average()}")
    if "vllm" in times:
        print(f"ratio sglang engine / vllm engine (median): "
              f"{statistics.median(times['engine']) / statistics.median(times['vllm']):.3f}x")
    for e in engines.values():
        e.close()
    bare.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
