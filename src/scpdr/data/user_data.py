"""A user's file as training and validation records (what :func:`scpdr.data.load_corpus` makes a
:class:`~scpdr.data.corpora.Corpus` of): a validation split carved when the file has none.

The validation records are what no constituent sees: the No CP-val baseline of every attack,
utility, LiRA's non-members and the constant base vector of SCP-Δr-c. They are drawn by data
subject: a group (``--group-field``) is held out whole or not at all, so a held-out customer's
secrets are in no partition. A ``datasets`` directory with a ``validation`` split uses it instead.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr.data.formats import DataError, saved_splits
from scpdr.data.records import FieldMapping, Record, load_records

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_VAL_FRACTION", "load_user_split", "split_validation"]

#: The share of a user's records held out for validation when the file has no validation split.
DEFAULT_VAL_FRACTION = 0.1


def split_validation(
    records: Sequence[Record],
    *,
    n_val: int,
    n_train: int | None = None,
    seed: int = 0,
) -> tuple[list[Record], list[Record]]:
    """``(train, validation)``: about ``n_val`` records held out, whole groups at a time, in a
    seeded random order; then ``n_train`` (all by default) of the rest, in that order. Both keep
    the file's order. Records without a group are groups of one (then exactly ``n_val`` are
    held out)."""
    if n_val >= len(records):
        raise DataError(f"{len(records)} records, cannot hold out {n_val} for validation")
    members: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        if r.group is not None:
            members.setdefault(r.group, []).append(i)
    order = list(range(len(records)))
    random.Random(f"val:{seed}").shuffle(order)
    val_idx: set[int] = set()
    taken: set[int] = set()
    for i in order:
        if len(val_idx) >= n_val:
            break
        if i in taken:
            continue
        group = members.get(records[i].group, [i]) if records[i].group is not None else [i]
        taken.update(group)
        if len(val_idx) + len(group) <= n_val or not val_idx:
            val_idx.update(group)
    rest = [i for i in order if i not in val_idx]
    train_idx = set(rest if n_train is None else rest[:n_train])
    if n_train is not None and len(train_idx) < n_train:
        logger.warning("only %d training records (n_train=%d)", len(train_idx), n_train)
    if not train_idx:
        raise DataError(
            f"{len(records)} records: holding out {len(val_idx)} for validation leaves none to "
            "train on; lower the validation fraction (--val-fraction) or add records"
        )
    train = [r for i, r in enumerate(records) if i in train_idx]
    val = [r for i, r in enumerate(records) if i in val_idx]
    return train, val


def load_user_split(
    path: Path,
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    fields: Mapping[str, str] | FieldMapping | None = None,
    split: str | None = None,
    val_fraction: float = 0.0,
    chat: Callable[..., tuple[str, str]] | None = None,
) -> tuple[list[Record], list[Record], dict[str, Any]]:
    """``(train, validation, meta)`` of a user file or ``datasets`` directory
    (:func:`load_records`).

    Validation: a saved ``DatasetDict``'s ``validation`` split when reading its ``train`` split
    and ``n_val`` is not given; else ``n_val`` records, or ``val_fraction`` of them (rounded),
    held out by :func:`split_validation`. ``meta["validation"]`` records where it came from."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    records = load_records(path, fields=fields, split=split, chat=chat)
    splits = saved_splits(path) if path.is_dir() else None
    if splits and "validation" in splits and (split or "train") == "train" and n_val is None:
        val = load_records(path, fields=fields, split="validation", chat=chat)
        train, _ = split_validation(records, n_val=0, n_train=n_train, seed=seed)
        how = {"source": "split", "split": "validation", "records": len(val)}
    else:
        k_val = n_val if n_val is not None else round(val_fraction * len(records))
        train, val = split_validation(records, n_val=k_val, n_train=n_train, seed=seed)
        how = {
            "source": "carved",
            **({"n_val": n_val} if n_val is not None else {"fraction": val_fraction}),
            "records": len(val),
        }
        if n_val is None and val_fraction > 0 and not val:
            logger.warning(
                "%s: %d records give no validation record at --val-fraction %s",
                path,
                len(records),
                val_fraction,
            )
    groups = {r.group for r in records if r.group is not None}
    meta = {
        "seed": seed,
        "source": str(path.resolve()),
        "validation": how,
        **({"groups": len(groups)} if groups else {}),
    }
    return train, val, meta
