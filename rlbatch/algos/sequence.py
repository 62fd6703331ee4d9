"""Pure helpers that turn generated token ids into the masks and positions training needs.

Training must score a completion exactly as generation produced it. With left-padded
prompts that means positions count real tokens only, and the completion ends at (and
includes) its first EOS: the EOS is an action the policy took, the padding after it is not.
"""

from __future__ import annotations

import torch
from torch import Tensor


def completion_mask(completion_ids: Tensor, eos_token_id: int) -> Tensor:
    """``[B, T]`` long mask: 1 up to and including each row's first EOS, 0 after it.

    A row without EOS (it ran out of tokens) is all ones.
    """
    is_eos = (completion_ids == eos_token_id).long()
    eos_strictly_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return (eos_strictly_before == 0).long()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that count only attended tokens, as HF ``generate`` assigns them.

    Left padding then shifts nothing: the first real token is position 0 in every row.
    Padding positions get 0; they are masked out anyway. (RoPE models such as Qwen2/Llama
    are invariant to a constant shift, so for them this only matters for exactness of
    ``max_position_embeddings`` checks; absolute-position models need it.)
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_to_length(ids: Tensor, length: int, pad_id: int) -> Tensor:
    """Right-pad ``[B, t]`` ids to ``[B, length]``; ``generate`` returns fewer columns when
    every row stopped early, and a fixed width keeps shapes stable across steps."""
    if ids.shape[-1] >= length:
        return ids
    pad = ids.new_full((*ids.shape[:-1], length - ids.shape[-1]), pad_id)
    return torch.cat([ids, pad], dim=-1)
