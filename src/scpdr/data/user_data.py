"""A user's file as training and validation records (what :func:`scpdr.data.load_corpus` makes a
:class:`~scpdr.data.corpora.Corpus` of): a validation split carved when the file has none.

The validation records are what no constituent sees: the non-members of the membership attacks,
the No CP-val chance level of every attack, utility, and the constant base vector of SCP-Δr-c.
A non-member with a near-copy among the training records would make every "at chance" verdict
too lenient, so the carve deals out whole groups (:func:`scpdr.data.grouping.record_groups`, the
grouping the partitions use): near-duplicates, a data subject's records (``--group-field``) and
records sharing a declared secret are held out together or not at all. A ``datasets`` directory
with a ``validation`` split uses it instead (the partition audit checks it against the training
records).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr.data.formats import DataError, saved_splits
from scpdr.data.grouping import GroupingConfig, record_groups
from scpdr.data.records import FieldMapping, Record, load_records
from scpdr.data.secrets import SecretsConfig, add_secrets

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_VAL_CAP",
    "DEFAULT_VAL_FRACTION",
    "DEFAULT_VAL_RULE",
    "MIN_NONMEMBERS",
    "default_val_size",
    "load_user_split",
    "split_validation",
    "warn_few_nonmembers",
]

#: The share of a user's records the default carve holds out at least.
DEFAULT_VAL_FRACTION = 0.1
#: The most the default carve takes to reach :data:`MIN_NONMEMBERS` (a share of the records).
DEFAULT_VAL_CAP = 0.25
#: Non-members a TPR at 1% FPR needs: with fewer, one false positive is already above 1%.
MIN_NONMEMBERS = 100
#: How the default validation size is chosen (recorded in the manifest).
DEFAULT_VAL_RULE = "max(10% of records, min(100, 25% of records))"


def default_val_size(n_records: int) -> int:
    """The validation records carved from ``n_records`` when neither ``--n-val`` nor
    ``--val-fraction`` is given: 10% of them, raised towards :data:`MIN_NONMEMBERS` (100, what a
    TPR at 1% FPR needs) as long as that takes at most 25% of the records."""
    return max(
        round(DEFAULT_VAL_FRACTION * n_records),
        min(MIN_NONMEMBERS, int(DEFAULT_VAL_CAP * n_records)),
    )


def warn_few_nonmembers(n: int, *, what: str, fix: str) -> None:
    """Log that ``n`` (> 0) non-members cannot resolve a TPR at 1% FPR (needs
    :data:`MIN_NONMEMBERS`); ``what`` names them, ``fix`` says how to get more."""
    if 0 < n < MIN_NONMEMBERS:
        logger.warning(
            "%s: TPR@1%% cannot be resolved with %d non-members (it needs at least %d; one "
            "false positive is already %.1f%%); %s",
            what,
            n,
            MIN_NONMEMBERS,
            100.0 / n,
            fix,
        )


def split_validation(
    records: Sequence[Record],
    *,
    n_val: int,
    n_train: int | None = None,
    seed: int = 0,
    grouping: GroupingConfig | None = None,
) -> tuple[list[Record], list[Record]]:
    """``(train, validation)``: about ``n_val`` records held out, whole groups at a time
    (:func:`~scpdr.data.grouping.record_groups`: near-duplicates, ``Record.group``, shared
    declared secrets; ``grouping``: the near-duplicate parameters) in a seeded random order;
    then ``n_train`` (all by default) of the rest, in that order. Both keep the file's order.

    A group that would overshoot ``n_val`` is skipped for a later, smaller one, so records in
    groups of one give exactly ``n_val``. When no group fits, the smallest one is held out."""
    if n_val >= len(records):
        raise DataError(f"{len(records)} records, cannot hold out {n_val} for validation")
    groups = record_groups(records, grouping) if n_val > 0 else [[i] for i in range(len(records))]
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    order = list(range(len(records)))
    random.Random(f"val:{seed}").shuffle(order)
    val_idx: set[int] = set()
    seen: set[int] = set()
    for i in order:
        if len(val_idx) >= n_val:
            break
        g = group_of[i]
        if g in seen:
            continue
        seen.add(g)
        if len(val_idx) + len(groups[g]) <= n_val:
            val_idx.update(groups[g])
    if n_val > 0 and not val_idx:
        smallest = min(groups, key=len)  # the first of the smallest (groups in file order)
        if len(smallest) < len(records):
            val_idx.update(smallest)
            logger.warning(
                "no whole group fits %d validation records; held out the smallest (%d records)",
                n_val,
                len(smallest),
            )
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
    val_fraction: float | None = 0.0,
    chat: Callable[..., tuple[str, str]] | None = None,
    secrets: SecretsConfig | None = None,
    grouping: GroupingConfig | None = None,
) -> tuple[list[Record], list[Record], dict[str, Any]]:
    """``(train, validation, meta)`` of a user file or ``datasets`` directory
    (:func:`load_records`).

    Validation: a saved ``DatasetDict``'s ``validation`` split when reading its ``train`` split
    and ``n_val`` is not given; else ``n_val`` records, or ``val_fraction`` of them (rounded;
    ``None``: :func:`default_val_size`), held out by :func:`split_validation` (``grouping``: the
    near-duplicate parameters). ``secrets`` (patterns, detected PII) are added to every record
    first, so that records sharing one are held out together. ``meta["validation"]`` records
    where the split came from. Fewer than :data:`MIN_NONMEMBERS` validation records is a logged
    warning."""
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    records = load_records(path, fields=fields, split=split, chat=chat)
    if secrets is not None and secrets.active:
        records = add_secrets(records, secrets)
    splits = saved_splits(path) if path.is_dir() else None
    if splits and "validation" in splits and (split or "train") == "train" and n_val is None:
        val = load_records(path, fields=fields, split="validation", chat=chat)
        if secrets is not None and secrets.active:
            val = add_secrets(val, secrets)
        train, _ = split_validation(records, n_val=0, n_train=n_train, seed=seed)
        how: dict[str, Any] = {"source": "split", "split": "validation", "records": len(val)}
        fix = "give the validation split more records, or carve one with --n-val"
    else:
        if n_val is not None:
            k_val, asked = n_val, {"n_val": n_val}
        elif val_fraction is None:
            k_val, asked = default_val_size(len(records)), {"rule": DEFAULT_VAL_RULE}
        else:
            k_val, asked = round(val_fraction * len(records)), {"fraction": val_fraction}
        train, val = split_validation(
            records, n_val=k_val, n_train=n_train, seed=seed, grouping=grouping
        )
        how = {"source": "carved", **asked, "records": len(val)}
        fix = "add records, or raise --val-fraction / --n-val"
        if not val and (k_val > 0 or (n_val is None and val_fraction != 0.0)):
            logger.warning(
                "%s: %d records give no validation record (%s)", path, len(records), asked
            )
    warn_few_nonmembers(len(val), what=f"{path}: {len(val)} validation records", fix=fix)
    groups = {r.group for r in records if r.group is not None}
    meta = {
        "seed": seed,
        "source": str(path.resolve()),
        "validation": how,
        **({"groups": len(groups)} if groups else {}),
    }
    return train, val, meta
