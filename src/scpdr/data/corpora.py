"""Built-in corpora, generated offline and deterministically (seeded), each with train/validation.

These stand in for the paper's hub datasets (§5.1: MathAbstracts, CodeInstructions, StoryTelling
and the synthetic Names2IDs), which cannot be fetched here:

- ``names2ids`` — the paper's Names2IDs: synthetic PII ``"Name: <full name>, ID: <10 digits>"``.
  The prompt is ``"Name: <full name>, ID:"`` and the response ``" <10 digits>"``, so the PII attack
  prompt of §5.1 is exactly a training prefix. Names come from Faker across several latin-script
  locales; names and IDs are unique across train and validation.
- ``pycode`` — the analog of CodeInstructions: instruction → Python function, mined with :mod:`ast`
  from the standard library's own source (first docstring sentence as the instruction, the function
  without its docstring as the response).
- ``pydocs`` — the analog of MathAbstracts (title → abstract): a qualified name and signature →
  the docstring's prose (at least ``min_chars`` characters) from the standard library.

The stdlib miners visit the library's files in a seeded order and stop once enough examples are
collected, so small corpora are fast; the same seed on the same Python version gives the same
corpus.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scpdr.data.grouping import GroupingConfig
from scpdr.data.records import DataError, FieldMapping, Record
from scpdr.data.secrets import SecretsConfig, add_secrets
from scpdr.data.stdlib_mining import file_candidates, stdlib_files
from scpdr.data.user_data import load_user_split, split_validation

logger = logging.getLogger(__name__)

__all__ = [
    "CORPORA",
    "NAMES2IDS_LOCALES",
    "Corpus",
    "build_corpus",
    "load_corpus",
    "names2ids",
    "pycode",
    "pydocs",
    "stdlib_files",
]

#: Latin-script Faker locales used for Names2IDs (the byte-level BPE tokenizer handles diacritics).
NAMES2IDS_LOCALES: tuple[str, ...] = (
    "en_US",
    "en_GB",
    "de_DE",
    "fr_FR",
    "es_ES",
    "it_IT",
    "nl_NL",
    "pt_BR",
    "pl_PL",
    "sv_SE",
)


@dataclass(frozen=True)
class Corpus:
    """A named dataset with a train and a validation split (validation is never partitioned)."""

    name: str
    train: list[Record]
    validation: list[Record]
    meta: dict[str, Any] = field(default_factory=dict)


def _check_sizes(n_train: int, n_val: int) -> None:
    if n_train < 1 or n_val < 0:
        raise DataError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")


# --------------------------------------------------------------------------------- names2ids


def names2ids(*, n_train: int = 6000, n_val: int = 500, seed: int = 0) -> Corpus:
    """Names2IDs (paper §5.1): ``"Name: <full name>, ID: <10 digits>"``, unique names and IDs.

    Each name comes from a locale drawn uniformly from :data:`NAMES2IDS_LOCALES`; each Faker
    instance is seeded from ``seed`` (no global random state is used).
    """
    _check_sizes(n_train, n_val)
    from faker import Faker

    rng = random.Random(f"names2ids:{seed}")
    fakers = []
    for i, loc in enumerate(NAMES2IDS_LOCALES):
        fk = Faker(loc)
        fk.seed_instance(seed * 1000 + i)
        fakers.append(fk)
    n = n_train + n_val
    names: list[str] = []
    seen_names: set[str] = set()
    ids: set[str] = set()
    records: list[Record] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 50 * n + 1000:  # pragma: no cover - Faker has far more names than this
            raise DataError(f"could not generate {n} unique names; lower n_train/n_val")
        fk = fakers[rng.randrange(len(fakers))]
        name = f"{fk.first_name()} {fk.last_name()}"
        if name in seen_names:
            continue
        digits = f"{rng.randrange(10**10):010d}"
        if digits in ids:
            continue
        seen_names.add(name)
        ids.add(digits)
        names.append(name)
        split = "train" if len(records) < n_train else "val"
        idx = len(records) if split == "train" else len(records) - n_train
        records.append(
            Record.make(
                id=f"names2ids-{split}-{idx:06d}",
                prompt=f"Name: {name}, ID:",
                response=f" {digits}",
            )
        )
    return Corpus(
        name="names2ids",
        train=records[:n_train],
        validation=records[n_train:],
        meta={"seed": seed, "locales": list(NAMES2IDS_LOCALES), "source": "Faker"},
    )


# --------------------------------------------------------------------------------- stdlib miners


def _mine(
    name: str,
    params: tuple[tuple[str, int], ...],
    *,
    n_train: int,
    n_val: int,
    seed: int,
    max_per_module: int,
) -> Corpus:
    """Visit stdlib files in a seeded order; the extractor ``_EXTRACTORS[name](module, qualname,
    node, **params)`` gives (prompt, response) or None. Takes at most ``max_per_module`` examples per file (for diversity) until the
    whole library has been visited, dedupes prompts and responses, and stops at
    ``n_train + n_val`` examples."""
    _check_sizes(n_train, n_val)
    rng = random.Random(f"{name}:{seed}")
    files = stdlib_files()
    rng.shuffle(files)
    n = n_train + n_val
    pairs: list[tuple[str, str, str]] = []  # (source, prompt, response)
    seen_prompts: set[str] = set()
    seen_responses: set[str] = set()
    leftovers: list[tuple[str, str, str]] = []

    def take(candidates: list[tuple[str, str, str]]) -> None:
        for src, prompt, response in candidates:
            if len(pairs) >= n or prompt in seen_prompts or response in seen_responses:
                continue
            seen_prompts.add(prompt)
            seen_responses.add(response)
            pairs.append((src, prompt, response))

    for path in files:
        found = [
            c
            for c in file_candidates(str(path), name, params)
            if c[1] not in seen_prompts and c[2] not in seen_responses
        ]
        rng.shuffle(found)
        leftovers.extend(found[max_per_module:])
        take(found[:max_per_module])
        if len(pairs) >= n:
            break
    if len(pairs) < n:  # the whole library visited: lift the per-module cap
        take(leftovers)
    if len(pairs) < n:
        raise DataError(
            f"{name}: only {len(pairs)} examples found in the standard library, "
            f"{n} requested; lower n_train/n_val"
        )
    rng.shuffle(pairs)
    # validation: whole near-duplicate groups (a stdlib function and its near-copy elsewhere
    # are both training or both validation: a non-member has no near-copy among the members)
    drawn = [Record.make(id=str(i), prompt=p, response=r) for i, (_, p, r) in enumerate(pairs[:n])]
    train, val = split_validation(drawn, n_val=n_val, seed=seed) if n_val else (drawn, [])
    if len(val) != n_val:
        raise DataError(f"{name}: near-duplicate groups leave {len(val)} of {n_val} validation")
    named = {
        split: [
            Record.make(id=f"{name}-{split}-{j:06d}", prompt=r.prompt, response=r.response)
            for j, r in enumerate(part)
        ]
        for split, part in (("train", train), ("val", val))
    }
    return Corpus(
        name=name,
        train=named["train"],
        validation=named["val"],
        meta={
            "seed": seed,
            "source": "python-stdlib",
            "sources": [pairs[int(r.id)][0] for r in (*train, *val)],
        },
    )


def pycode(
    *, n_train: int = 1800, n_val: int = 200, seed: int = 0, max_chars: int = 1500
) -> Corpus:
    """Instruction → Python function from the stdlib (analog of CodeInstructions, §5.1).

    Prompt ``"Instruction: <first docstring sentence>\\nCode:\\n"``, response the function's
    source (``ast.unparse``, docstring removed) of at most ``max_chars`` characters. The 3.11 stdlib
    yields about 2,000 such examples.
    """
    return _mine(
        "pycode",
        (("max_chars", max_chars),),
        n_train=n_train,
        n_val=n_val,
        seed=seed,
        max_per_module=8,
    )


def pydocs(
    *,
    n_train: int = 900,
    n_val: int = 100,
    seed: int = 0,
    min_chars: int = 300,
    max_chars: int = 2000,
) -> Corpus:
    """Technical title → abstract from the stdlib (analog of MathAbstracts, §5.1).

    Prompt ``"Title: <module.qualname(signature)>\\nAbstract:"``, response ``" <docstring prose>"``
    of ``min_chars``–``max_chars`` characters (doctests dropped); module docstrings are titled
    ``"module <name>"``. The 3.11 stdlib yields about 1,000 such examples.
    """
    return _mine(
        "pydocs",
        (("min_chars", min_chars), ("max_chars", max_chars)),
        n_train=n_train,
        n_val=n_val,
        seed=seed,
        max_per_module=8,
    )


#: Registry of built-in corpora: name → builder(*, n_train, n_val, seed) (STYLE.md 5).
CORPORA: dict[str, Callable[..., Corpus]] = {
    "names2ids": names2ids,
    "pycode": pycode,
    "pydocs": pydocs,
}


def load_corpus(
    source: str | os.PathLike[str],
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    fields: Mapping[str, str] | FieldMapping | None = None,
    split: str | None = None,
    val_fraction: float | None = 0.0,
    chat: Callable[..., tuple[str, str]] | None = None,
    secrets: SecretsConfig | None = None,
    grouping: GroupingConfig | None = None,
) -> Corpus:
    """A built-in corpus by name (sizes default to the builder's) or a user file/directory
    (:func:`~scpdr.data.records.load_records`; ``chat`` renders chat records).

    For a user file, a seeded random ``n_val`` records (or ``val_fraction`` of them) are held out
    for validation — whole data subjects (``group``) at a time — and a seeded random ``n_train``
    of the rest (all by default) are the training records, kept in file order; fewer than
    ``n_train`` left is a logged warning. A ``datasets`` directory's ``validation`` split is used
    when ``n_val`` is not given (:func:`~scpdr.data.user_data.load_user_split`). The carve
    holds out whole near-duplicate groups (``grouping``), data subjects and records sharing a
    declared secret; ``secrets`` (patterns, detected PII) are added to every record first.
    """
    name = os.fspath(source)
    if name in CORPORA:
        sizes = {k: v for k, v in (("n_train", n_train), ("n_val", n_val)) if v is not None}
        corpus = CORPORA[name](seed=seed, **sizes)
        if secrets is not None and secrets.active:
            corpus = replace(
                corpus,
                train=add_secrets(corpus.train, secrets),
                validation=add_secrets(corpus.validation, secrets),
            )
        return corpus
    path = Path(name)
    if not path.exists():
        raise DataError(
            f"{name!r} is neither a built-in corpus ({', '.join(sorted(CORPORA))}) nor an "
            f"existing file or directory"
        )
    train, val, meta = load_user_split(
        path,
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
    return Corpus(name=path.stem, train=train, validation=val, meta=meta)


def build_corpus(name: str, *, n_train: int, n_val: int, seed: int = 0, **kwargs: Any) -> Corpus:
    """Build the built-in corpus ``name`` (see :data:`CORPORA`)."""
    try:
        builder = CORPORA[name]
    except KeyError:
        raise DataError(
            f"unknown corpus {name!r}; built-in corpora are {sorted(CORPORA)}, or pass a "
            f".jsonl/.csv file or a datasets directory"
        ) from None
    return builder(n_train=n_train, n_val=n_val, seed=seed, **kwargs)
