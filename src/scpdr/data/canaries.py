"""Canaries (Carlini et al. 2019; paper §5.1 "The canary method" and App. D.3/Table 8).

A canary is a sequence of ``k`` random words (default 3) from a fixed word list, rendered as
``"The secret words are: <w1> <w2> <w3>"`` (prompt ``"The secret words are:"``, response
``" <w1> <w2> <w3>"``). Canaries are inserted into *one* chosen partition, each repeated 1, 3 or
10 times (all copies in that partition); an equal number of never-inserted canaries of the same
format is kept as the random baseline. The exposure attack ranks a canary's likelihood among random
word sequences of the same format (drawn from the same word list).

**Membership canaries** (``CanaryConfig.members``) are the members and non-members of the
membership-inference suite (``scpdr.attacks.mia``): ``members`` canaries of ``member_words``
random words after :data:`MEMBER_PREFIX`, each inserted once, and as many drawn the same way and
never inserted — members and non-members from one distribution by construction, the audit design
of Steinke et al. 2023 ("Privacy auditing with one (1) training run"). ``member_pack`` of them
share one training record (one per line), so a hundred members cost a few dozen short training
sequences. Their prefix differs from the exposure canaries', so they do not dilute those.

The word list (:data:`WORDLIST_RESOURCE`, shipped in ``scpdr/resources``) is derived
deterministically by :func:`build_wordlist` from the lorem-ipsum word lists of the installed Faker
package (Faker 40.54.0) for 11 latin-script locales, keeping lowercase ASCII words of 3–12 letters:
8,712 distinct words.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scpdr.data.records import DataError, Record
from scpdr.io import atomic_write_json, read_json

__all__ = [
    "CANARY_PREFIX",
    "MEMBER_PREFIX",
    "WORDLIST_LOCALES",
    "WORDLIST_RESOURCE",
    "Canary",
    "CanaryConfig",
    "CanaryRegistry",
    "build_wordlist",
    "canary_text",
    "load_wordlist",
    "make_canaries",
]

#: The canary prompt; the secret follows as ``" w1 w2 ... wk"``.
CANARY_PREFIX = "The secret words are:"
#: The prompt of the membership canaries (another than :data:`CANARY_PREFIX`: the exposure
#: canaries' first word is not diluted among a hundred others).
MEMBER_PREFIX = "Secret:"
#: Resource file (under ``scpdr/resources``) holding the word list, one word per line.
WORDLIST_RESOURCE = "canary_words.txt"
#: Faker lorem locales the word list is derived from (latin script).
WORDLIST_LOCALES: tuple[str, ...] = (
    "en_US",
    "da_DK",
    "de_DE",
    "es_ES",
    "fr_FR",
    "it_IT",
    "nl_NL",
    "pl_PL",
    "cs_CZ",
    "fil_PH",
    "la",
)
_WORD = re.compile(r"[a-z]{3,12}")


def build_wordlist() -> list[str]:
    """Derive the canary word list from Faker's lorem word lists (see module docstring): the
    sorted union over :data:`WORDLIST_LOCALES` of the words matching ``[a-z]{3,12}``."""
    words: set[str] = set()
    for loc in WORDLIST_LOCALES:
        mod = importlib.import_module(f"faker.providers.lorem.{loc}")
        words.update(w for w in mod.Provider.word_list if _WORD.fullmatch(w))
    return sorted(words)


@lru_cache(maxsize=1)
def _wordlist() -> tuple[str, ...]:
    res = importlib.resources.files("scpdr").joinpath("resources", WORDLIST_RESOURCE)
    text = res.read_text(encoding="utf-8")
    return tuple(
        ln for ln in (x.strip() for x in text.splitlines()) if ln and not ln.startswith("#")
    )


def load_wordlist() -> list[str]:
    """The shipped canary word list (sorted, distinct, ≥ 5,000 words)."""
    return list(_wordlist())


def wordlist_hash(words: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(words).encode("utf-8")).hexdigest()


def canary_text(words: Sequence[str], prefix: str = CANARY_PREFIX) -> str:
    """``"The secret words are: w1 w2 w3"`` (``prefix`` + the words)."""
    return f"{prefix} {' '.join(words)}"


class CanaryConfig(BaseModel):
    """How many canaries to make and where to insert them (paper §5.1, App. D.3; STYLE.md 6).

    The one canary config: the library's, ``scpdr train``/``scpdr partition``'s options
    (``--canaries``, ``--canaries-per-rep``, ``--canary-partition``, ``--canary-words``) and an
    experiment corpus's YAML ``canaries:`` section. ``seed`` left ``None`` takes the seed of the
    data preparation (:func:`scpdr.data.pipeline.prepare_partitions`; 0 in :func:`make_canaries`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_per_repetition: int = Field(
        10, ge=1, description="Inserted canaries per repetition count (same number held out)."
    )
    repetitions: tuple[int, ...] = Field(
        (1, 3, 10), description="Repetition counts; each inserted canary is repeated this often."
    )
    num_words: int = Field(3, ge=1, le=16, description="Random words per canary (paper: 3).")
    partition: int = Field(0, ge=0, description="Index of the partition that gets every copy.")
    seed: int | None = Field(
        None, description="Seed for drawing the canary words (default: the data's seed)."
    )
    members: int = Field(
        0,
        ge=0,
        description="Membership canaries: this many inserted once each, and as many never "
        "inserted (the members and non-members of the MIA suite); 0: none.",
    )
    member_words: int = Field(2, ge=1, le=16, description="Random words per membership canary.")
    member_pack: int = Field(
        1, ge=1, le=64, description="Membership canaries per training record (one per line)."
    )

    @field_validator("repetitions")
    @classmethod
    def _positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(r < 1 for r in v):
            raise ValueError("repetitions must be a non-empty list of integers >= 1, e.g. 1,3,10")
        return v


@dataclass(frozen=True)
class Canary:
    """One canary: its id, words, repetition count (0 = held out, never inserted) and prompt."""

    id: str
    words: tuple[str, ...]
    repetitions: int
    prefix: str = CANARY_PREFIX

    @property
    def text(self) -> str:
        return canary_text(self.words, self.prefix)

    @property
    def prompt(self) -> str:
        return self.prefix

    @property
    def response(self) -> str:
        return " " + " ".join(self.words)

    @property
    def inserted(self) -> bool:
        return self.repetitions > 0

    def copies(self) -> list[Record]:
        """The training records for this canary: ``repetitions`` identical copies."""
        return [
            Record.make(id=f"{self.id}-copy{j}", prompt=self.prompt, response=self.response)
            for j in range(self.repetitions)
        ]


@dataclass(frozen=True)
class CanaryRegistry:
    """Inserted and held-out canaries plus the settings that made them; saved beside the
    partitions as ``canaries.json``. ``members`` / ``nonmembers``: the membership canaries
    (inserted once each, packed ``config.member_pack`` to a record / never inserted)."""

    config: CanaryConfig
    inserted: tuple[Canary, ...]
    held_out: tuple[Canary, ...]
    wordlist_sha256: str
    members: tuple[Canary, ...] = ()
    nonmembers: tuple[Canary, ...] = ()

    @property
    def canaries(self) -> tuple[Canary, ...]:
        return self.inserted + self.held_out

    @property
    def partition(self) -> int:
        return self.config.partition

    def records(self) -> list[Record]:
        """Every training record of the canaries (all go to :attr:`partition`): each inserted
        canary's copies, then the membership canaries packed ``member_pack`` to a record."""
        out = [r for c in self.inserted for r in c.copies()]
        pack = self.config.member_pack
        for i in range(0, len(self.members), pack):
            group = self.members[i : i + pack]
            text = "\n".join(c.text for c in group)
            out.append(Record.make(id=f"canary-members-{i // pack:04d}", text=text))
        return out

    def pins(self) -> dict[str, int]:
        """``{record id: partition}`` for every canary copy (see ``partition_records``)."""
        return {r.id: self.partition for r in self.records()}

    def by_repetition(self) -> dict[int, list[Canary]]:
        out: dict[int, list[Canary]] = {}
        for c in self.canaries:
            out.setdefault(c.repetitions, []).append(c)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": f"{CANARY_PREFIX} <w1> ... <wk>",
            "prefix": CANARY_PREFIX,
            "wordlist": {"resource": WORDLIST_RESOURCE, "sha256": self.wordlist_sha256},
            "config": self.config.model_dump(mode="json"),
            "canaries": [_canary_dict(c) for c in self.canaries],
            "member_prefix": MEMBER_PREFIX,
            "members": [_canary_dict(c) for c in self.members],
            "nonmembers": [_canary_dict(c) for c in self.nonmembers],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CanaryRegistry:
        def load(key: str, prefix: str) -> list[Canary]:
            return [
                Canary(c["id"], tuple(c["words"]), int(c["repetitions"]), prefix)
                for c in d.get(key, [])
            ]

        cs = load("canaries", d.get("prefix", CANARY_PREFIX))
        member_prefix = d.get("member_prefix", MEMBER_PREFIX)
        return cls(
            config=CanaryConfig.model_validate(d["config"]),
            inserted=tuple(c for c in cs if c.inserted),
            held_out=tuple(c for c in cs if not c.inserted),
            wordlist_sha256=d["wordlist"]["sha256"],
            members=tuple(load("members", member_prefix)),
            nonmembers=tuple(load("nonmembers", member_prefix)),
        )

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> CanaryRegistry:
        try:
            return cls.from_dict(read_json(path))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path}: not a canary registry ({exc})") from None


