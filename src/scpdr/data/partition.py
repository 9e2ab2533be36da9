"""K disjoint partitions with near-duplicates kept together, a manifest, and an audit.

The NAF guarantee (paper Def. 2.1, Theorems 2.1/2.2, and Theorem 4.1 for SCP-Δr) protects an
example only if it is *absent* from the training data of at least one constituent. Splitting by
example is not enough when the corpus holds near-duplicates: a paraphrased copy in another
partition lets every constituent learn it. So partitioning here

1. groups near-duplicates: character ``shingle_size``-grams of the normalized text (lowercased,
   whitespace collapsed), MinHash signatures and LSH (datasketch) to find candidate pairs, each
   candidate verified by its *exact* shingle Jaccard ``>= threshold``; exact duplicates (same
   content hash) are always grouped; groups are the connected components (union-find);
2. assigns whole groups to ``k`` partitions, balanced (largest groups first, each to the currently
   smallest partition) in a seeded order; groups containing a *pinned* record (e.g. canary copies,
   which must all land in one chosen partition) go to that partition.

:func:`audit_partitions` re-checks a manifest against the records: ids in two partitions, exact
duplicates and near-duplicates across partitions, records that changed since the manifest was
written, and canaries in the wrong place. LSH can miss a pair whose Jaccard is close to the
threshold (a false negative); pairs well above it are found with overwhelming probability.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scpdr.data.canaries import CanaryRegistry
from scpdr.data.records import DataError, Record, load_records, records_hash, save_records
from scpdr.errors import ConfigError, PartitionAuditError
from scpdr.io import atomic_write_json, read_json

__all__ = [
    "AuditReport",
    "GroupingConfig",
    "Overlap",
    "PartitionEntry",
    "PartitionManifest",
    "PartitionSet",
    "audit_dir",
    "audit_partitions",
    "group_near_duplicates",
    "load_partitions",
    "partition_records",
    "save_partitions",
    "shingles",
]

MANIFEST_NAME = "manifest.json"
CANARIES_NAME = "canaries.json"
VALIDATION_NAME = "validation.jsonl"


def _part_name(i: int) -> str:
    return f"partition-{i}.jsonl"


class GroupingConfig(BaseModel):
    """Near-duplicate grouping parameters (recorded in the manifest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = Field("minhash-lsh", description="Grouping method (only 'minhash-lsh').")
    threshold: float = Field(
        0.7, gt=0.0, lt=1.0, description="Shingle Jaccard at or above which records are grouped."
    )
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations.")
    shingle_size: int = Field(5, ge=1, le=64, description="Character n-gram size for shingles.")
    minhash_seed: int = Field(1, description="Seed of the MinHash permutations.")


def shingles(text: str, *, n: int = 5) -> frozenset[str]:
    """Character ``n``-grams of ``text`` lowercased with whitespace collapsed (the whole text when
    shorter than ``n``)."""
    norm = " ".join(text.lower().split())
    if len(norm) <= n:
        return frozenset({norm})
    return frozenset(norm[i : i + n] for i in range(len(norm) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:  # path compression
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)


def _near_duplicate_pairs(
    texts: Sequence[str], grouping: GroupingConfig
) -> list[tuple[int, int, float]]:
    """All pairs ``(i, j, jaccard)`` with ``i < j`` that are exact duplicates or LSH candidates
    whose exact shingle Jaccard is ``>= grouping.threshold``."""
    from datasketch import MinHash, MinHashLSH

    sh = [shingles(t, n=grouping.shingle_size) for t in texts]
    pairs: dict[tuple[int, int], float] = {}
    by_hash: dict[str, int] = {}
    for i, t in enumerate(texts):
        h = hashlib.sha256(t.encode("utf-8")).hexdigest()
        if h in by_hash:
            pairs[(by_hash[h], i)] = 1.0
        else:
            by_hash[h] = i
    if len(texts) < 2:
        return []
    mhs = MinHash.bulk(
        [[s.encode("utf-8") for s in sorted(x)] for x in sh],
        num_perm=grouping.num_perm,
        seed=grouping.minhash_seed,
    )
    try:
        lsh = MinHashLSH(threshold=grouping.threshold, num_perm=grouping.num_perm)
    except ValueError as exc:
        raise ConfigError(
            f"near-duplicate threshold {grouping.threshold} with num_perm={grouping.num_perm} "
            f"is not usable by MinHash LSH ({exc}); lower the threshold or raise num_perm"
        ) from None
    for i, mh in enumerate(mhs):
        lsh.insert(i, mh, check_duplication=False)
    for i, mh in enumerate(mhs):
        for j in lsh.query(mh):
            if j <= i or (i, j) in pairs:
                continue
            jac = jaccard(sh[i], sh[j])
            if jac >= grouping.threshold:
                pairs[(i, j)] = jac
    return sorted((i, j, jac) for (i, j), jac in pairs.items())


def group_near_duplicates(
    texts: Sequence[str], *, grouping: GroupingConfig | None = None
) -> list[list[int]]:
    """Groups (lists of indices into ``texts``, each sorted; groups ordered by first index) of
    near-duplicate texts: the connected components of the near-duplicate pairs."""
    grouping = grouping or GroupingConfig()
    uf = _UnionFind(len(texts))
    for i, j, _ in _near_duplicate_pairs(texts, grouping):
        uf.union(i, j)
    groups: dict[int, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(uf.find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


class PartitionEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    ids: list[str]
    hashes: list[str] = Field(description="SHA-256 of each record's text, aligned with ids.")


class PartitionManifest(BaseModel):
    """What went where: ids and content hashes per partition plus the grouping parameters."""

    model_config = ConfigDict(extra="forbid")

    version: int = 1
    k: int
    seed: int
    grouping: GroupingConfig
    num_groups: int
    num_records: int
    records_sha256: str = Field(description="records_hash() of the partitioned records, in order.")
    partitions: list[PartitionEntry]
    pinned: dict[str, int] = Field(
        default_factory=dict, description="Record id → forced partition."
    )
    dataset: dict[str, Any] = Field(default_factory=dict, description="Where the data came from.")

    def sha256(self) -> str:
        """Hash of the canonical JSON: the bundle's ``partition_manifest_hash``."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def partition_of(self) -> dict[str, list[int]]:
        """``{id: [partition indices listing it]}`` (more than one index is an overlap)."""
        out: dict[str, list[int]] = {}
        for p in self.partitions:
            for rid in p.ids:
                out.setdefault(rid, []).append(p.index)
        return out

    def save(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write_json(path, self.model_dump(mode="json"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PartitionManifest:
        try:
            return cls.model_validate(read_json(path))
        except (ValueError, TypeError) as exc:
            raise DataError(f"{path}: not a valid partition manifest ({exc})") from None


@dataclass
class PartitionSet:
    """Partitioned training records plus the manifest (and optionally validation and canaries)."""

    manifest: PartitionManifest
    parts: list[list[Record]]
    validation: list[Record] = field(default_factory=list)
    canaries: CanaryRegistry | None = None

    @property
    def k(self) -> int:
        return len(self.parts)

    def records(self) -> list[Record]:
        return [r for part in self.parts for r in part]


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

    Partition sizes of unpinned records differ by at most the largest group's size.
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

    groups = group_near_duplicates([r.text for r in records], grouping=grouping)
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
            f"{len(records)} records in {len(groups)} near-duplicate group(s) cannot fill k = {k} "
            f"partitions: partition(s) {empty} would be empty and their constituents would train "
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


# ------------------------------------------------------------------------------------ on disk


def save_partitions(
    out: str | os.PathLike[str], pset: PartitionSet, *, overwrite: bool = False
) -> Path:
    """Write ``out/`` atomically: ``manifest.json``, ``partition-<i>.jsonl``, ``validation.jsonl``
    (if any) and ``canaries.json`` (if any). Built in a temp dir beside ``out``, then renamed."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise DataError(
            f"{out} already exists; delete it or choose another output directory; in Python, "
            "save_partitions(..., overwrite=True) replaces it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for i, part in enumerate(pset.parts):
            save_records(tmp / _part_name(i), part)
        if pset.validation:
            save_records(tmp / VALIDATION_NAME, pset.validation)
        if pset.canaries is not None:
            pset.canaries.save(tmp / CANARIES_NAME)
        pset.manifest.save(tmp / MANIFEST_NAME)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_partitions(path: str | os.PathLike[str]) -> PartitionSet:
    """Read a directory written by :func:`save_partitions`."""
    path = Path(path)
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise DataError(
            f"{path} is not a partition directory (no {MANIFEST_NAME}); create one with "
            f"`scpdr partition DATA --k K --out DIR`"
        )
    manifest = PartitionManifest.load(mpath)
    parts = []
    for entry in manifest.partitions:
        f = path / _part_name(entry.index)
        parts.append(load_records(f) if f.is_file() and f.stat().st_size else [])
    val_path = path / VALIDATION_NAME
    validation = load_records(val_path) if val_path.is_file() else []
    can_path = path / CANARIES_NAME
    canaries = CanaryRegistry.load(can_path) if can_path.is_file() else None
    return PartitionSet(manifest=manifest, parts=parts, validation=validation, canaries=canaries)


# ------------------------------------------------------------------------------------ audit


@dataclass(frozen=True)
class Overlap:
    """Two records in different partitions that are the same (``kind="exact"``: same id or same
    content hash) or near-duplicates (``kind="near"``, with their shingle Jaccard)."""

    kind: str
    id_a: str
    partition_a: int
    id_b: str
    partition_b: int
    jaccard: float = 1.0


@dataclass
class AuditReport:
    """Result of :func:`audit_partitions`; ``passed`` only if every list is empty."""

    k: int
    num_records: int
    grouping: GroupingConfig
    exact_overlaps: list[Overlap] = field(default_factory=list)
    near_duplicate_overlaps: list[Overlap] = field(default_factory=list)
    integrity_errors: list[str] = field(default_factory=list)
    canary_errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (
            self.exact_overlaps
            or self.near_duplicate_overlaps
            or self.integrity_errors
            or self.canary_errors
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (also what a bundle's ``audit`` field stores)."""
        return {
            "passed": self.passed,
            "k": self.k,
            "num_records": self.num_records,
            "grouping": self.grouping.model_dump(mode="json"),
            "exact_overlaps": [o.__dict__ for o in self.exact_overlaps],
            "near_duplicate_overlaps": [o.__dict__ for o in self.near_duplicate_overlaps],
            "integrity_errors": list(self.integrity_errors),
            "canary_errors": list(self.canary_errors),
        }

    def summary(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        lines = [
            f"partition audit {status}: {self.num_records} records in {self.k} partitions; "
            f"{len(self.exact_overlaps)} exact overlaps, "
            f"{len(self.near_duplicate_overlaps)} near-duplicate overlaps "
            f"(Jaccard >= {self.grouping.threshold}), {len(self.integrity_errors)} integrity "
            f"errors, {len(self.canary_errors)} canary errors"
        ]
        for o in (self.exact_overlaps + self.near_duplicate_overlaps)[:20]:
            lines.append(
                f"  {o.kind}: {o.id_a} (partition {o.partition_a}) ~ {o.id_b} "
                f"(partition {o.partition_b}), Jaccard {o.jaccard:.3f}"
            )
        lines += [f"  {e}" for e in (self.integrity_errors + self.canary_errors)[:20]]
        return "\n".join(lines)

    def raise_if_failed(
        self, override: str = "`--allow-failed-audit`, allow_failed_audit=True in Python"
    ) -> None:
        """Raise :class:`~scpdr.errors.PartitionAuditError` unless passed: the summary, the
        failed checks and the fixes (``override``: how the caller's user overrides the audit)."""
        if self.passed:
            return
        failed = ", ".join(  # the non-empty lists: exact/near-duplicate overlaps, errors
            k.replace("_", " ") for k, v in self.to_dict().items() if isinstance(v, list) and v
        )
        raise PartitionAuditError(
            f"{self.summary()}\nFailed checks: {failed}. Re-partition the data (`scpdr "
            "partition`) so that no record or near-duplicate is shared between partitions, or, "
            f"knowingly, override the audit ({override}); the override is recorded in the bundle."
        )


def audit_partitions(
    manifest: PartitionManifest,
    records: Sequence[Record],
    *,
    grouping: GroupingConfig | None = None,
    canaries: CanaryRegistry | None = None,
) -> AuditReport:
    """Check that the partitions of ``manifest`` are disjoint, exactly and up to near-duplicates.

    Args:
        manifest: the partition manifest.
        records: the records the manifest refers to (typically all partitions' records); records
            whose id the manifest does not list are ignored.
        grouping: near-duplicate parameters (default: the manifest's).
        canaries: if given, also check that every inserted copy sits in the canary partition and
            that no held-out canary appears in any partition.

    Reports (i) ids listed in two partitions and equal content hashes in two partitions
    (``exact_overlaps``); (ii) cross-partition pairs with shingle Jaccard ``>= threshold``
    (``near_duplicate_overlaps``); (iii) manifest ids without a record or whose text no longer
    matches the manifest hash (``integrity_errors``); (iv) misplaced canaries.
    """
    grouping = grouping or manifest.grouping
    report = AuditReport(k=manifest.k, num_records=manifest.num_records, grouping=grouping)
    where = manifest.partition_of()
    by_id = {r.id: r for r in records}

    for rid, ps in where.items():
        if len(ps) > 1:
            report.exact_overlaps.append(Overlap("exact", rid, ps[0], rid, ps[1]))

    first_by_hash: dict[str, tuple[str, int]] = {}
    for entry in manifest.partitions:
        if len(entry.hashes) != len(entry.ids):
            report.integrity_errors.append(
                f"partition {entry.index}: {len(entry.ids)} ids but {len(entry.hashes)} hashes"
            )
        for rid, h in zip(entry.ids, entry.hashes, strict=False):
            rec = by_id.get(rid)
            if rec is None:
                report.integrity_errors.append(
                    f"id {rid!r} (partition {entry.index}) has no record"
                )
            elif rec.hash != h:
                report.integrity_errors.append(
                    f"record {rid!r} (partition {entry.index}) changed since the manifest was "
                    f"written (hash mismatch)"
                )
            prev = first_by_hash.get(h)
            if prev is None:
                first_by_hash[h] = (rid, entry.index)
            elif prev[1] != entry.index and prev[0] != rid:
                report.exact_overlaps.append(Overlap("exact", prev[0], prev[1], rid, entry.index))

    # near-duplicates across partitions (over the records actually present; identical texts
    # were reported by the hash pass above)
    present = [
        (rid, entry.index, by_id[rid])
        for entry in manifest.partitions
        for rid in entry.ids
        if rid in by_id and where[rid][0] == entry.index
    ]
    for i, j, jac in _near_duplicate_pairs([r.text for _, _, r in present], grouping):
        (a, pa, ra), (b, pb, rb) = present[i], present[j]
        if pa != pb and ra.text != rb.text:
            report.near_duplicate_overlaps.append(Overlap("near", a, pa, b, pb, jac))

    if canaries is not None:
        for c in canaries.inserted:
            for r in c.copies():
                ps = where.get(r.id)
                if ps is None:
                    report.canary_errors.append(f"canary copy {r.id!r} is in no partition")
                elif ps != [canaries.partition]:
                    report.canary_errors.append(
                        f"canary copy {r.id!r} is in partition(s) {ps}, expected "
                        f"[{canaries.partition}]"
                    )
        held = {c.text: c.id for c in canaries.held_out}
        for rid in where:
            rec = by_id.get(rid)
            if rec is not None and rec.text in held:
                report.canary_errors.append(
                    f"held-out canary {held[rec.text]!r} appears in training record {rid!r}"
                )
    return report


def audit_dir(path: str | os.PathLike[str], **kwargs: Any) -> AuditReport:
    """:func:`audit_partitions` on a directory written by :func:`save_partitions`."""
    pset = load_partitions(path)
    return audit_partitions(
        pset.manifest, pset.records(), canaries=kwargs.pop("canaries", pset.canaries), **kwargs
    )
