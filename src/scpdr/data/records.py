"""Training records and loaders for user data (JSONL, CSV, Parquet, ``datasets`` dirs; chat
records in the OpenAI ``messages`` format, :mod:`scpdr.data.chat`).

A :class:`Record` is one training example ``{id, prompt, response, text}``, optionally with its
declared ``secrets`` (substrings of ``text``: what the secret-extraction attack tries to recover,
:mod:`scpdr.data.secrets`) and its ``group`` (the data subject, e.g. a customer: all records of
a group share a partition). ``text`` is what a
constituent is fine-tuned on; ``prompt``/``response`` are what the extraction attacks use (the PII
and TTE attacks of paper §5.1 query a *prefix* of a training example). When both are given and
``text`` is not, ``text = prompt + response`` (no separator token is inserted, see
``docs/training.md``). Records with only ``text`` (and an optional ``id``) are valid too.

Loaders accept a field mapping (our field name → the column in the file), report the file and line
number of the first bad row, and refuse duplicate ids: the partition manifest and its audit
(:mod:`scpdr.data.partition`) identify examples by id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scpdr.data.formats import DataError, iter_rows, read_jsonl
from scpdr.io import atomic_write

logger = logging.getLogger(__name__)

__all__ = [
    "FIELDS",
    "MAPPED_FIELDS",
    "DataError",
    "FieldMapping",
    "Record",
    "content_hash",
    "load_records",
    "read_jsonl",
    "records_hash",
    "save_records",
]

#: The fields of a record, in the order they are written (``secrets`` and ``group`` follow when
#: a record has them).
FIELDS: tuple[str, ...] = ("id", "prompt", "response", "text")
#: Every field a file's column can be mapped to (:class:`FieldMapping`).
MAPPED_FIELDS: tuple[str, ...] = (*FIELDS, "messages", "secrets", "group")


@dataclass(frozen=True)
class Record:
    """One training example.

    Attributes:
        id: unique within a dataset; partitions, manifests and audits refer to examples by id.
        text: the string a constituent is trained on.
        prompt: the example's prefix (e.g. ``"Name: Ada Lovelace, ID:"``), or ``None`` for
            text-only records.
        response: the continuation after ``prompt`` (e.g. ``" 0123456789"``), or ``None``.
        secrets: substrings of ``text`` that are secret (an email, an account number), in the
            order they first occur; what the secret-extraction attack queries
            (:mod:`scpdr.attacks.secrets`) and the partition audit checks.
        group: the data subject the record belongs to (a customer, a patient): every record of a
            group goes to the same partition; ``None`` for a record of its own.
    """

    id: str
    text: str
    prompt: str | None = None
    response: str | None = None
    secrets: tuple[str, ...] = ()
    group: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise DataError(f"record id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str) or not self.text:
            raise DataError(f"record {self.id!r}: text must be a non-empty string")
        if (self.prompt is None) != (self.response is None):
            raise DataError(
                f"record {self.id!r}: give both prompt and response, or neither (text-only record)"
            )
        if not isinstance(self.secrets, tuple) or not all(
            isinstance(x, str) and x for x in self.secrets
        ):
            raise DataError(f"record {self.id!r}: secrets must be a tuple of non-empty strings")
        missing = sum(x not in self.text for x in self.secrets)
        if missing:  # never the secret itself in a message
            raise DataError(
                f"record {self.id!r}: {missing} of its {len(self.secrets)} secrets do not occur "
                "in its text; a secret is a substring of the record"
            )

    @classmethod
    def make(
        cls,
        *,
        id: str,
        prompt: str | None = None,
        response: str | None = None,
        text: str | None = None,
        secrets: Iterable[str] = (),
        group: str | None = None,
    ) -> Record:
        """Build a record; ``text`` defaults to ``prompt + response``; ``secrets`` are kept in
        the order they first occur in the text, duplicates dropped."""
        if text is None:
            if prompt is None or response is None:
                raise DataError(
                    f"record {id!r}: needs either 'text' or both 'prompt' and 'response'"
                )
            text = prompt + response
        uniq = list(dict.fromkeys(secrets))
        found = {x: text.find(x) for x in uniq}
        ordered = tuple(sorted(uniq, key=lambda x: (found[x] < 0, found[x])))
        return cls(id=id, text=text, prompt=prompt, response=response, secrets=ordered, group=group)

    @property
    def hash(self) -> str:
        """Content hash of :attr:`text` (see :func:`content_hash`)."""
        return content_hash(self.text)

    def to_dict(self) -> dict[str, Any]:
        """``{id, prompt, response, text}``, plus ``secrets`` and ``group`` when set."""
        d: dict[str, Any] = {k: getattr(self, k) for k in FIELDS}
        if self.secrets:
            d["secrets"] = list(self.secrets)
        if self.group is not None:
            d["group"] = self.group
        return d


def content_hash(text: str) -> str:
    """SHA-256 (hex) of ``text`` encoded as UTF-8: the exact-duplicate key used by the audit."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def records_hash(records: Iterable[Record]) -> str:
    """SHA-256 over the records' ids and content hashes, in order (identifies a dataset)."""
    h = hashlib.sha256()
    for r in records:
        h.update(r.id.encode("utf-8"))
        h.update(b"\0")
        h.update(r.hash.encode("ascii"))
        h.update(b"\n")
    return h.hexdigest()


