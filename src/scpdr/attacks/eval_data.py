"""What the evaluation pipeline (:mod:`scpdr.attacks.evaluation`) attacks: the target partition's
training texts and Names2IDs records, the validation set, the canaries and their candidate space,
the membership-inference suite's members and non-members (:meth:`EvalData.mia_population`) — and
the one rule that draws a subset of them (:func:`select`).

``scpdr eval`` builds an :class:`EvalData` from a partition directory
(:meth:`EvalData.from_partitions`, the layout of ``scpdr.data.save_partitions``); every attack
stage of ``scpdr experiment`` builds it from the loaded partition set
(:meth:`EvalData.from_partition_set`), with the MIA suite's "records" members set to the targets
its reference model p0 was trained without.

Validation records are the non-members and the No CP-val chance level of every attack, so the
ones a forced-through partition audit found overlapping the training data (a copy, a near-copy
or a shared declared secret; ``PartitionSet.contaminated_validation``) are left out, with a log
line saying how many.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from scpdr.attacks.exposure import Canary, CanarySpace, random_canaries
from scpdr.attacks.pii import PIIRecord
from scpdr.attacks.secrets import SecretTarget, secret_targets
from scpdr.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["MIA_POPULATIONS", "EvalData", "MIAPopulation", "select"]

#: Where the MIA suite's members and non-members come from: "canaries" (membership canaries,
#: inserted once vs never inserted), "records" (the target partition's records vs validation
#: records), "auto" (canaries when the data has them).
MIA_POPULATIONS: tuple[str, ...] = ("auto", "canaries", "records")

T = TypeVar("T")

_PII_PROMPT = re.compile(r"^Name: (?P<name>.+), ID:$")
# The ID is the digits the model emits after the prompt (paper §5.1, "Names2IDs": names paired
# with 10-digit IDs; the PII attack reads the ID digits): a record whose response is not
# " <digits>" is no PII target.
_PII_RESPONSE = re.compile(r"^ (?P<id>\d+)$")


def select(items: Sequence[T], n: int | None, *, seed: int, salt: str) -> list[T]:
    """``n`` of ``items`` drawn uniformly at random (seeded by ``salt`` and ``seed``), kept in
    their original order; all of them when ``n`` is None or at least ``len(items)``.

    The one subset rule of every attack: the same data, ``n``, ``seed`` and ``salt`` give the
    same examples in ``scpdr eval`` and ``scpdr experiment``. ``salt`` names the use (``"pii"``,
    ``"tte-val"``, ...), so two attacks on the same list draw independently."""
    items = list(items)
    if n is None or n >= len(items):
        return items
    rng = random.Random(f"{salt}:{seed}")
    idx = sorted(rng.sample(range(len(items)), n))
    return [items[i] for i in idx]


@dataclass
class MIAPopulation:
    """The MIA suite's examples: ``members`` and ``nonmembers``; ``lira_members`` the members
    LiRA's reference never saw (None: all); ``null`` examples from the non-members' distribution
    that no model saw, attacked as if members under No CP (the suite's No CP-val rows: what the
    attacks reach without membership); ``name`` the population ("canaries" or "records")."""

    members: list[Any]
    nonmembers: list[Any]
    lira_members: list[Any] | None
    null: list[Any]
    name: str


@dataclass
class EvalData:
    """The data the attacks read. Lists may be empty: an attack without its data is skipped
    with a log line (:func:`scpdr.attacks.evaluation.run_eval`).

    Attributes:
        corpus: the corpus name in the result rows.
        train: texts of the target partition (canary copies left out): TTE's targets.
        validation: held-out texts: utility, and the No CP-val rows of TTE.
        pii / pii_val: Names2IDs records of the target partition / the validation set.
        canaries / canary_space: every canary (inserted and never-inserted, ``repetitions`` 0)
            and the space their secrets are drawn from.
        members / nonmembers: the "records" population of the MIA suite (texts or records: a
            prompted record is scored on its response given its prompt, the paper's r(y|x));
            None = ``train`` / ``validation``.
        member_canaries / nonmember_canaries: the "canaries" population: membership canaries
            inserted once / never inserted, as ``(prompt, response)`` pairs;
            ``member_space``: the space they were drawn from (fresh draws are the null).
        records: the target partition's records (canary copies left out): the prompts of the
            side-by-side generations.
        secrets / secrets_val: the declared secrets of the target partition's / the validation
            records (:mod:`scpdr.attacks.secrets`).
    """

    corpus: str = "data"
    train: list[str] = field(default_factory=list)
    validation: list[str] = field(default_factory=list)
    pii: list[PIIRecord] = field(default_factory=list)
    pii_val: list[PIIRecord] = field(default_factory=list)
    canaries: list[Canary] = field(default_factory=list)
    canary_space: CanarySpace | None = None
    members: list[Any] | None = None
    nonmembers: list[Any] | None = None
    records: list[Any] = field(default_factory=list)
    member_canaries: list[tuple[str, str]] = field(default_factory=list)
    nonmember_canaries: list[tuple[str, str]] = field(default_factory=list)
    member_space: CanarySpace | None = None
    secrets: list[SecretTarget] = field(default_factory=list)
    secrets_val: list[SecretTarget] = field(default_factory=list)

    def mia_population(
        self, kind: str = "auto", n: int | None = None, *, seed: int = 0
    ) -> MIAPopulation | None:
        """The MIA suite's examples (``n`` members and as many non-members, drawn by
        :func:`select`), or None when the data has none of ``kind``.

        "canaries": membership canaries inserted once vs never inserted — one distribution by
        construction (Steinke et al. 2023); LiRA's reference (trained without any canary) can
        use every member; the null is fresh draws of the same format. "records": the target
        partition's records vs validation records (the distributions can differ); the null is
        validation records not drawn as non-members."""
        if kind not in MIA_POPULATIONS:
            raise ConfigError(f"unknown MIA population {kind!r}; known: {list(MIA_POPULATIONS)}")
        if kind == "auto":
            kind = "canaries" if self.member_canaries and self.nonmember_canaries else "records"
        if kind == "canaries":
            if not (self.member_canaries and self.nonmember_canaries):
                return None
            mem = select(self.member_canaries, n, seed=seed, salt="mia-members")
            non = select(self.nonmember_canaries, n, seed=seed, salt="mia-non")
            null: list[Any] = []
            if self.member_space is not None:
                prefix = mem[0][0]
                drawn = random_canaries(self.member_space, prefix, len(mem), seed=seed + 7919)
                taken = {r for _, r in (*self.member_canaries, *self.nonmember_canaries)}
                null = [
                    (c.prefix, r)
                    for c in drawn
                    if (r := self.member_space.render(c.secret)) not in taken
                ]
            return MIAPopulation(mem, non, None, null, "canaries")
        pool_m = self.members if self.members is not None else self.train
        pool_n = self.nonmembers if self.nonmembers is not None else self.validation
        if not pool_m or not pool_n:
            return None
        mem = select(pool_m, n, seed=seed, salt="mia-members")
        non = select(pool_n, n, seed=seed, salt="mia-non")
        rest = [x for x in pool_n if not any(x is y for y in non)]
        null = select(rest, len(mem), seed=seed, salt="mia-null")
        from scpdr.data.user_data import warn_few_nonmembers

        warn_few_nonmembers(
            len(non),
            what=f"{self.corpus}: membership inference on {len(non)} validation records",
            fix="hold out more validation records (--n-val, --val-fraction) or raise mia_n",
        )
        return MIAPopulation(mem, non, None, null, "records")

    @staticmethod
    def pii_records(records: Sequence[Any]) -> list[PIIRecord]:
        """Names2IDs records (``prompt = "Name: <name>, ID:"``, ``response = " <digits>"``)."""
        out = []
        for r in records:
            p = _PII_PROMPT.match(getattr(r, "prompt", None) or "")
            q = _PII_RESPONSE.match(getattr(r, "response", None) or "")
            if p and q:
                out.append(PIIRecord(p["name"], q["id"]))
        return out

    @classmethod
    def from_partitions(
        cls,
        path: str | Path,
        *,
        target: int | None = None,
        corpus: str | None = None,
    ) -> EvalData:
        """Read a partition directory (``manifest.json``, ``partition-<i>.jsonl``,
        ``validation.jsonl``, ``canaries.json``); see :meth:`from_partition_set`. The corpus
        name defaults to the manifest's dataset name, else the directory's name."""
        from scpdr.data import load_partitions

        pset = load_partitions(path)
        name = corpus or str(pset.manifest.dataset.get("name") or Path(path).name)
        return cls.from_partition_set(pset, target=target, corpus=name, where=str(path))

    @classmethod
    def of_records(
        cls, records: Sequence[Any], validation: Sequence[Any], *, partition: int, corpus: str
    ) -> EvalData:
        """The data of the training ``records`` of ``partition`` against ``validation`` (records
        no constituent saw): their texts, IDs (Names2IDs) and declared secrets, and the MIA
        suite's "records" population (members ``records``, non-members ``validation``)."""
        return cls(
            corpus=corpus,
            train=[r.text for r in records],
            validation=[r.text for r in validation],
            pii=cls.pii_records(records),
            pii_val=cls.pii_records(validation),
            members=list(records),
            nonmembers=list(validation),
            records=list(records),
            secrets=secret_targets(records, partition=partition),
            secrets_val=secret_targets(validation),
        )

    @classmethod
    def from_partition_set(
        cls, pset: Any, *, target: int | None = None, corpus: str, where: str = "the partitions"
    ) -> EvalData:
        """The data of a loaded ``scpdr.data.PartitionSet``. ``target``: the partition whose
        constituent (``constituent <target>``, the No CP model when 0) is attacked — default the
        canaries' partition, else 0. Canary copies are left out of the training texts; the MIA
        suite's "records" members are the target partition's records, its non-members the
        validation records (less those the audit found overlapping the training data); its
        "canaries" population is the membership canaries."""
        from scpdr.data.canaries import load_wordlist, wordlist_hash

        reg = pset.canaries
        if target is None:
            target = reg.partition if reg is not None else 0
        if not 0 <= target < pset.k:
            raise ConfigError(f"target partition {target} does not exist (k = {pset.k})")
        canary_ids = {r.id for r in reg.records()} if reg is not None else set()
        part = [r for r in pset.parts[target] if r.id not in canary_ids]
        validation = pset.clean_validation()
        if len(validation) < len(pset.validation):
            logger.warning(
                "%s: left %d of %d validation records out of the non-members: the partition "
                "audit found them overlapping the training data (copies, near-copies or shared "
                "secrets; the manifest's dataset.contaminated_validation)",
                where,
                len(pset.validation) - len(validation),
                len(pset.validation),
            )
        data = cls.of_records(part, validation, partition=target, corpus=corpus)
        if reg is not None:
            words = load_wordlist()
            if wordlist_hash(words) != reg.wordlist_sha256:
                raise ConfigError(
                    f"{where}: the canaries were drawn from another word list than the installed "
                    "one; exposure needs the original list (re-create the partitions)"
                )
            data.canary_space = CanarySpace(tuple(words), n_words=reg.config.num_words)
            data.canaries = [Canary(c.prompt, tuple(c.words), c.repetitions) for c in reg.canaries]
            data.member_canaries = [(c.prompt, c.response) for c in reg.members]
            data.nonmember_canaries = [(c.prompt, c.response) for c in reg.nonmembers]
            if reg.members:
                data.member_space = CanarySpace(tuple(words), n_words=reg.config.member_words)
        return data
