"""Near-duplicate grouping: records whose texts are near-duplicates must share a partition.

The NAF guarantee (paper Def. 2.1, Theorems 2.1/2.2 and 4.1) protects an example only if it is
absent from the training data of at least one constituent; a paraphrased copy in another
partition would let every constituent learn it. Texts are compared by character
``shingle_size``-grams of the normalized text (lowercased, whitespace collapsed): MinHash
signatures and LSH (datasketch) find candidate pairs, each verified by its *exact* shingle Jaccard
``>= threshold``; exact duplicates (same content hash) are always paired; groups are the connected
components (union-find). LSH can miss a pair whose Jaccard is close to the threshold (a false
negative); pairs well above it are found with overwhelming probability.

:func:`record_groups` is the one grouping of *records* that the partitions and the validation
carve share: near-duplicates, joined by data subject (``Record.group``) and by declared secret.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from scpdr.data.records import Record
from scpdr.data.secrets import secret_index
from scpdr.errors import ConfigError

__all__ = [
    "GroupingConfig",
    "group_near_duplicates",
    "jaccard",
    "join_by_secret",
    "merge_groups",
    "near_duplicate_pairs",
    "record_groups",
    "shingles",
]


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


def near_duplicate_pairs(
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
    for i, j, _ in near_duplicate_pairs(texts, grouping):
        uf.union(i, j)
    groups: dict[int, list[int]] = {}
    for i in range(len(texts)):
        groups.setdefault(uf.find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def merge_groups(groups: Sequence[Sequence[int]], labels: Sequence[str | None]) -> list[list[int]]:
    """``groups`` (lists of indices) with every two groups that hold indices of the same label
    merged: near-duplicate groups joined by data subject (``labels[i]``: record ``i``'s group,
    None for none). Same ordering as :func:`group_near_duplicates`."""
    n = len(labels)
    uf = _UnionFind(n)
    for g in groups:
        for i in g[1:]:
            uf.union(g[0], i)
    first: dict[str, int] = {}
    for i, label in enumerate(labels):
        if label is not None:
            uf.union(first.setdefault(label, i), i)
    merged: dict[int, list[int]] = {}
    for i in range(n):
        merged.setdefault(uf.find(i), []).append(i)
    return sorted(merged.values(), key=lambda g: g[0])


def join_by_secret(
    groups: list[list[int]],
    records: Sequence[Record],
    *,
    limit: int | None = None,
    pins: Mapping[int, int] | None = None,
) -> list[list[int]]:
    """``groups`` (lists of indices into ``records``) with the groups of records that share a
    declared secret joined — declared there or only mentioned (one email in two unrelated
    records) — rarest secrets first. With ``limit``, a join is skipped when the joined group
    would exceed ``limit`` records; with ``pins`` (``{index: partition}``), when it would hold
    records pinned to two partitions. Same ordering as :func:`group_near_duplicates`."""
    index = secret_index(records)
    if not index:
        return groups
    pins = pins or {}
    owner = {i: g for g, members in enumerate(groups) for i in members}
    parent = list(range(len(groups)))
    size = [len(g) for g in groups]
    pin: list[set[int]] = [{pins[i] for i in g if i in pins} for g in groups]

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for _, where in sorted(index.items(), key=lambda kv: (len(kv[1]), kv[0])):
        roots = sorted({find(owner[i]) for i in where})
        if len(roots) < 2:
            continue
        pinned = set().union(*(pin[r] for r in roots))
        if (limit is not None and sum(size[r] for r in roots) > limit) or len(pinned) > 1:
            continue
        for r in roots[1:]:
            parent[r] = roots[0]
            size[roots[0]] += size[r]
            pin[roots[0]] |= pin[r]
    merged: dict[int, list[int]] = {}
    for g, members in enumerate(groups):
        merged.setdefault(find(g), []).extend(members)
    return sorted((sorted(m) for m in merged.values()), key=lambda g: g[0])


def record_groups(
    records: Sequence[Record],
    grouping: GroupingConfig | None = None,
    *,
    secrets: bool = True,
    secret_limit: int | None = None,
    pins: Mapping[int, int] | None = None,
) -> list[list[int]]:
    """The groups of ``records`` (lists of indices) that must stay together: near-duplicate
    texts (:func:`group_near_duplicates`), joined by data subject (:attr:`Record.group`,
    ``--group-field``) and — when ``secrets`` — by shared declared secret
    (:func:`join_by_secret`, with its ``secret_limit`` and ``pins``). The partitions
    (:func:`scpdr.data.partition.partition_records`) and the validation carve
    (:func:`scpdr.data.user_data.split_validation`) deal out these groups whole."""
    groups = group_near_duplicates([r.text for r in records], grouping=grouping)
    if any(r.group is not None for r in records):  # a data subject's records stay together
        groups = merge_groups(groups, [r.group for r in records])
    if secrets:
        groups = join_by_secret(groups, records, limit=secret_limit, pins=pins)
    return groups