class FieldMapping(BaseModel):
    """Which column of a user's file holds each record field (unset: the field's own name).

    The one field mapping: :func:`load_records`' ``fields``, ``scpdr train``/``scpdr partition``'s
    ``--text-field``/``--prompt-field``/``--response-field``/``--id-field``, and an experiment
    corpus's YAML ``fields:`` section.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | None = Field(None, min_length=1, description="Column with the text to train on.")
    prompt: str | None = Field(
        None, min_length=1, description="Column with the prompt (the text is prompt + response)."
    )
    response: str | None = Field(
        None, min_length=1, description="Column with the response that follows the prompt."
    )
    id: str | None = Field(
        None,
        min_length=1,
        description="Column with a unique record id (default: <file stem>-<row>).",
    )
    messages: str | None = Field(
        None,
        min_length=1,
        description="Column with OpenAI chat messages, trained with the model's chat template "
        "(default: messages).",
    )
    secrets: str | None = Field(
        None,
        min_length=1,
        description="Column with the record's secrets: a list of substrings of the record "
        "(default: secrets).",
    )
    group: str | None = Field(
        None,
        min_length=1,
        description="Column naming the data subject (a customer, a patient): its records share "
        "a partition (default: group).",
    )

    def to_dict(self) -> dict[str, str]:
        """``{our field: column}`` for the fields that are set."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _resolve_mapping(fields: Mapping[str, str] | FieldMapping | None) -> dict[str, str]:
    if isinstance(fields, FieldMapping):
        fields = fields.to_dict()
    mapping = {f: f for f in MAPPED_FIELDS}
    for ours, theirs in (fields or {}).items():
        if ours not in MAPPED_FIELDS:
            raise DataError(
                f"unknown record field {ours!r} in the field mapping; use one of "
                f"{list(MAPPED_FIELDS)}"
            )
        mapping[ours] = theirs
    return mapping


_STRING_FIELDS = ("id", "prompt", "response", "text", "group")


def _secret_list(v: Any, where: str, column: str) -> list[str]:
    """A secrets cell as a list: a list of strings, a JSON list in a string (CSV), or one
    string (one secret)."""
    if v is None:
        return []
    if isinstance(v, str) and v.lstrip().startswith("["):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise DataError(f"{where}: field {column!r} is not a JSON list of strings") from None
    if isinstance(v, (str, int)) and not isinstance(v, bool):
        return [str(v)]
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, (str, int)) and not isinstance(x, bool) for x in v
    ):
        return [str(x) for x in v if str(x)]
    raise DataError(f"{where}: field {column!r} must be a list of strings (the record's secrets)")


