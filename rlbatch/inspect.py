"""Show a step's training batch as the trainer read it (docs/inspect.md).

    python -m rlbatch.launch watch.batch_every=10 run_dir=runs/x ...   # keeps runs/x/batches/step_<N>.pt
    python -m rlbatch.inspect runs/x                  # the newest kept step, every sample
    python -m rlbatch.inspect runs/x --step 10 --sample 322 --tokens   # one sample, token by token

Each sample: its reward and advantage, a trajectory's end (and the env's words), the prompt and
the response decoded with the run's tokenizer, a trajectory's response in turns (the policy's and
the env's: the env's tokens are out of the loss), and with ``--tokens`` one line per response
token: its id, text, loss mask, behaviour log-prob and advantage.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BATCH_FILE = re.compile(r"step_(\d+)\.pt$")


def kept_steps(run_dir: Path) -> list[int]:
    """The steps whose batch ``run_dir`` keeps (``watch.batch_every``), in order."""
    folder = run_dir / "batches"
    found = (BATCH_FILE.search(p.name) for p in folder.glob("step_*.pt")) if folder.is_dir() else iter(())
    return sorted(int(m.group(1)) for m in found if m)


def _values(sample: Mapping[str, Any], name: str) -> list[float]:
    v = sample.get(name)
    return [float(x) for x in v.reshape(-1).tolist()] if v is not None else []


def advantage(sample: Mapping[str, Any], mask: Sequence[float]) -> float | None:
    """The sample's advantage: its one value, or the mean of its per-token ones over its trained tokens."""
    if sample.get("advantage") is not None:
        return float(sample["advantage"].reshape(-1)[0])
    per_token = _values(sample, "advantages")
    if not per_token:
        return None
    picked = [a for a, m in zip(per_token, mask, strict=False) if m] if mask else per_token
    return sum(picked) / len(picked) if picked else 0.0


def _runs(mask: Sequence[float]) -> list[tuple[bool, int, int]]:
    """The response in runs of trained (True) and untrained tokens: (trained, start, end)."""
    out: list[tuple[bool, int, int]] = []
    for i, m in enumerate(mask):
        on = bool(m)
        if out and out[-1][0] == on:
            out[-1] = (on, out[-1][1], i + 1)
        else:
            out.append((on, i, i + 1))
    return out


def describe_sample(sample: Mapping[str, Any], decode: Callable[[list[int]], str], tokens: bool = False,
                    multi_turn: bool = False) -> str:
    """One sample as text (see the module's docstring). ``multi_turn``: its untrained tokens are the env's."""
    prompt = [int(t) for t in sample["prompt"].tolist()] if sample.get("prompt") is not None else []
    response = [int(t) for t in sample["response"].tolist()] if sample.get("response") is not None else []
    mask = _values(sample, "loss_mask") or [1.0] * len(response)
    adv = advantage(sample, mask)
    head = [f"sample {sample['id']}", f"reward {float(sample['reward']):.4g}",
            f"advantage {adv:+.4g}" if adv is not None else "no advantage"]
    if sample.get("end"):
        head.append(f"end {sample['end']}" + (f" ({sample['turns']} turns)" if "turns" in sample else ""))
    lines = ["  ".join(head)]
    if sample.get("detail"):
        lines.append(f"  env: {sample['detail']}")
    if sample.get("answer"):
        lines.append(f"  answer: {sample['answer']}")
    lines.append(f"  prompt ({len(prompt)} tokens): {decode(prompt)!r}")
    trained = sum(1 for m in mask if m)
    lines.append(f"  response ({len(response)} tokens, {trained} trained): {decode(response)!r}")
    runs = _runs(mask)
    if len(runs) > 1:
        untrained = "env" if multi_turn else "masked"
        for on, start, end in runs:
            lines.append(f"    [{'policy' if on else untrained}] {decode(response[start:end])!r}")
    if tokens:
        logp, per_token = _values(sample, "behaviour_logprobs"), _values(sample, "advantages")
        lines.append(f"  {'#':>4}  {'token':>6}  {'text':<14} mask  behaviour_logprob  advantage")
        for i, tok in enumerate(response):
            a = per_token[i] if i < len(per_token) else adv
            lines.append(f"  {i:>4}  {tok:>6}  {decode([tok])!r:<14} {int(mask[i]) if i < len(mask) else 1:>4}  "
                         f"{logp[i] if i < len(logp) else float('nan'):>17.4f}  "
                         + (f"{a:>+9.4f}" if a is not None else f"{'-':>9}"))
    return "\n".join(lines)


def describe(batch: Mapping[str, Any], decode: Callable[[list[int]], str], ids: Sequence[int] = (),
             tokens: bool = False) -> str:
    """A kept batch as text: a header, then each sample (those of ``ids`` only, when given)."""
    samples = [s for s in batch["samples"] if not ids or s["id"] in ids]
    multi_turn = any("end" in s for s in batch["samples"])
    head = (f"step {batch['step']} ({batch.get('algo', '?')}): {len(batch['samples'])} samples as the trainer read "
            f"them, generated by policy version {batch.get('policy_version', '?')}"
            + (f", {len(samples)} shown" if ids else ""))
    return "\n\n".join([head, *(describe_sample(s, decode, tokens, multi_turn) for s in samples)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlbatch.inspect", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="the run's directory (its batches/ kept with watch.batch_every)")
    ap.add_argument("--step", type=int, default=None, help="the step to show (default: the newest kept)")
    ap.add_argument("--sample", type=int, action="append", default=[], help="show only this sample id (repeatable)")
    ap.add_argument("--tokens", action="store_true", help="one line per response token")
    args = ap.parse_args(argv)
    steps = kept_steps(args.run_dir)
    if not steps:
        print(f"{args.run_dir}: no training batch kept (batches/step_<N>.pt); run with watch.batch_every=N",
              file=sys.stderr)
        return 2
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"{args.run_dir}: no batch of step {step}; kept: {', '.join(map(str, steps))}", file=sys.stderr)
        return 2

    import torch  # after the arguments: --help and a wrong step answer at once

    from rlbatch.config.load import load_config
    from rlbatch.engines.model import load_tokenizer

    batch = torch.load(args.run_dir / "batches" / f"step_{step}.pt", weights_only=True)
    tokenizer = load_tokenizer(load_config(args.run_dir / "config.yaml").model)

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=False))

    missing = sorted(set(args.sample) - {s["id"] for s in batch["samples"]})
    if missing:
        print(f"step {step} has no sample {', '.join(map(str, missing))}; its samples: "
              f"{batch['samples'][0]['id']}..{batch['samples'][-1]['id']}", file=sys.stderr)
        return 2
    print(describe(batch, decode, args.sample, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
