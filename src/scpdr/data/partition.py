"""K disjoint partitions with near-duplicates kept together, a manifest, and an audit.

The NAF guarantee (paper Def. 2.1, Theorems 2.1/2.2, and Theorem 4.1 for SCP-Δr) protects an
example only if it is *absent* from the training data of at least one constituent. Splitting by
example is not enough when the corpus holds near-duplicates: a paraphrased copy in another
partition lets every constituent learn it. So partitioning here

1. groups near-duplicates: character ``shingle_size``-grams of the normalized text (lowercased,
   whitespace collapsed), MinHash signatures and LSH (datasketch) to find candidate pairs, each
   candidate verified by its *exact* shingle Jaccard ``>= threshold``; exact duplicates (same
   content hash) are always grouped; groups are the connected components (union-find);
2. joins the groups of records of the same data subject (:attr:`Record.group
   <scpdr.data.records.Record.group>`, ``--group-field``: a customer's tickets stay together) and
   of records that share a declared secret (one email in two unrelated records), unless the
   joined group would exceed a partition's fair share (then the audit reports the secret);
3. assigns whole groups to ``k`` partitions, balanced (largest groups first, each to the currently
   smallest partition) in a seeded order; groups containing a *pinned* record (e.g. canary copies,
   which must all land in one chosen partition) go to that partition.

Grouping lives in :mod:`scpdr.data.grouping` (:func:`~scpdr.data.grouping.record_groups`, which
the validation carve shares), the manifest and the files in
:mod:`scpdr.data.manifest`, the audit (:func:`audit_partitions`) in :mod:`scpdr.data.audit`; this
module re-exports their public names.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from scpdr.data.audit import AuditReport, Overlap, audit_dir, audit_partitions
from scpdr.data.canaries import CanaryRegistry
from scpdr.data.grouping import GroupingConfig, group_near_duplicates, record_groups, shingles
from scpdr.data.manifest import (
    PartitionEntry,
    PartitionManifest,
    PartitionSet,
    load_partitions,
    save_partitions,
)
from scpdr.data.records import DataError, Record, records_hash

__all__ = [
    "DEFAULT_K",
    "MIN_RECORDS_PER_PARTITION",
    "AuditReport",
    "GroupingConfig",
    "Overlap",
    "PartitionEntry",
    "PartitionManifest",
    "PartitionSet",
    "audit_dir",
    "audit_partitions",
    "default_k",
    "default_k_reason",
    "group_near_duplicates",
    "load_partitions",
    "partition_records",
    "save_partitions",
    "shingles",
]


#: The number of partitions where none is given, and the fewest training records each must get
#: for it. The K sweep (``configs/ablations/k.yaml``, docs/experiments.md: K = 2, 3, 4, 8 over the
#: same 96 names) put SCP-Δr-b at chance on every membership test at K = 4 (24 records per
#: partition) with the utility of K = 2, where K = 2 leaves the Ref test at AUC .81; K = 8 bought
#: no more. Below 4 × 20 records a partition holds too little to learn from (K = 2 then: the
#: paper's setting and the only K CP-Fuse fuses).
DEFAULT_K = 4
MIN_RECORDS_PER_PARTITION = 20


def default_k(n_records: int) -> int:
    """:data:`DEFAULT_K` when ``n_records`` training records give each partition at least
    :data:`MIN_RECORDS_PER_PARTITION`, else 2 (the fewest that protect anything)."""
    return DEFAULT_K if n_records >= DEFAULT_K * MIN_RECORDS_PER_PARTITION else 2


def default_k_reason(n_records: int) -> str:
    """Why :func:`default_k` chose what it did for ``n_records``, for a printed plan."""
    k = default_k(n_records)
    if k == DEFAULT_K:
        return (
            f"K = {k}, the default ({n_records} training records, at least "
            f"{MIN_RECORDS_PER_PARTITION} per partition; docs/experiments.md)"
        )
    return (
        f"K = {k}: {n_records} training records are too few for the default K = {DEFAULT_K} "
        f"(at least {MIN_RECORDS_PER_PARTITION} per partition); --partitions / --k chooses"
    )


def partition_records(
    records: Sequence[Record],
    *,
    k: int,
    seed: int = 0,
    grouping: GroupingConfig | None = None,
    pins: Mapping[str, int] | None = None,
    canaries: CanaryRegistry | None = None,
    validation: Sequence[Record] = (),
    dataset: Mapping[str, Any] | None = None,
) -> PartitionSet:
    """Split ``records`` into ``k`` disjoint partitions, keeping near-duplicates together.

    Args:
        records: the training records (ids unique).
        k: number of partitions (= constituents), ``>= 1``.
        seed: seeds the order in which equal-size groups are dealt out.
        grouping: near-duplicate parameters (default :class:`GroupingConfig`).
        pins: ``{record id: partition}`` forced placements; the whole group of a pinned record
            follows it. Pinned records do not count towards the balance of the others.
        canaries: if given, its copies (:meth:`CanaryRegistry.records`) are appended to
            ``records`` and pinned to ``canaries.partition``; the registry is kept in the result.
        validation: held-out records stored beside the partitions (never partitioned).
        dataset: provenance recorded in the manifest (e.g. ``{"name": "names2ids", "seed": 0}``).

    Records with the same :attr:`~scpdr.data.records.Record.group` share a partition (with their
    near-duplicates), and so do records that share a declared secret when they fit in a
    partition's fair share. Partition sizes of unpinned records differ by at most the largest group's
    size.
    """
    if k < 1:
        raise DataError(f"need k >= 1 partitions, got {k}")
    grouping = grouping or GroupingConfig()
    records = list(records)
    pins = dict(pins or {})
    if canaries is not None:
        if canaries.partition >= k:
            raise DataError(
                f"canaries go to partition {canaries.partition} but there are only {k} partitions"
            )
        extra = canaries.records()
        records += extra
        pins.update(canaries.pins())
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"duplicate record id {dup!r}; ids must be unique before partitioning")
    index = {rid: i for i, rid in enumerate(ids)}
    for rid, p in pins.items():
        if rid not in index:
            raise DataError(f"pinned id {rid!r} is not among the records")
        if not 0 <= p < k:
            raise DataError(f"id {rid!r} is pinned to partition {p}, outside 0..{k - 1}")

    # near-duplicates, data subjects, and records sharing a declared secret when the joined
    # group fits a partition's fair share (ceil(records / k)) and no two pins disagree: such a
    # secret stays spread, and the audit names it (refused in every partition, else a warning)
    groups = record_groups(
        records,
        grouping,
        secrets=k >= 2,
        secret_limit=-(-len(records) // k),
        pins={index[i]: p for i, p in pins.items()},
    )
    group_pin: list[int | None] = []
    for g in groups:
        targets = {pins[ids[i]] for i in g if ids[i] in pins}
        if len(targets) > 1:
            raise DataError(
                f"records {[ids[i] for i in g]} are near-duplicates but pinned to different "
                f"partitions {sorted(targets)}; they must share a partition"
            )
        group_pin.append(targets.pop() if targets else None)

    rng = random.Random(f"partition:{seed}")
    order = list(range(len(groups)))
    rng.shuffle(order)
    order.sort(key=lambda gi: -len(groups[gi]))  # stable: seeded order within equal sizes
    assign: list[int] = [-1] * len(records)
    load = [0] * k
    for gi in order:
        if group_pin[gi] is not None:
            continue
        p = min(range(k), key=lambda j: (load[j], j))
        load[p] += len(groups[gi])
        for i in groups[gi]:
            assign[i] = p
    for gi, p in enumerate(group_pin):
        if p is not None:
            for i in groups[gi]:
                assign[i] = p

    parts: list[list[Record]] = [[] for _ in range(k)]
    for i, r in enumerate(records):
        parts[assign[i]].append(r)
    empty = [p for p, part in enumerate(parts) if not part]
    if empty:
        raise DataError(
            f"{len(records)} records in {len(groups)} group(s) (near-duplicates, data "
            f"subjects) cannot fill k = {k} partitions: partition(s) {empty} would be empty and their constituents would train "
            "on nothing; lower k (--k) or add records"
        )
    manifest = PartitionManifest(
        k=k,
        seed=seed,
        grouping=grouping,
        num_groups=len(groups),
        num_records=len(records),
        records_sha256=records_hash(records),
        partitions=[
            PartitionEntry(index=p, ids=[r.id for r in part], hashes=[r.hash for r in part])
            for p, part in enumerate(parts)
        ],
        pinned=pins,
        dataset=dict(dataset or {}),
    )
    return PartitionSet(
        manifest=manifest, parts=parts, validation=list(validation), canaries=canaries
    )
