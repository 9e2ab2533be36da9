"""Partitions on disk: the manifest (what went where, with content hashes), the in-memory
:class:`PartitionSet`, and :func:`save_partitions` / :func:`load_partitions` (atomic).

Layout of a partition directory: ``manifest.json``, ``partition-<i>.jsonl``, ``validation.jsonl``
(if any) and ``canaries.json`` (if any).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scpdr.data.canaries import CanaryRegistry
from scpdr.data.grouping import GroupingConfig
from scpdr.data.records import DataError, Record, load_records, save_records
from scpdr.io import atomic_write_json, read_json

__all__ = [
    "CANARIES_NAME",
    "CONTAMINATED_VALIDATION",
    "MANIFEST_NAME",
    "VALIDATION_NAME",
    "PartitionEntry",
    "PartitionManifest",
    "PartitionSet",
    "load_partitions",
    "partition_file",
    "save_partitions",
]

MANIFEST_NAME = "manifest.json"
CANARIES_NAME = "canaries.json"
VALIDATION_NAME = "validation.jsonl"
#: The manifest's ``dataset`` key listing the validation records that a forced-through audit
#: found overlapping the partitions (:attr:`PartitionSet.clean_validation` leaves them out).
CONTAMINATED_VALIDATION = "contaminated_validation"


def partition_file(i: int) -> str:
    """The file name of partition ``i``: ``partition-<i>.jsonl``."""
    return f"partition-{i}.jsonl"


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

    @property
    def contaminated_validation(self) -> list[str]:
        """The ids of the validation records the audit found overlapping the partitions (a
        copy, a near-copy or a declared secret in the training data), recorded when the
        audit was overridden: no non-members."""
        return list(self.manifest.dataset.get(CONTAMINATED_VALIDATION) or [])

    def clean_validation(self) -> list[Record]:
        """The validation records less :attr:`contaminated_validation`: the non-members."""
        drop = set(self.contaminated_validation)
        return [r for r in self.validation if r.id not in drop]


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
            save_records(tmp / partition_file(i), part)
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
        f = path / partition_file(entry.index)
        parts.append(load_records(f) if f.is_file() and f.stat().st_size else [])
    val_path = path / VALIDATION_NAME
    validation = load_records(val_path) if val_path.is_file() else []
    can_path = path / CANARIES_NAME
    canaries = CanaryRegistry.load(can_path) if can_path.is_file() else None
    return PartitionSet(manifest=manifest, parts=parts, validation=validation, canaries=canaries)
