"""Data: records and loaders, built-in corpora, canaries, disjoint partitions and their audit.

Data flow (``shared/DESIGN.md``): dataset (+ declared secrets, groups, a validation split) →
canaries inserted → K disjoint partitions (+ manifest, audited: near-duplicates, groups, secrets) → one constituent trained per partition (:mod:`scpdr.training`); one function does the
data part, :func:`prepare_partitions`. See ``docs/data.md``.
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
from scpdr.data.chat import ChatTemplate
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
    DEFAULT_K,
    AuditReport,
    GroupingConfig,
    Overlap,
    PartitionManifest,
    PartitionSet,
    audit_dir,
    audit_partitions,
    default_k,
    default_k_reason,
    group_near_duplicates,
    load_partitions,
    partition_records,
    save_partitions,
)
from scpdr.data.pipeline import (
    PreparedPartitions,
    audit_for_bundle,
    prepare_partitions,
)
from scpdr.data.records import (
    DataError,
    FieldMapping,
    Record,
    content_hash,
    load_records,
    save_records,
)
from scpdr.data.secrets import SecretOccurrence, SecretsConfig, add_secrets, secret_occurrences
from scpdr.data.user_data import DEFAULT_VAL_FRACTION, split_validation

__all__ = [
    "CANARY_PREFIX",
    "CORPORA",
    "DEFAULT_K",
    "DEFAULT_VAL_FRACTION",
    "AuditReport",
    "Canary",
    "CanaryConfig",
    "CanaryRegistry",
    "ChatTemplate",
    "Corpus",
    "DataError",
    "FieldMapping",
    "GroupingConfig",
    "Overlap",
    "PartitionManifest",
    "PartitionSet",
    "PreparedPartitions",
    "Record",
    "SecretOccurrence",
    "SecretsConfig",
    "add_secrets",
    "audit_dir",
    "audit_for_bundle",
    "audit_partitions",
    "build_corpus",
    "canary_text",
    "content_hash",
    "default_k",
    "default_k_reason",
    "group_near_duplicates",
    "load_corpus",
    "load_partitions",
    "load_records",
    "load_wordlist",
    "make_canaries",
    "names2ids",
    "partition_records",
    "prepare_partitions",
    "pycode",
    "pydocs",
    "save_partitions",
    "save_records",
    "secret_occurrences",
    "split_validation",
]
