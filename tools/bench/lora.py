"""Full fine-tuning against LoRA, in one run: the fsdp engine on 2 ranks training a model of
Qwen2.5-0.5B's shape, once with every weight trained and once with rank-16 adapters on every
linear layer (``model.lora``), on the same batch.

    python tools/bench/lora.py [--model-size 0.5b] [--batch 4 --seq 128] [--steps 2] [--quick]

``tools/bench/train_engines.py`` with ``--engines fsdp,fsdp_lora``: per configuration the median
step time, peak RSS per rank and the engine's own memory, the trained parameters, and the weight
sync's sending side (bytes streamed, in the engine's wire dtype, and seconds): merged weights (what
an engine that does not load adapters receives: hf) and, for LoRA, the adapters alone (what vLLM
receives, ``model.lora.sync``), then the ratios.
Any other argument goes to train_engines.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULTS = ["--engines", "fsdp,fsdp_lora", "--model-size", "0.5b", "--batch", "4", "--seq", "128",
            "--prompt-len", "64", "--steps", "2", "--warmup", "1"]


def main(argv: list[str]) -> int:
    given = {a for a in argv if a.startswith("--")}
    args = [a for i, a in enumerate(DEFAULTS) if not (a.startswith("--") and a in given)
            and not (i > 0 and DEFAULTS[i - 1] in given)]
    out = subprocess.run([sys.executable, str(HERE / "train_engines.py"), *args, *argv], capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    print(out.stdout, end="")
    if out.returncode:
        return out.returncode
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines() if line.startswith("| ")]
    head, body = rows[0], {r[1]: dict(zip(rows[0], r, strict=True)) for r in rows[1:]}
    full, lora = (next(r for k, r in body.items() if ("LoRA" in k) == want) for want in (False, True))

    def num(r: dict[str, str], col: str) -> float:
        return float(re.sub(r"[^0-9.]", "", r[col]))

    assert "trained params" in head
    print(f"LoRA against full fine-tuning: trained parameters {num(full, 'trained params') / num(lora, 'trained params'):.0f}x "
          f"fewer, engine memory {num(full, 'engine MiB/rank') / num(lora, 'engine MiB/rank'):.2f}x lower, peak RSS "
          f"{num(full, 'peak RSS MiB/rank') / num(lora, 'peak RSS MiB/rank'):.2f}x lower, step "
          f"{num(full, 's/step') / num(lora, 's/step'):.2f}x faster; merged sync bytes "
          f"{num(full, 'sync MiB') / num(lora, 'sync MiB'):.2f}x (the whole model either way), adapter-only sync "
          f"{num(lora, 'sync MiB') / num(lora, 'adapter sync MiB'):.0f}x fewer bytes and "
          f"{num(lora, 'sync s') / num(lora, 'adapter sync s'):.0f}x fewer seconds than merged")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
