"""The one data preparation: load records → insert canaries → K disjoint partitions (+ manifest,
audited) → save. ``scpdr train``, ``scpdr partition`` and the experiment's partition stage all
call :func:`prepare_partitions` (DESIGN.md "Data flow"; STYLE.md 17).

The audit is what makes the NAF guarantee applicable (paper Def. 2.1, Theorems 2.1/2.2 and 4.1:
a protected example must be absent from at least one constituent's data); a failing audit refuses
unless the caller overrides it, and the override travels with the partitions into the bundle
(:func:`audit_for_bundle`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scpdr.data.audit import AuditReport, audit_partitions
from scpdr.data.canaries import CanaryConfig, CanaryRegistry, make_canaries
from scpdr.data.corpora import Corpus, load_corpus
from scpdr.data.grouping import GroupingConfig
from scpdr.data.manifest import CONTAMINATED_VALIDATION, PartitionSet, save_partitions
from scpdr.data.partition import default_k, default_k_reason, partition_records
from scpdr.data.records import DataError, FieldMapping
from scpdr.data.secrets import SecretsConfig, add_secrets, check_secret_field

logger = logging.getLogger(__name__)

__all__ = ["PreparedPartitions", "audit_for_bundle", "checked_audit", "prepare_partitions"]

#: How a library caller overrides a failing audit (the CLI and the experiment name their own).
LIBRARY_OVERRIDE = "allow_failed_audit=True"


@dataclass(frozen=True)
class PreparedPartitions:
    """What :func:`prepare_partitions` made: the partitions, their audit, where they were
    saved (``None`` when not saved) and, when K was not given, why the default K
    (:func:`~scpdr.data.partition.default_k_reason`)."""

    pset: PartitionSet
    audit: AuditReport
    overridden: bool
    path: Path | None = None
    k_reason: str | None = None

    def audit_record(self) -> dict[str, Any]:
        """The bundle's ``audit`` field: :meth:`AuditReport.to_dict` plus ``"overridden"``."""
        return {**self.audit.to_dict(), "overridden": self.overridden}


def checked_audit(
    pset: PartitionSet, *, allow_failed_audit: bool = False, override: str = LIBRARY_OVERRIDE
) -> tuple[AuditReport, bool]:
    """Audit ``pset`` (with its canaries); ``(report, overridden)``.

    A failing audit raises :class:`~scpdr.errors.PartitionAuditError` naming the failed checks
    and the fixes (``override``: how the caller's user overrides it) unless
    ``allow_failed_audit``; ``overridden`` is true when the audit failed and was let through.
    """
    report = audit_partitions(
        pset.manifest, pset.records(), canaries=pset.canaries, validation=pset.validation
    )
    warning = report.secret_warning()
    if warning:
        logger.warning("partition audit: %s", warning)
    if not report.passed:
        if not allow_failed_audit:
            report.raise_if_failed(override)
        logger.warning("partition audit FAILED; continuing because it was overridden")
        if report.contaminated_validation:
            logger.warning(
                "partition audit: %d of %d validation records overlap the partitions (%s); "
                "the attacks leave them out of the non-members",
                len(report.contaminated_validation),
                report.num_validation,
                ", ".join(report.contaminated_validation[:10])
                + (" ..." if len(report.contaminated_validation) > 10 else ""),
            )
    return report, bool(allow_failed_audit and not report.passed)


def audit_for_bundle(
    pset: PartitionSet,
    *,
    allow_failed_audit: bool = False,
    override: str = "`--allow-failed-audit`, allow_failed_audit=True in Python",
) -> dict[str, Any]:
    """Audit ``pset`` before bundling and return the bundle's ``audit`` field.

    The field is :meth:`~scpdr.data.audit.AuditReport.to_dict` of
    :func:`~scpdr.data.audit.audit_partitions` (with the set's canaries) plus ``"overridden"``.
    A failing audit raises :class:`~scpdr.errors.PartitionAuditError` unless
    ``allow_failed_audit`` (see :func:`checked_audit`). Used by ``train_bundle`` and
    ``scpdr bundle``.
    """
    report, overridden = checked_audit(
        pset, allow_failed_audit=allow_failed_audit, override=override
    )
    return {**report.to_dict(), "overridden": overridden}


