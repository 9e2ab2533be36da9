"""Records → training sequences → batches: :func:`build_sequences` (packing, or one record per
sequence; paper App. E), :class:`GroupedSampler` (length-grouped batches, as transformers'
``group_by_length``) and :class:`CausalCollator` (pads each batch to its longest sequence, rounded
up to a multiple of ``pad_to_multiple_of`` tokens, applies the goldfish mask to the labels);
:func:`padding_share` says how much of the batches is padding."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from scpdr.data.records import Record
from scpdr.errors import ConfigError
from scpdr.training.goldfish import GOLDFISH_H, goldfish_mask

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "CausalCollator",
    "GroupedSampler",
    "ListDataset",
    "build_sequences",
    "epoch_order",
    "example_order",
    "padded_width",
    "padding_share",
    "set_grouped_epoch",
]


def example_order(n: int, *, seed: int, shuffle: bool = True) -> list[int]:
    """The order :func:`build_sequences` puts ``n`` examples in (seeded shuffle, or as given)."""
    order = list(range(n))
    if shuffle:
        random.Random(f"examples:{seed}").shuffle(order)
    return order


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
    into ``seq_len`` blocks, the last block EOS-padded (``attention_mask`` 0, label -100).
    ``packing=False`` (paper App. E, LoRA): one example per sequence, truncated to ``seq_len``
    and not padded: :class:`CausalCollator` pads each batch to its own longest sequence. Each
    example's own EOS is a label.

    Returns dicts with ``input_ids``, ``attention_mask``, ``labels`` (lists of one length per
    dict).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token; set tokenizer.eos_token")
    order = example_order(len(records), seed=seed, shuffle=shuffle)
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
        out = [padded(ids[:seq_len], len(ids[:seq_len])) for ids in examples]
    return out


def padded_width(longest: int, multiple: int = 1) -> int:
    """A batch's padded length: its ``longest`` sequence rounded up to a multiple of
    ``multiple`` tokens (``TrainConfig.pad_to_multiple_of``; 1: the longest itself)."""
    if multiple < 1:
        raise ConfigError(f"pad_to_multiple_of must be >= 1, got {multiple}")
    return -(-longest // multiple) * multiple


class CausalCollator:
    """Stack ``build_sequences`` features into tensors, each batch right-padded to its longest
    sequence rounded up to a multiple of ``pad_to_multiple_of`` tokens (:func:`padded_width`;
    ``pad_token_id``, the tokenizer's EOS; ``attention_mask`` 0, label -100: padding changes no
    real position's output nor the loss); with ``goldfish_k`` set, drop the goldfish positions
    from ``labels`` (set to -100). Never modifies the features it is given.

    Rounding the width up bounds how many distinct batch shapes a run has (batches of 40-173
    tokens: 9 widths at a multiple of 16 instead of up to 134). Each new shape makes oneDNN
    (torch's CPU matmuls) build and cache new kernels, which stay resident: on the 135M model
    (full fine-tuning, bf16, Intel Xeon with AMX, 2 threads, 40 steps of 8 records of varied
    lengths) peak RSS grew by 0.53 GiB at the exact longest, by 0.24 GiB at a multiple of 8,
    and stayed flat after 10 steps at a multiple of 16, as with batches all of one length
    (docs/training.md)."""

    def __init__(
        self,
        *,
        goldfish_k: int | None = None,
        goldfish_h: int = GOLDFISH_H,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int = 1,
    ) -> None:
        self.goldfish_k = goldfish_k
        self.goldfish_h = goldfish_h
        self.pad_token_id = pad_token_id
        padded_width(1, pad_to_multiple_of)  # validates it
        if pad_to_multiple_of > 1 and pad_token_id is None:
            raise ConfigError(
                f"padding to a multiple of {pad_to_multiple_of} tokens needs a pad token: pass "
                "CausalCollator(pad_token_id=tokenizer.eos_token_id, ...) or pad_to_multiple_of=1"
            )
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        width = padded_width(max(len(f["input_ids"]) for f in features), self.pad_to_multiple_of)
        if self.pad_token_id is None and any(len(f["input_ids"]) != width for f in features):
            raise ConfigError(
                "sequences of different lengths need padding: pass CausalCollator("
                "pad_token_id=tokenizer.eos_token_id)"
            )
        fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": -100}
        batch = {
            key: torch.tensor(
                [list(f[key]) + [pad] * (width - len(f[key])) for f in features],
                dtype=torch.long,
            )
            for key, pad in fill.items()
        }  # (B, width) each
        if self.goldfish_k:
            drop = goldfish_mask(batch["input_ids"], k=self.goldfish_k, h=self.goldfish_h)
            batch["labels"] = batch["labels"].masked_fill(drop, -100)
        return batch


def epoch_order(
    lengths: Sequence[int], *, batch_size: int, seed: int, epoch: int = 0, grouped: bool
) -> list[int]:
    """The order one epoch visits sequences of these ``lengths`` in: ``grouped``, transformers'
    ``get_length_grouped_indices`` (random megabatches of 50 batches, or fewer on a small
    set, each sorted longest first; the longest batch first) with a generator seeded by
    ``seed + epoch``; else a random permutation from the same generator (the Trainer's
    seedable random sampler). Deterministic in ``(seed, epoch)``: a resumed run replays it."""
    import torch

    g = torch.Generator().manual_seed(int(seed) + int(epoch))
    if not grouped:
        return torch.randperm(len(lengths), generator=g).tolist()
    from transformers.trainer_pt_utils import get_length_grouped_indices

    return [int(i) for i in get_length_grouped_indices(list(lengths), batch_size, generator=g)]


def padding_share(
    lengths: Sequence[int], order: Sequence[int], batch_size: int, multiple: int = 1
) -> float:
    """Pad tokens over all tokens of the batches that ``order`` cuts into ``batch_size``
    sequences each, every batch padded to its longest rounded up to a multiple of ``multiple``
    (:class:`CausalCollator`'s ``pad_to_multiple_of``)."""
    total = real = 0
    for s in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[s : s + batch_size]]
        total += padded_width(max(batch), multiple) * len(batch)
        real += sum(batch)
    return 0.0 if total == 0 else (total - real) / total


class GroupedSampler:
    """Length-grouped order (:func:`epoch_order` with ``grouped=True``) as a sampler for the
    Trainer: batches of similar lengths, so :class:`CausalCollator` pads little; a new order
    each epoch (``set_epoch``, which the Trainer calls), the same one for the same epoch, also
    in a run resumed mid-epoch. ``batch_size``: sequences per optimizer step (the per-device
    batch times the gradient accumulation, as the Trainer's ``group_by_length`` groups)."""

    def __init__(self, lengths: Sequence[int], *, batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(
            epoch_order(
                self.lengths,
                batch_size=self.batch_size,
                seed=self.seed,
                epoch=self.epoch,
                grouped=True,
            )
        )


#: Attributes through which a data loader reaches its sampler: torch's ``DataLoader``
#: (``batch_sampler``, ``sampler``), accelerate's ``BatchSamplerShard`` and ``SkipBatchSampler``
#: (``batch_sampler``), its loader adapters (``base_dataloader``, ``dataloader``).
_WRAPPED = ("batch_sampler", "sampler", "base_dataloader", "dataloader")


def set_grouped_epoch(loader: Any, epoch: int, *, _depth: int = 8) -> int:
    """Set ``epoch`` on every :class:`GroupedSampler` that ``loader`` wraps, however deep
    (accelerate's ``set_epoch`` reaches two levels, and a resumed DDP run nests it three:
    ``SkipBatchSampler(BatchSamplerShard(BatchSampler(GroupedSampler)))``). Returns how many
    were set."""
    if isinstance(loader, GroupedSampler):
        loader.set_epoch(epoch)
        return 1
    if loader is None or _depth == 0:
        return 0
    found = 0
    seen: set[int] = set()
    for name in _WRAPPED:
        inner = getattr(loader, name, None)
        if inner is not None and inner is not loader and id(inner) not in seen:
            seen.add(id(inner))
            found += set_grouped_epoch(inner, epoch, _depth=_depth - 1)
    return found


class ListDataset:
    """A list of feature dicts as a map-style dataset (what the Trainer takes)."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]