def _row_to_record(
    row: Mapping[str, Any],
    *,
    mapping: Mapping[str, str],
    default_id: str,
    where: str,
    chat: Callable[..., tuple[str, str]] | None = None,
    dropped: list[str] | None = None,
) -> Record:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    values: dict[str, str | None] = {}
    for ours in _STRING_FIELDS:
        theirs = mapping[ours]
        v = row.get(theirs)
        if v is None or (isinstance(v, str) and v == "" and ours in ("id", "group")):
            values[ours] = None
        elif isinstance(v, (str, int)) and not isinstance(v, bool):
            values[ours] = str(v)
        else:
            raise DataError(f"{where}: field {theirs!r} must be a string, got {type(v).__name__}")
    messages = row.get(mapping["messages"])
    if values["text"] is None and values["prompt"] is None and messages is not None:
        if chat is None:
            from scpdr.data.chat import ChatTemplate

            chat = ChatTemplate()
        values["prompt"], values["response"] = chat(messages, where=where)
    if values["text"] is None and (values["prompt"] is None or values["response"] is None):
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(
            f"{where}: a record needs a {mapping['text']!r} field, both {mapping['prompt']!r} "
            f"and {mapping['response']!r}, or chat {mapping['messages']!r}; found fields "
            f"{present}. If the columns are named differently, map them (--text-field COLUMN, "
            "--prompt-field COLUMN --response-field COLUMN, or --messages-field COLUMN; in "
            "Python fields={'text': COLUMN})."
        )
    secrets = _secret_list(row.get(mapping["secrets"]), where, mapping["secrets"])
    text = values["text"] or f"{values['prompt']}{values['response']}"
    absent = [x for x in secrets if x not in text]
    if absent and dropped is not None:
        dropped.append(values["id"] or default_id)
    try:
        return Record.make(
            id=values["id"] or default_id,
            prompt=values["prompt"],
            response=values["response"],
            text=values["text"],
            secrets=[x for x in secrets if x in text],
            group=values["group"],
        )
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def _check_unique(records: Sequence[Record], wheres: Sequence[str]) -> None:
    seen: dict[str, str] = {}
    for r, where in zip(records, wheres, strict=True):
        if r.id in seen:
            raise DataError(
                f"{where}: duplicate id {r.id!r} (first seen at {seen[r.id]}); ids must be unique"
            )
        seen[r.id] = where


def load_records(
    path: str | os.PathLike[str],
    *,
    fields: Mapping[str, str] | FieldMapping | None = None,
    split: str | None = None,
    chat: Callable[..., tuple[str, str]] | None = None,
) -> list[Record]:
    """Load records from a ``.jsonl``/``.json`` (one object per line), ``.csv``, ``.parquet``
    file, or a directory written by ``datasets``' ``save_to_disk``.

    Args:
        path: the file or directory.
        fields: maps our field names (``id``, ``prompt``, ``response``, ``text``, ``messages``,
            ``secrets``, ``group``) to the file's column names, e.g. ``{"prompt": "question",
            "response": "answer"}`` (or a :class:`FieldMapping`).
        split: for a saved ``DatasetDict``, which split to read (default ``"train"``).
        chat: renders chat records (``messages``) as ``(prompt, response)``; default
            :class:`~scpdr.data.chat.ChatTemplate` of the embedded model (``scpdr train``
            passes its base model's).

    Missing ids default to ``"<file stem>-<row index>"``. A declared secret that does not occur
    in its record's text is dropped with a warning naming the record (never the secret). Raises
    :class:`DataError` naming the file and line (or row) of the first bad record, and on
    duplicate ids.
    """
    path = Path(path)
    mapping = _resolve_mapping(fields)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    records: list[Record] = []
    wheres: list[str] = []
    dropped: list[str] = []
    stem = path.name if path.is_dir() else path.stem
    for i, (where, row) in enumerate(iter_rows(path, split=split)):
        records.append(
            _row_to_record(
                row,
                mapping=mapping,
                default_id=f"{stem}-{i}",
                where=where,
                chat=chat,
                dropped=dropped,
            )
        )
        wheres.append(where)
    if not records:
        raise DataError(f"{path}: no records found")
    if dropped:
        logger.warning(
            "%s: %d record(s) declare secrets that do not occur in their text (dropped; a "
            "secret is a substring of the record): %s",
            path,
            len(dropped),
            ", ".join(dropped[:10]) + (" ..." if len(dropped) > 10 else ""),
        )
    _check_unique(records, wheres)
    return records


def save_records(path: str | os.PathLike[str], records: Iterable[Record]) -> Path:
    """Write records as JSONL (atomically); :func:`load_records` reads them back unchanged."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")

    return atomic_write(path, write)
