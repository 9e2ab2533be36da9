"""The partition audit: are the partitions of a manifest disjoint, exactly and up to
near-duplicates, are the canaries where they belong, is every declared secret absent from at
least one partition, and is the validation split apart from every partition?

:func:`audit_partitions` re-checks a manifest against the records: ids in two partitions, exact
duplicates and near-duplicates across partitions, records that changed since the manifest was
written, canaries in the wrong place, and declared secrets (:mod:`scpdr.data.secrets`) found in
the texts of several partitions (paper Def. 2.1: protection needs each example — and each secret —
absent from at least one constituent's data). A secret in *every* partition fails the audit; in
more than one but not all, it is a warning with counts. Validation records are the attacks'
non-members and the No CP-val chance level: one that is the same text as, a near-duplicate of, or
shares a declared secret with a training record (``validation_overlaps``) fails the audit, and
forced through it is named (:attr:`AuditReport.contaminated_validation`) so that the attacks
leave it out. Reports name records, never a secret.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scpdr.data.canaries import CanaryRegistry
from scpdr.data.grouping import GroupingConfig, near_duplicate_pairs
from scpdr.data.manifest import PartitionManifest, load_partitions
from scpdr.data.records import Record
from scpdr.data.secrets import SecretOccurrence, secret_occurrences
from scpdr.errors import PartitionAuditError

__all__ = ["AuditReport", "Overlap", "ValidationOverlap", "audit_dir", "audit_partitions"]


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


@dataclass(frozen=True)
class ValidationOverlap:
    """A validation record that the training data holds after all: the same text as
    (``kind="exact"``), a near-duplicate of (``kind="near"``, with their shingle Jaccard) or
    sharing a declared secret with (``kind="secret"``; ``secret`` names it by its record and
    position, never its text) record ``record_id`` of partition ``partition``."""

    kind: str
    validation_id: str
    record_id: str
    partition: int
    jaccard: float | None = None
    secret: str | None = None

    def describe(self) -> str:
        what = {
            "exact": "the same text as",
            "near": f"a near-duplicate (Jaccard {self.jaccard or 0:.3f}) of",
            "secret": f"sharing {self.secret} with",
        }[self.kind]
        return (
            f"validation record {self.validation_id!r} is {what} {self.record_id!r} "
            f"(partition {self.partition})"
        )


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
    secret_errors: list[SecretOccurrence] = field(default_factory=list)
    secret_warnings: list[SecretOccurrence] = field(default_factory=list)
    num_validation: int = 0
    validation_overlaps: list[ValidationOverlap] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (
            self.exact_overlaps
            or self.near_duplicate_overlaps
            or self.integrity_errors
            or self.canary_errors
            or self.secret_errors
            or self.validation_overlaps
        )

    @property
    def contaminated_validation(self) -> list[str]:
        """The ids of the validation records with an overlap (sorted): no non-members."""
        return sorted({o.validation_id for o in self.validation_overlaps})

    def secret_warning(self) -> str | None:
        """One line on the secrets found in more than one partition (not all): counts only."""
        if not self.secret_warnings:
            return None
        n_rec = len({i for o in self.secret_warnings for ids in o.records.values() for i in ids})
        return (
            f"{len(self.secret_warnings)} declared secret(s) occur in more than one partition "
            f"(not all; {n_rec} records): each stays protected by the partitions without it, "
            "but fewer constituents lack it; keep them together with --group-field"
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
            "secret_errors": [o.to_dict() for o in self.secret_errors],
            "secret_warnings": {
                "count": len(self.secret_warnings),
                "secrets": [o.to_dict() for o in self.secret_warnings],
            },
            "num_validation": self.num_validation,
            "validation_overlaps": [o.__dict__ for o in self.validation_overlaps],
            "contaminated_validation": self.contaminated_validation,
        }

    def summary(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        lines = [
            f"partition audit {status}: {self.num_records} records in {self.k} partitions; "
            f"{len(self.exact_overlaps)} exact overlaps, "
            f"{len(self.near_duplicate_overlaps)} near-duplicate overlaps "
            f"(Jaccard >= {self.grouping.threshold}), {len(self.integrity_errors)} integrity "
            f"errors, {len(self.canary_errors)} canary errors"
            + (
                f", {len(self.secret_errors)} secrets in every partition"
                if self.secret_errors
                else ""
            )
            + (
                f"; {self.num_validation} validation records, "
                f"{len(self.contaminated_validation)} overlapping the partitions"
                if self.num_validation
                else ""
            )
        ]
        for o in (self.exact_overlaps + self.near_duplicate_overlaps)[:20]:
            lines.append(
                f"  {o.kind}: {o.id_a} (partition {o.partition_a}) ~ {o.id_b} "
                f"(partition {o.partition_b}), Jaccard {o.jaccard:.3f}"
            )
        lines += [f"  {e}" for e in (self.integrity_errors + self.canary_errors)[:20]]
        lines += [f"  {o.describe()} (every partition)" for o in self.secret_errors[:20]]
        lines += [f"  {o.describe()}" for o in self.validation_overlaps[:20]]
        if len(self.validation_overlaps) > 20:
            lines.append(
                f"  ... {len(self.validation_overlaps) - 20} more validation overlaps; "
                f"contaminated validation records: {', '.join(self.contaminated_validation)}"
            )
        warning = self.secret_warning()
        if warning:
            lines.append(f"  warning: {warning}")
        return "\n".join(lines)

    def raise_if_failed(
        self, override: str = "`--allow-failed-audit`, allow_failed_audit=True in Python"
    ) -> None:
        """Raise :class:`~scpdr.errors.PartitionAuditError` unless passed: the summary, the
        failed checks and the fixes (``override``: how the caller's user overrides the audit)."""
        if self.passed:
            return
        failed = ", ".join(  # the non-empty lists: exact/near-duplicate overlaps, errors
            k.replace("_", " ")
            for k, v in self.to_dict().items()
            if isinstance(v, list) and v and k != "contaminated_validation"
        )
        secrets = (
            " A secret in every partition is in every constituent's data, so no aggregate can "
            "protect it: keep the records that share it in one group (--group-field, e.g. the "
            "customer), remove it from the records that only mention it, or use more "
            "partitions."
            if self.secret_errors
            else ""
        )
        validation = (
            " A validation record with a copy, a near-copy or a declared secret in the training "
            "data is no non-member: every attack's chance level would be too lenient. Let "
            "`scpdr partition` carve the validation split (whole near-duplicate groups, "
            "--group-field groups and records sharing a secret), or remove those records from "
            "the data's own validation split."
            if self.validation_overlaps
            else ""
        )
        raise PartitionAuditError(
            f"{self.summary()}\nFailed checks: {failed}.{secrets}{validation} Re-partition the data (`scpdr "
            "partition`) so that no record or near-duplicate is shared between partitions, or, "
            f"knowingly, override the audit ({override}); the override is recorded in the bundle."
        )


def audit_partitions(
    manifest: PartitionManifest,
    records: Sequence[Record],
    *,
    grouping: GroupingConfig | None = None,
    canaries: CanaryRegistry | None = None,
    validation: Sequence[Record] = (),
) -> AuditReport:
    """Check that the partitions of ``manifest`` are disjoint, exactly and up to near-duplicates,
    and apart from the ``validation`` records.

    Args:
        manifest: the partition manifest.
        records: the records the manifest refers to (typically all partitions' records); records
            whose id the manifest does not list are ignored.
        grouping: near-duplicate parameters (default: the manifest's).
        canaries: if given, also check that every inserted copy sits in the canary partition and
            that no held-out canary appears in any partition.
        validation: the held-out records (never partitioned): the attacks' non-members.

    Reports (i) ids listed in two partitions and equal content hashes in two partitions
    (``exact_overlaps``); (ii) cross-partition pairs with shingle Jaccard ``>= threshold``
    (``near_duplicate_overlaps``); (iii) manifest ids without a record or whose text no longer
    matches the manifest hash (``integrity_errors``); (iv) misplaced canaries; (v) declared
    secrets whose text occurs in every partition (``secret_errors``, k > 1) or in several
    (``secret_warnings``; :func:`~scpdr.data.secrets.secret_occurrences`); (vi) validation
    records with the same text as, a near-duplicate of, or a declared secret shared with a
    partition's record (``validation_overlaps``).
    """
    grouping = grouping or manifest.grouping
    report = AuditReport(
        k=manifest.k,
        num_records=manifest.num_records,
        grouping=grouping,
        num_validation=len(validation),
    )
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

    for v in validation:  # a validation text that a partition holds
        hit = first_by_hash.get(v.hash)
        if hit is not None:
            report.validation_overlaps.append(ValidationOverlap("exact", v.id, *hit, 1.0))

    # near-duplicates across partitions, and between validation and a partition (over the
    # records actually present; identical texts were reported by the hash passes above)
    present = [
        (rid, entry.index, by_id[rid])
        for entry in manifest.partitions
        for rid in entry.ids
        if rid in by_id and where[rid][0] == entry.index
    ]
    texts = [r.text for _, _, r in present] + [v.text for v in validation]
    for i, j, jac in near_duplicate_pairs(texts, grouping):
        if j < len(present):
            (a, pa, ra), (b, pb, rb) = present[i], present[j]
            if pa != pb and ra.text != rb.text:
                report.near_duplicate_overlaps.append(Overlap("near", a, pa, b, pb, jac))
        elif i < len(present):
            (a, pa, ra), v = present[i], validation[j - len(present)]
            if ra.text != v.text:
                report.validation_overlaps.append(ValidationOverlap("near", v.id, a, pa, jac))

    _audit_secrets(
        report,
        manifest,
        [[by_id[i] for i in e.ids if i in by_id] for e in manifest.partitions],
        validation,
    )

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


def _audit_secrets(
    report: AuditReport,
    manifest: PartitionManifest,
    parts: Sequence[Sequence[Record]],
    validation: Sequence[Record],
) -> None:
    """The secret checks of :func:`audit_partitions`: a declared secret (of a partition's or a
    validation record) in every partition (k > 1) fails, in several is a warning; in validation
    and a partition is a validation overlap."""
    val = len(parts)  # validation is the last "partition" searched
    for occ in secret_occurrences([*parts, validation]):
        in_parts = {p: ids for p, ids in occ.records.items() if p != val}
        if val in occ.records:
            name = f"secret {occ.index + 1} of record {occ.owner!r}"
            for vid in occ.records[val]:
                for p, ids in sorted(in_parts.items()):
                    report.validation_overlaps.append(
                        ValidationOverlap("secret", vid, ids[0], p, secret=name)
                    )
        if manifest.k > 1 and len(in_parts) > 1:
            found = SecretOccurrence(occ.owner, occ.index, records=in_parts)
            if len(in_parts) == manifest.k:
                report.secret_errors.append(found)
            else:
                report.secret_warnings.append(found)


def audit_dir(path: str | os.PathLike[str], **kwargs: Any) -> AuditReport:
    """:func:`audit_partitions` on a directory written by :func:`save_partitions` (its
    validation records included)."""
    pset = load_partitions(path)
    return audit_partitions(
        pset.manifest,
        pset.records(),
        canaries=kwargs.pop("canaries", pset.canaries),
        validation=kwargs.pop("validation", pset.validation),
        **kwargs,
    )