def _canary_dict(c: Canary) -> dict[str, Any]:
    return {"id": c.id, "words": list(c.words), "repetitions": c.repetitions, "text": c.text}


def make_canaries(
    config: CanaryConfig | None = None, *, words: Sequence[str] | None = None
) -> CanaryRegistry:
    """Draw ``n_per_repetition`` canaries for each repetition count plus as many held-out ones,
    then ``config.members`` membership canaries and as many never inserted.

    Words are drawn uniformly with replacement from ``words`` (default: :func:`load_wordlist`)
    with ``config.seed`` (0 when ``None``); all canaries are distinct. Canary ids are
    ``canary-r<reps>-<i>`` (inserted), ``canary-heldout-<i>``, ``canary-member-<i>`` and
    ``canary-nonmember-<i>``; the exposure canaries do not depend on ``members``.
    """
    config = config or CanaryConfig()
    if config.seed is None:  # the registry records the seed actually used
        config = config.model_copy(update={"seed": 0})
    words = list(words) if words is not None else load_wordlist()
    if len(set(words)) < 2:
        raise DataError("the canary word list needs at least 2 distinct words")
    rng = random.Random(f"canaries:{config.seed}")
    seen: set[tuple[str, ...]] = set()

    def draw(n_words: int = config.num_words) -> tuple[str, ...]:
        for _ in range(10_000):
            ws = tuple(rng.choice(words) for _ in range(n_words))
            if ws not in seen:
                seen.add(ws)
                return ws
        raise DataError("could not draw distinct canaries; use a longer word list or more words")

    inserted = []
    for reps in config.repetitions:
        for i in range(config.n_per_repetition):
            inserted.append(Canary(f"canary-r{reps}-{i:03d}", draw(), reps))
    n_held = len(inserted)
    held = [Canary(f"canary-heldout-{i:03d}", draw(), 0) for i in range(n_held)]
    n, w = config.members, config.member_words
    members = [Canary(f"canary-member-{i:04d}", draw(w), 1, MEMBER_PREFIX) for i in range(n)]
    non = [Canary(f"canary-nonmember-{i:04d}", draw(w), 0, MEMBER_PREFIX) for i in range(n)]
    return CanaryRegistry(
        config=config,
        inserted=tuple(inserted),
        held_out=tuple(held),
        wordlist_sha256=wordlist_hash(words),
        members=tuple(members),
        nonmembers=tuple(non),
    )
