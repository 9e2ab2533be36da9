"""Which records a deletion request removes, and the partitions without them (the data half of
``scpdr forget``; the bundle half is :mod:`scpdr.training.forget`).

A request names records by id, by data subject (``group``: the whole group goes) or by a
regular expression over the declared secrets: every record declaring a matching secret goes, and
so does every other record whose text contains one of those secrets (one email in two tickets).
:func:`select_deletion` resolves the request against a :class:`~scpdr.data.manifest.PartitionSet`
and refuses what it cannot honour (nothing matches, an unknown id or group, a canary record);
:func:`without_records` keeps every other record in the partition it had (SISA: Bourtoule et
al., "Machine Unlearning", IEEE S&P 2021 — only the constituents whose partition changed need
training again); :func:`remaining_near_duplicates` names the records left behind that copy a
removed one (the partition audit kept near-duplicates together, so only the same partition
can hold them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from scpdr.data.grouping import near_duplicate_pairs
from scpdr.data.manifest import CONTAMINATED_VALIDATION, PartitionEntry, PartitionSet
from scpdr.data.records import DataError, Record, records_hash
from scpdr.data.secrets import secret_index

__all__ = [
    "DeletionSelection",
    "remaining_near_duplicates",
    "select_deletion",
    "without_records",
]

#: How many names an error lists before "..." (ids only: never a text or a secret).
_SHOWN = 10


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    more = f" ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(repr(x) for x in items[:_SHOWN]) + more


@dataclass(frozen=True)
class DeletionSelection:
    """The records a deletion request removes: ``by_partition[i]`` the training records of
    partition ``i`` (in partition order), ``validation`` the held-out records (no constituent
    trained on them; they leave the attacks' non-members), ``kind`` how they were named
    (``"ids"``, ``"group"`` or ``"secret-matching"``)."""

    by_partition: dict[int, list[Record]]
    validation: list[Record]
    kind: str

    @property
    def partitions(self) -> list[int]:
        """The partitions that lose records (their constituents are trained again)."""
        return sorted(p for p, recs in self.by_partition.items() if recs)

    @property
    def training(self) -> list[Record]:
        return [r for p in self.partitions for r in self.by_partition[p]]

    @property
    def ids(self) -> set[str]:
        return {r.id for r in (*self.training, *self.validation)}


def select_deletion(
    pset: PartitionSet,
    *,
    ids: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
    secret_matching: str | None = None,
) -> DeletionSelection:
    """The records of ``pset`` (partitions and validation) that a request removes.

    Exactly one of ``ids`` (record ids; each must exist), ``groups`` (``Record.group`` values, the
    ``--group-field`` column; each must name at least one record) or ``secret_matching`` (a
    regular expression, :func:`re.search` over each declared secret; anchor it with ``^...$`` to
    match whole secrets) names them. Raises :class:`~scpdr.data.records.DataError` saying what
    did not match, or when a canary record would go (canaries are scpdr's own test records, not
    anybody's data; removing one would break the canary audit and the exposure attack)."""
    given = [
        n for n, v in (("ids", ids), ("groups", groups), ("secret_matching", secret_matching)) if v
    ]
    if len(given) != 1:
        raise DataError(
            "name the records to forget in exactly one way: --ids ID..., --group VALUE... or "
            f"--secret-matching REGEX (got {', '.join(given) or 'none'})"
        )
    training = [(p, r) for p, part in enumerate(pset.parts) for r in part]
    every = [*(r for _, r in training), *pset.validation]
    if ids:
        known = {r.id for r in every}
        unknown = set(ids) - known
        if unknown:
            raise DataError(
                f"no record has id {_names(unknown)}; the ids are those of the bundle's "
                "partitions/manifest.json and validation.jsonl (matched exactly); nothing was "
                "forgotten"
            )
        chosen, kind = set(ids), "ids"
    elif groups:
        if not any(r.group is not None for r in every):
            raise DataError(
                "the bundle's records name no data subject (it was trained without "
                "--group-field), so --group matches nothing; use --ids or --secret-matching"
            )
        present = {r.group for r in every}
        unknown = set(groups) - present
        if unknown:
            raise DataError(
                f"no record belongs to group {_names(unknown)} (the values of the --group-field "
                "column, matched exactly); nothing was forgotten"
            )
        wanted = set(groups)
        chosen = {r.id for r in every if r.group in wanted}
        kind = "group"
    else:
        try:
            rx = re.compile(str(secret_matching))
        except re.error as exc:
            raise DataError(f"--secret-matching is not a regular expression ({exc})") from None
        index = secret_index(every)  # each declared secret: the records declaring or holding it
        secrets = {s for s in index if rx.search(s)}
        if not secrets:
            n = sum(len(r.secrets) for r in every)
            raise DataError(
                f"no declared secret matches --secret-matching (of {n} declared secrets"
                + (
                    "; the bundle's records declare none: --secrets-field, --secret-pattern"
                    if n == 0
                    else ""
                )
                + "); nothing was forgotten"
            )
        chosen = {every[i].id for s in secrets for i in index[s]}
        kind = "secret-matching"
    canary_ids = {r.id for r in pset.canaries.records()} if pset.canaries is not None else set()
    canaries = chosen & canary_ids
    if canaries:
        raise DataError(
            f"{_names(canaries)} are canary records (scpdr's own test sequences, inserted by "
            "--canaries, nobody's data); forgetting one would leave the canary audit and the "
            "exposure attack without it: leave them out of the request"
        )
    by_partition: dict[int, list[Record]] = {p: [] for p in range(pset.k)}
    for p, r in training:
        if r.id in chosen:
            by_partition[p].append(r)
    validation = [r for r in pset.validation if r.id in chosen]
    return DeletionSelection(by_partition=by_partition, validation=validation, kind=kind)


def without_records(pset: PartitionSet, selection: DeletionSelection) -> PartitionSet:
    """``pset`` less the selected records: every other record stays in the partition it had, in
    its order; the manifest's entries, record count, records hash (over the remaining records in
    partition order) and pins follow, and the removed validation ids leave
    ``dataset.contaminated_validation``. The canaries are unchanged.

    Raises :class:`~scpdr.data.records.DataError` when a partition would be left with no record
    of its own (only canaries, or nothing): its constituent would train on nothing; partition
    the remaining data again (``scpdr train`` on it) instead."""
    drop = selection.ids
    canary_ids = {r.id for r in pset.canaries.records()} if pset.canaries is not None else set()
    parts = [[r for r in part if r.id not in drop] for part in pset.parts]
    empty = [p for p, part in enumerate(parts) if not any(r.id not in canary_ids for r in part)]
    if empty:
        raise DataError(
            f"forgetting these records would leave partition(s) {empty} with no record of their "
            "own, and their constituent(s) would train on nothing; train a new bundle on the "
            "remaining data (`scpdr train`, fewer --partitions) instead; nothing was forgotten"
        )
    m = pset.manifest
    dataset = dict(m.dataset)
    if dataset.get(CONTAMINATED_VALIDATION):
        dataset[CONTAMINATED_VALIDATION] = [
            i for i in dataset[CONTAMINATED_VALIDATION] if i not in drop
        ]
    remaining = [r for part in parts for r in part]
    manifest = m.model_copy(
        update={
            "num_records": len(remaining),
            "records_sha256": records_hash(remaining),
            "partitions": [
                PartitionEntry(
                    index=e.index, ids=[r.id for r in part], hashes=[r.hash for r in part]
                )
                for e, part in zip(m.partitions, parts, strict=True)
            ],
            "pinned": {i: p for i, p in m.pinned.items() if i not in drop},
            "dataset": dataset,
        }
    )
    return replace(
        pset,
        manifest=manifest,
        parts=parts,
        validation=[r for r in pset.validation if r.id not in drop],
    )


def remaining_near_duplicates(
    pset: PartitionSet, selection: DeletionSelection
) -> list[tuple[str, str, int]]:
    """``(removed id, kept id, partition)`` for each record left in a changed partition of
    ``pset`` (the partitions after :func:`without_records`) that is a copy or a near-duplicate
    (shingle Jaccard ≥ the manifest's threshold) of a removed one: the retrained constituent still
    learns that text. Ids only, never a text."""
    out = []
    for p in selection.partitions:
        kept, gone = pset.parts[p], selection.by_partition[p]
        texts = [r.text for r in kept] + [r.text for r in gone]
        for i, j, _ in near_duplicate_pairs(texts, pset.manifest.grouping):
            if i < len(kept) <= j:
                out.append((gone[j - len(kept)].id, kept[i].id, p))
    return sorted(out)
