"""Records → training sequences → batches: :func:`build_sequences` (packing or EOS padding, paper
App. E) and :class:`CausalCollator` (stacks them, applies the goldfish mask to the labels)."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scpdr.data.records import Record
from scpdr.errors import ConfigError
from scpdr.training.goldfish import GOLDFISH_H, goldfish_mask

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["CausalCollator", "ListDataset", "build_sequences"]


def build_sequences(
    records: Sequence[Record],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    packing: bool,
    seed: int = 0,
    shuffle: bool = True,
) -> list[dict[str, list[int]]]:
    """Tokenize ``records`` (``text`` + EOS each) into training sequences.

    ``packing=True`` (paper App. E, full fine-tuning): examples concatenated with EOS and cut
    into ``seq_len`` blocks, the last block EOS-padded. ``packing=False`` (paper App. E, LoRA):
    one example per sequence, truncated to ``seq_len`` and EOS-padded to the longest example.
    Padding has ``attention_mask`` 0 and label -100; each example's own EOS is a label.

    Returns dicts with ``input_ids``, ``attention_mask``, ``labels`` (lists of equal length).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token; set tokenizer.eos_token")
    order = list(range(len(records)))
    if shuffle:
        random.Random(f"examples:{seed}").shuffle(order)
    examples = []
    for i in order:
        ids = list(tokenizer(records[i].text)["input_ids"])
        if not ids or ids[-1] != eos:
            ids.append(eos)
        examples.append(ids)
    out: list[dict[str, list[int]]] = []

    def padded(ids: list[int], length: int) -> dict[str, list[int]]:
        n = len(ids)
        return {
            "input_ids": ids + [eos] * (length - n),
            "attention_mask": [1] * n + [0] * (length - n),
            "labels": ids + [-100] * (length - n),
        }

    if packing:
        stream = [t for ids in examples for t in ids]
        for start in range(0, len(stream), seq_len):
            out.append(padded(stream[start : start + seq_len], seq_len))
    else:
        n_trunc = sum(len(ids) > seq_len for ids in examples)
        if n_trunc:
            logger.warning(
                "%d of %d examples truncated to %d tokens", n_trunc, len(examples), seq_len
            )
        length = min(seq_len, max(len(ids) for ids in examples))
        out = [padded(ids[:length], length) for ids in examples]
    return out


class CausalCollator:
    """Stack ``build_sequences`` features into tensors; with ``goldfish_k`` set, drop the goldfish
    positions from ``labels`` (set to -100). Never modifies the features it is given."""

    def __init__(self, *, goldfish_k: int | None = None, goldfish_h: int = GOLDFISH_H) -> None:
        self.goldfish_k = goldfish_k
        self.goldfish_h = goldfish_h

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        batch = {
            key: torch.tensor([list(f[key]) for f in features], dtype=torch.long)
            for key in ("input_ids", "attention_mask", "labels")
        }
        if self.goldfish_k:
            drop = goldfish_mask(batch["input_ids"], k=self.goldfish_k, h=self.goldfish_h)
            batch["labels"] = batch["labels"].masked_fill(drop, -100)
        return batch


class ListDataset:
    """A list of feature dicts as a map-style dataset (what the Trainer takes)."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]
