"""What the megatron engine's context parallelism does not run with, in one sentence that validation
(``megatron_rules``, before start) and the engine (at build) both say. Imports nothing heavy."""

from __future__ import annotations


def context_parallel_refusal(stages: int, packed: bool, experts: int, hybrid: bool,
                             distributed_optimizer: bool) -> str | None:
    """Why context parallelism cannot run with these settings (None: it can). It is built for padded
    rows of a dense model on one pipeline stage, with torch AdamW."""
    why = [w for w, bad in (
        (f"pipeline stages (p={stages})", stages > 1),
        ("packed rows (engine_args.pack_rows)", packed),
        (f"a Mixture-of-Experts model ({experts} routed experts)", experts > 0 and not hybrid),
        ("a hybrid (attn:...|ffn:...) layout", hybrid),
        ("engine_args.distributed_optimizer", distributed_optimizer),
    ) if bad]
    if not why:
        return None
    return ("is built for padded rows of a dense model on one pipeline stage with torch AdamW, not with "
            + " or ".join(why) + "; leave c=1 for those")
