"""One process: a vllm engine on CPU with ``cpu_compile`` (torch.compile, as vLLM runs by default)
really compiles, and its greedy output equals transformers' with the same weights before and
after a weight sync (the layerwise reload under a compiled model)."""

import os
import sys

import torch
import torch.distributed as dist

from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.infer.hf import HFInferenceEngine
from rlbatch.engines.infer.vllm import VLLMEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.engines.registry import HFArgs, VLLMArgs
from rlbatch.launch.compose import compose

os.environ.setdefault("OMP_NUM_THREADS", "1")
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)  # the program's world
cfg = compose(["model.num_heads=2", "model.num_kv_heads=1"])  # head_dim 32: vLLM's CPU attention
tok = load_tokenizer(cfg.model)
cpu = torch.device("cpu")
engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64, cpu_compile=True), cfg.model, cfg.algo,
                                  tok, cpu, seed=1))
assert not engine.llm.llm_engine.vllm_config.model_config.enforce_eager
hf = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, cpu, seed=1))
prompts = [tok.encode(f"{k}*{k + 1}=") for k in range(6)]
greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
assert [g.tokens for g in engine.generate(prompts, greedy)] == [g.tokens for g in hf.generate(prompts, greedy)]
g = torch.Generator().manual_seed(0)
named = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in hf.model.named_parameters()]
before = [x.tokens for x in engine.generate(prompts, greedy)]
engine.load_weights(named)
hf.load_weights(named)
after = [x.tokens for x in engine.generate(prompts, greedy)]
assert after == [x.tokens for x in hf.generate(prompts, greedy)] and after != before
print("vllm compiled ok", flush=True)
engine.close()
os._exit(0)  # vLLM's exit-time finalizer is detached; nothing else to tear down
