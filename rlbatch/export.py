"""Export a run's trained policy as a Hugging Face model directory.

    python -m rlbatch.export runs/2025-06-01_12-00-00 exported/            # newest complete checkpoint
    python -m rlbatch.export runs/.../checkpoints/step_000040 exported/ --dtype bf16
    python -m rlbatch.export runs/... exported/ --lora adapter      # model.lora: a PEFT adapter directory

The result loads with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
Exit codes: 0 written; 2 no usable checkpoint or weights that do not fit (the reason is printed).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlbatch.export", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="run dir (its newest complete checkpoint) or a checkpoint dir")
    p.add_argument("out", type=Path, help="output directory (created; must be empty)")
    p.add_argument("--role", default="actor_train", help="trainable role to export (default: actor_train)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weight dtype (default: fp32)")
    p.add_argument("--lora", default="merged", choices=["merged", "adapter"],
                   help="a policy trained with model.lora: a merged model (default) or a PEFT adapter directory")
    p.add_argument("--no-verify", action="store_true", help="skip sha256 checks (sizes are still checked)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rlbatch.checkpoint.store import CheckpointError

    try:
        from rlbatch.checkpoint.hf_export import export_hf  # torch, transformers: after the arguments

        done = export_hf(args.src, args.out, args.role, args.dtype, verify=not args.no_verify, lora_as=args.lora)
    except CheckpointError as e:
        print(f"rlbatch.export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.role} of {done.checkpoint.path} (step {done.checkpoint.step}) to {done.out}:")
    for f in done.files:
        print(f"  {f.relative_to(done.out)}  {f.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
