"""Activation and logits memory of one GPU, generalised from Korthikanti et al. 2022.

Korthikanti's Sec. 4.1 counts, for one GPT layer in 16-bit: attention 11*s*b*h + 5*a*s^2*b,
MLP 19*s*b*h, two LayerNorms 4*s*b*h. ``layer_bytes`` makes the same count term by term for
today's decoders: grouped-query attention (K and V are kv_heads*head_dim wide), SwiGLU (gate,
up and their product are saved: 3*s*b*ffn elements), flash attention (no s^2 score matrix, an
fp32 log-sum-exp per head instead) and no dropout. With ``gqa=False, gated=False, ffn=4h,
flash=False, dropout=True`` it reduces exactly to Korthikanti's s*b*h*(34 + 5*a*s/h) — the tests
check that, and ``formulas.korthikanti_layer_bytes`` keeps the paper's closed forms.
"""

from __future__ import annotations

from rlbatch.models.shape import ModelShape


def layer_bytes(
    shape: ModelShape, s: float, b: float, e: int = 2, t: int = 1, sp: bool = True,
    flash: bool = True, dropout: bool = False, recompute: str = "none",
) -> float:
    """Saved activations of one layer for a micro-batch of ``b`` sequences of ``s`` tokens.

    ``e`` is bytes per activation element; ``t`` the tensor-parallel size; ``sp`` whether
    sequence parallelism also splits the parts TP alone replicates (norm inputs, layer input,
    dropout masks); ``recompute`` is 'none', 'selective' (no attention-score matrix kept) or
    'full' (only the layer input is kept).
    """
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    a, f = shape.heads, shape.ffn if not shape.experts else shape.moe_ffn * max(1, shape.experts_per_token) + shape.shared_ffn
    if recompute == "full":
        return e * s * b * h / (t if sp else 1)
    # Replicated across TP ranks unless sequence parallel: inputs of the two norms, of the
    # attention projections and of the MLP, plus dropout masks (1 byte each).
    replicated = e * s * b * h * 4 + (2 * s * b * h if dropout else 0)
    # Split across TP ranks: Q, K, V, the attention output, and the MLP intermediates.
    split = e * s * b * (q + kv + kv + q)
    split += e * s * b * f * (3 if shape.gated else 2)
    if flash:
        split += 4 * s * b * a  # fp32 log-sum-exp per head and position
    elif recompute != "selective":
        scores = a * s * s * b
        split += e * scores + ((1 + e) * scores if dropout else 0)  # softmax out, dropout mask and out
    return replicated / (t if sp else 1) + split / t


def forward_working_bytes(shape: ModelShape, s: float, b: float, e: int = 2, t: int = 1) -> float:
    """Peak transient of a forward pass without autograd: one layer's widest live tensors
    (input, Q/K/V, and the MLP's gate and up outputs)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    f = shape.ffn if not shape.experts else shape.moe_ffn * max(1, shape.experts_per_token)
    return e * s * b * (2 * h + (q + 2 * kv + 2 * f) / t)


def logits_bytes(rows: float, vocab: int, e: int = 2, t: int = 1, train: bool = False, entropy: bool = False) -> float:
    """The vocab-sized tensors of a log-prob pass over ``rows`` token positions (vocab split over t).

    rlbatch.algos.token_logprobs upcasts low-precision logits to fp32 and takes a logsumexp:
    logits (e bytes) + fp32 copy (4, only when e < 4) + exp temporary (4). Training adds the
    fp32 and e-byte gradients of the logits; an entropy bonus adds softmax probs and their product.
    """
    per = e + (4 if e < 4 else 0) + 4
    if train:
        per += 4 + e
    if entropy:
        per += 8
    return rows * vocab / t * per


TRAFFIC_PER_SAVED_BYTE = 4.0
"""Bytes of memory traffic per byte of saved activation in one forward: each elementwise op
reads and writes its tensors, and eager HF code (fp32 RMSNorm, rotary, SwiGLU) runs several per
saved tensor. Measured: the tiny Qwen2's forward over 128x13 tokens on the cpu profile moves
about 3.4x its saved activations (rlbatch.plan.measure's memcpy rate); backward about as much again."""


def traffic_per_token(shape: ModelShape, e: int = 2, t: int = 1) -> float:
    """Activation memory traffic of one token through all layers in one forward pass."""
    return TRAFFIC_PER_SAVED_BYTE * shape.layers * layer_bytes(shape, 1, 1, e, t)


CHUNK_BYTES = 1 << 28
"""``rlbatch.algos.core.CHUNK_BYTES`` (kept here: the planner imports no torch; a test checks they
agree): ``chunked_logprobs`` works on this many bytes of fp32 logits at a time."""


def mask_bytes(row: float, e: int, layers: int) -> float:
    """The attention masks of a packed row under sdpa: transformers' block-diagonal bool [N, N] mask,
    which sdpa converts to an additive mask in the compute dtype in every layer's call, and autograd
    keeps each layer's for the backward (``layers``; 1 in a pass without autograd, one layer at a
    time). Measured: 2 N^2 bytes a layer kept in bf16 on an H100 (under sdpa, before varlen), 4 N^2
    in fp32 on CPU. Rows under varlen attention (``varlen_rows``) have none."""
    return row * row * (1 + e * layers)


def packed_logits_bytes(scored: float, vocab: int, e: int, t: int = 1, train: bool = False,
                        entropy: bool = False) -> float:
    """The vocab-sized tensors of a packed pass (``rlbatch.algos.core.chunked_logprobs``): the
    logits at the scored positions as computed (e bytes; kept for the backward in training), and
    chunks of ``CHUNK_BYTES`` of fp32 logits at a time: the fp32 copy of a chunk (when e < 4) and
    its logsumexp's one temporary (torch exponentiates ``x - max`` in place); training adds the
    logits' gradient (e bytes) and the backward's chunk (exp, its negation, the product with the
    incoming gradient: 3; the entropy term one more). Measured on CPU against
    ``tools/bench/packing.py`` (docs/planner.md)."""
    local = vocab / t
    rows = min(scored, max(1, CHUNK_BYTES // max(1, int(4 * local))))
    chunk = 4.0 * rows * local
    copy = 1 if e < 4 else 0
    if not train:
        return scored * local * e + (1 + copy) * chunk
    return 2 * scored * local * e + (3 + (1 if entropy else 0) + copy) * chunk
