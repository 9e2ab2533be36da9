"""Secrets: the spans of a record that must not come out of the served model.

A record's secrets are substrings of its text (:attr:`Record.secrets
<scpdr.data.records.Record.secrets>`), declared three ways (:class:`SecretsConfig`):

- a column of the file (``--secrets-field NAME``: a list of substrings of the record);
- regular expressions (``--secret-pattern REGEX``, repeatable): every match in a record's text;
- optionally detected PII (``--detect-pii``): the pattern recognizers of Microsoft Presidio
  (emails, phone numbers, credit cards, IBANs, ...; optional: ``pip install
  presidio-analyzer``).

Secrets travel with the partitions (``partition-<i>.jsonl``), never into a deployable bundle
(``scpdr export``). The NAF guarantee protects a secret only if it is absent from at least one
constituent's data (paper Def. 2.1, Theorems 2.1/2.2 and 4.1), so the partition audit
(:mod:`scpdr.data.audit`) looks for every declared secret in every partition's texts
(:func:`secret_occurrences`) — naming records, never the secret.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scpdr.data.formats import DataError
from scpdr.data.records import Record

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_SECRET_CHARS",
    "PII_ENTITIES",
    "SecretOccurrence",
    "SecretsConfig",
    "add_secrets",
    "check_secret_field",
    "detect_pii",
    "secret_index",
    "secret_occurrences",
]

#: Shorter secrets are ignored (with a warning): two characters occur everywhere.
MIN_SECRET_CHARS = 3
#: The Presidio entities ``--detect-pii`` looks for by default (pattern recognizers: no NLP model).
PII_ENTITIES: tuple[str, ...] = (
    "EMAIL_ADDRESS",
    "PHONE_NUMBER",
    "CREDIT_CARD",
    "IBAN_CODE",
    "IP_ADDRESS",
    "US_SSN",
)


class SecretsConfig(BaseModel):
    """How secrets are found besides the secrets column (recorded in the partition manifest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patterns: tuple[str, ...] = Field(
        (),
        description="Regular expression whose matches in a record are secret (repeatable).",
    )
    detect_pii: bool = Field(
        False,
        description="Also mark PII found by Presidio's pattern recognizers as secret "
        "(pip install presidio-analyzer).",
    )
    pii_entities: tuple[str, ...] = Field(
        PII_ENTITIES, description="Presidio entities --detect-pii looks for."
    )

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            try:
                rx = re.compile(p)
            except re.error as exc:
                raise ValueError(f"{p!r} is not a regular expression ({exc})") from None
            if rx.match(""):
                raise ValueError(f"{p!r} matches the empty string")
        return v

    @property
    def active(self) -> bool:
        return bool(self.patterns or self.detect_pii)


def detect_pii(texts: Sequence[str], entities: Sequence[str] = PII_ENTITIES) -> list[list[str]]:
    """PII spans of each text found by Presidio's *pattern* recognizers (no spaCy model is loaded
    or downloaded: the recognizers are called without NLP artifacts; nothing is fetched from the
    internet: tldextract's bundled public suffix list validates email domains).

    Raises :class:`ImportError` with the install hint when Presidio is not installed."""
    try:
        import tldextract.tldextract as tld
        from presidio_analyzer.predefined_recognizers import (
            CreditCardRecognizer,
            EmailRecognizer,
            IbanRecognizer,
            IpRecognizer,
            PhoneRecognizer,
            UsSsnRecognizer,
        )
    except ImportError as exc:
        raise ImportError(
            "--detect-pii needs Microsoft Presidio's analyzer: pip install presidio-analyzer "
            "(no spaCy model is needed); or declare secrets with --secrets-field / "
            "--secret-pattern"
        ) from exc
    # The email recognizer validates domains with tldextract, whose default extractor fetches
    # the public suffix list from the internet on first use: use its bundled snapshot instead.
    if getattr(tld.TLD_EXTRACTOR, "suffix_list_urls", ()) != ():
        tld.TLD_EXTRACTOR = tld.TLDExtract(suffix_list_urls=())
    recognizers = [
        r()
        for r in (
            EmailRecognizer,
            PhoneRecognizer,
            CreditCardRecognizer,
            IbanRecognizer,
            IpRecognizer,
            UsSsnRecognizer,
        )
    ]
    wanted = set(entities)
    out = []
    for text in texts:
        spans = []
        for rec in recognizers:
            ents = [e for e in rec.supported_entities if e in wanted]
            if ents:
                spans += [(r.start, r.end) for r in rec.analyze(text, ents, nlp_artifacts=None)]
        out.append([text[a:b] for a, b in sorted(set(spans))])
    return out


def add_secrets(records: Sequence[Record], config: SecretsConfig | None) -> list[Record]:
    """``records`` with the matches of ``config``'s patterns (and detected PII) added to their
    secrets; secrets shorter than :data:`MIN_SECRET_CHARS` are dropped with a warning naming
    the records."""
    config = config or SecretsConfig()
    rxs = [re.compile(p) for p in config.patterns]
    detected = None
    if config.detect_pii:
        detected = detect_pii([r.text for r in records], config.pii_entities)
    out, short = [], []
    for i, r in enumerate(records):
        found = list(r.secrets)
        for rx in rxs:
            found += [m.group(0) for m in rx.finditer(r.text) if m.group(0)]
        if detected is not None:
            found += detected[i]
        kept = [x for x in found if len(x) >= MIN_SECRET_CHARS]
        if len(kept) < len(found):
            short.append(r.id)
        if tuple(kept) != r.secrets:
            r = Record.make(
                id=r.id,
                prompt=r.prompt,
                response=r.response,
                text=r.text,
                secrets=kept,
                group=r.group,
            )
        out.append(r)
    if short:
        logger.warning(
            "%d record(s) had secrets shorter than %d characters (ignored): %s",
            len(short),
            MIN_SECRET_CHARS,
            ", ".join(short[:10]) + (" ..." if len(short) > 10 else ""),
        )
    return out


@dataclass(frozen=True)
class SecretOccurrence:
    """Where one declared secret occurs: ``owner`` and ``index`` name it (the ``index``-th
    secret of record ``owner``; the secret itself is never stored here), ``records`` maps each
    partition to the ids of its records whose text contains it."""

    owner: str
    index: int
    records: dict[int, list[str]]

    @property
    def partitions(self) -> list[int]:
        return sorted(self.records)

    def describe(self) -> str:
        where = "; ".join(
            f"partition {p}: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"
            for p, ids in sorted(self.records.items())
        )
        return f"secret {self.index + 1} of record {self.owner!r} is in {where}"

    def to_dict(self) -> dict[str, object]:
        return {
            "record": self.owner,
            "secret": self.index + 1,
            "partitions": {str(p): len(ids) for p, ids in sorted(self.records.items())},
            "records": {str(p): ids for p, ids in sorted(self.records.items())},
        }


def _finder(secrets: Iterable[str]):
    """A function text -> the secrets (of ``secrets``) that occur in it: a dictionary of the
    secrets' first :data:`MIN_SECRET_CHARS` characters, probed at every position of the text."""
    by_head: dict[str, list[str]] = {}
    for s in secrets:
        by_head.setdefault(s[:MIN_SECRET_CHARS], []).append(s)
    n = MIN_SECRET_CHARS

    def find(text: str) -> set[str]:
        hits = set()
        for i in range(len(text) - n + 1):
            cands = by_head.get(text[i : i + n])
            if cands:
                hits.update(s for s in cands if text.startswith(s, i))
        return hits

    return find


def secret_index(records: Sequence[Record]) -> dict[str, list[int]]:
    """``{secret: indices of the records whose text contains it}`` for every declared secret of
    ``records`` (declared there or only mentioned: one email in two unrelated records)."""
    secrets = dict.fromkeys(s for r in records for s in r.secrets)
    if not secrets:
        return {}
    find = _finder(secrets)
    out: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        for s in find(r.text) | set(r.secrets):
            out.setdefault(s, []).append(i)
    return out


def secret_occurrences(parts: Sequence[Sequence[Record]]) -> list[SecretOccurrence]:
    """Every declared secret of ``parts`` (one list of records per partition) with the records,
    by partition, whose text contains it — declared there or not (one email in two unrelated
    records) — for the secrets that occur in more than one partition."""
    owner: dict[str, tuple[str, int]] = {}
    for part in parts:
        for r in part:
            for j, s in enumerate(r.secrets):
                owner.setdefault(s, (r.id, j))
    if not owner:
        return []
    find = _finder(owner)
    where: dict[str, dict[int, list[str]]] = {}
    for p, part in enumerate(parts):
        for r in part:
            for s in find(r.text) | set(r.secrets):
                where.setdefault(s, {}).setdefault(p, []).append(r.id)
    out = [SecretOccurrence(*owner[s], records=dict(ps)) for s, ps in where.items() if len(ps) > 1]
    return sorted(out, key=lambda o: (-len(o.records), o.owner, o.index))


def check_secret_field(records: Sequence[Record], column: str | None) -> None:
    """Raise :class:`DataError` when ``--secrets-field`` was given and no record declares a
    secret (a misspelt column would otherwise measure nothing)."""
    if column is not None and not any(r.secrets for r in records):
        raise DataError(
            f"--secrets-field {column}: no record has secrets in column {column!r}; check the "
            "column name (a list of substrings of each record)"
        )