def prepare_partitions(
    data: str | os.PathLike[str] | Corpus,
    *,
    k: int | None = None,
    seed: int = 0,
    n_train: int | None = None,
    n_val: int | None = None,
    val_fraction: float | None = 0.0,
    fields: FieldMapping | Mapping[str, str] | None = None,
    split: str | None = None,
    grouping: GroupingConfig | None = None,
    canaries: CanaryConfig | None = None,
    secrets: SecretsConfig | None = None,
    chat: Callable[..., tuple[str, str]] | None = None,
    out: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    allow_failed_audit: bool = False,
    override: str = LIBRARY_OVERRIDE,
) -> PreparedPartitions:
    """Load ``data``, insert canaries, split into ``k`` audited disjoint partitions, save them.

    Args:
        data: a built-in corpus name (``names2ids``, ``pycode``, ``pydocs``), a user file or
            ``datasets`` directory (:func:`~scpdr.data.corpora.load_corpus`), or a loaded
            :class:`~scpdr.data.corpora.Corpus`.
        k: number of partitions (= constituents); ``None``:
            :func:`~scpdr.data.partition.default_k` of the training records loaded.
        seed: seeds the data (built-in corpora, the validation split), the canaries (when their
            ``seed`` is ``None``) and the assignment of groups to partitions.
        n_train, n_val, val_fraction, fields, split, chat: how a corpus is loaded (see
            :func:`~scpdr.data.corpora.load_corpus`; ignored for a :class:`Corpus`;
            ``val_fraction=None``: the default carve,
            :func:`~scpdr.data.user_data.default_val_size`). A
            ``fields.group`` column keeps each data subject in one partition (and holds
            validation records out by subject); ``fields.secrets`` declares secret spans.
        grouping: near-duplicate grouping (default :class:`GroupingConfig`).
        canaries: canaries to make and insert into ``canaries.partition`` (none by default).
        secrets: more secrets: pattern matches and detected PII
            (:func:`~scpdr.data.secrets.add_secrets`, before a user file's validation carve, so
            that records sharing one are held out together); every declared secret is then
            checked by the audit (in every partition: refused; in several: a warning; in
            validation and a partition: refused).
        out: the partition directory to write (:func:`~scpdr.data.manifest.save_partitions`);
            ``None`` keeps them in memory. An existing ``out`` is refused before any work unless
            ``overwrite``.
        allow_failed_audit: let a failing audit through (recorded as ``overridden``; the ids of
            validation records that overlap the partitions go to the manifest's
            ``dataset["contaminated_validation"]``, which the attacks leave out of the
            non-members); otherwise it raises :class:`~scpdr.errors.PartitionAuditError` and
            nothing is written.
        override: how the caller's user overrides the audit, named in that error.

    The manifest records the dataset's provenance (name, seed, and for a file its resolved path,
    how the validation split was made, and how many records declare secrets).
    """
    if out is not None and Path(out).exists() and not overwrite:
        raise DataError(
            f"{out} already exists; delete it or choose another output directory; in Python, "
            "prepare_partitions(..., overwrite=True) replaces it"
        )
    corpus = (
        data
        if isinstance(data, Corpus)
        else load_corpus(
            data,
            n_train=n_train,
            n_val=n_val,
            seed=seed,
            fields=fields,
            split=split,
            val_fraction=val_fraction,
            chat=chat,
            secrets=secrets,
            grouping=grouping,
        )
    )
    train, validation = corpus.train, corpus.validation
    if isinstance(data, Corpus) and secrets is not None and secrets.active:
        train, validation = add_secrets(train, secrets), add_secrets(validation, secrets)
    mapping = fields.to_dict() if isinstance(fields, FieldMapping) else dict(fields or {})
    check_secret_field([*train, *validation], mapping.get("secrets"))
    secret_meta = {
        "records": sum(bool(r.secrets) for r in train),
        "secrets": sum(len(r.secrets) for r in train),
        "validation_records": sum(bool(r.secrets) for r in validation),
        **({"field": mapping["secrets"]} if "secrets" in mapping else {}),
        **(secrets.model_dump(mode="json") if secrets is not None and secrets.active else {}),
    }
    registry: CanaryRegistry | None = None
    if canaries is not None:
        if canaries.seed is None:
            canaries = canaries.model_copy(update={"seed": seed})
        registry = make_canaries(canaries)
    pset = partition_records(
        train,
        k=default_k(len(train)) if k is None else k,
        seed=seed,
        grouping=grouping,
        canaries=registry,
        validation=validation,
        dataset={
            "name": corpus.name,
            **{k_: v for k_, v in corpus.meta.items() if k_ != "sources"},
            **({"secrets": secret_meta} if secret_meta["records"] else {}),
            **({"group_field": mapping["group"]} if "group" in mapping else {}),
        },
    )
    report, overridden = checked_audit(
        pset, allow_failed_audit=allow_failed_audit, override=override
    )
    if report.contaminated_validation:  # forced through: the attacks leave them out
        pset.manifest.dataset[CONTAMINATED_VALIDATION] = report.contaminated_validation
    path = save_partitions(out, pset, overwrite=overwrite) if out is not None else None
    return PreparedPartitions(
        pset=pset,
        audit=report,
        overridden=overridden,
        path=path,
        k_reason=default_k_reason(len(train)) if k is None else None,
    )
