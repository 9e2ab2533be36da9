"""Checking what callers give :class:`scpdr.runtime.ProtectedLM`: prompts (strings or token ids)
and padded ``(input_ids, attention_mask)`` batches, with errors that say what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_inputs", "encode_prompts"]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]], vocab_size: int
) -> list[list[int]]:
    """Token ids of each prompt: strings are tokenized with the tokenizer's special tokens (no
    chat template); token-id lists (or tensors) are checked against the vocabulary."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of str or a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        elif isinstance(p, Tensor):
            ids = [int(x) for x in p.reshape(-1).tolist()]
        else:
            ids = [int(x) for x in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one token of context")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        out.append(ids)
    return out


def check_inputs(
    input_ids: Tensor, attention_mask: Tensor | None, vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` ``(B, T)`` checked and moved to ``device`` (the mask as
    0/1 longs, all ones when None)."""
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        raise ValueError("input_ids must be a LongTensor of shape (B, T)")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    if (attention_mask.sum(-1) == 0).any():
        raise ValueError("a row of attention_mask is all zeros (empty prompt)")
    if int(input_ids.max()) >= vocab_size or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size})")
    return input_ids.to(device), attention_mask.to(device).long()
