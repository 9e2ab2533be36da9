"""Data: records and loaders, built-in corpora, canaries, disjoint partitions and their audit.

Data flow (``shared/DESIGN.md``): dataset → canaries inserted → K disjoint partitions (+ manifest,
audited) → one constituent trained per partition (:mod:`scpdr.train`). See ``docs/data.md``.
"""

from __future__ import annotations

from scpdr.data.canaries import (
    CANARY_PREFIX,
    Canary,
    CanaryConfig,
    CanaryRegistry,
    canary_text,
    load_wordlist,
    make_canaries,
)
from scpdr.data.corpora import (
    CORPORA,
    Corpus,
    build_corpus,
    load_corpus,
    names2ids,
    pycode,
    pydocs,
)
from scpdr.data.partition import (
    AuditReport,
    GroupingConfig,
    Overlap,
    PartitionManifest,
    PartitionSet,
    audit_dir,
    audit_partitions,
    group_near_duplicates,
    load_partitions,
    partition_records,
    save_partitions,
)
from scpdr.data.records import DataError, Record, content_hash, load_records, save_records

__all__ = [
    "CANARY_PREFIX",
    "CORPORA",
    "AuditReport",
    "Canary",
    "CanaryConfig",
    "CanaryRegistry",
    "Corpus",
    "DataError",
    "GroupingConfig",
    "Overlap",
    "PartitionManifest",
    "PartitionSet",
    "Record",
    "audit_dir",
    "audit_partitions",
    "build_corpus",
    "canary_text",
    "content_hash",
    "group_near_duplicates",
    "load_corpus",
    "load_partitions",
    "load_records",
    "load_wordlist",
    "make_canaries",
    "names2ids",
    "partition_records",
    "pycode",
    "pydocs",
    "save_partitions",
    "save_records",
]
