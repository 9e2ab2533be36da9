"""Training records and loaders for user data (JSONL, CSV, ``datasets.load_from_disk`` dirs).

A :class:`Record` is one training example ``{id, prompt, response, text}``. ``text`` is what a
constituent is fine-tuned on; ``prompt``/``response`` are what the extraction attacks use (the PII
and TTE attacks of paper §5.1 query a *prefix* of a training example). When both are given and
``text`` is not, ``text = prompt + response`` (no separator token is inserted, see
``docs/training.md``). Records with only ``text`` (and an optional ``id``) are valid too.

Loaders accept a field mapping (our field name → the column in the file), report the file and line
number of the first bad row, and refuse duplicate ids: the partition manifest and its audit
(:mod:`scpdr.data.partition`) identify examples by id.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scpdr.errors import ScpdrError
from scpdr.io import atomic_write

__all__ = [
    "FIELDS",
    "DataError",
    "FieldMapping",
    "Record",
    "content_hash",
    "load_records",
    "read_jsonl",
    "records_hash",
    "save_records",
]

#: The fields of a record, in the order they are written.
FIELDS: tuple[str, ...] = ("id", "prompt", "response", "text")


class DataError(ScpdrError, ValueError):
    """A data file or record is malformed; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Record:
    """One training example.

    Attributes:
        id: unique within a dataset; partitions, manifests and audits refer to examples by id.
        text: the string a constituent is trained on.
        prompt: the example's prefix (e.g. ``"Name: Ada Lovelace, ID:"``), or ``None`` for
            text-only records.
        response: the continuation after ``prompt`` (e.g. ``" 0123456789"``), or ``None``.
    """

    id: str
    text: str
    prompt: str | None = None
    response: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise DataError(f"record id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str) or not self.text:
            raise DataError(f"record {self.id!r}: text must be a non-empty string")
        if (self.prompt is None) != (self.response is None):
            raise DataError(
                f"record {self.id!r}: give both prompt and response, or neither (text-only record)"
            )

    @classmethod
    def make(
        cls,
        *,
        id: str,
        prompt: str | None = None,
        response: str | None = None,
        text: str | None = None,
    ) -> Record:
        """Build a record; ``text`` defaults to ``prompt + response``."""
        if text is None:
            if prompt is None or response is None:
                raise DataError(
                    f"record {id!r}: needs either 'text' or both 'prompt' and 'response'"
                )
            text = prompt + response
        return cls(id=id, text=text, prompt=prompt, response=response)

    @property
    def hash(self) -> str:
        """Content hash of :attr:`text` (see :func:`content_hash`)."""
        return content_hash(self.text)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in FIELDS}


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

    def to_dict(self) -> dict[str, str]:
        """``{our field: column}`` for the fields that are set."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


def _resolve_mapping(fields: Mapping[str, str] | FieldMapping | None) -> dict[str, str]:
    if isinstance(fields, FieldMapping):
        fields = fields.to_dict()
    mapping = {f: f for f in FIELDS}
    for ours, theirs in (fields or {}).items():
        if ours not in FIELDS:
            raise DataError(
                f"unknown record field {ours!r} in the field mapping; use one of {list(FIELDS)}"
            )
        mapping[ours] = theirs
    return mapping


def _row_to_record(
    row: Mapping[str, Any], *, mapping: Mapping[str, str], default_id: str, where: str
) -> Record:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    values: dict[str, str | None] = {}
    for ours, theirs in mapping.items():
        v = row.get(theirs)
        if v is None or (isinstance(v, str) and v == "" and ours == "id"):
            values[ours] = None
        elif isinstance(v, (str, int)) and not isinstance(v, bool):
            values[ours] = str(v)
        else:
            raise DataError(f"{where}: field {theirs!r} must be a string, got {type(v).__name__}")
    if values["text"] is None and (values["prompt"] is None or values["response"] is None):
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(
            f"{where}: a record needs a {mapping['text']!r} field, or both {mapping['prompt']!r} "
            f"and {mapping['response']!r}; found fields {present}. If the columns are named "
            f"differently, map them (--text-field COLUMN, or --prompt-field COLUMN "
            f"--response-field COLUMN; in Python fields={{'text': COLUMN}})."
        )
    try:
        return Record.make(
            id=values["id"] or default_id,
            prompt=values["prompt"],
            response=values["response"],
            text=values["text"],
        )
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, parsed_object)`` for each non-blank line; bad JSON → DataError."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}); each line "
                    f"of a .jsonl file must be one JSON object"
                ) from None


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
) -> list[Record]:
    """Load records from a ``.jsonl``/``.json`` (one object per line), ``.csv``, or a directory
    written by ``datasets``' ``save_to_disk``.

    Args:
        path: the file or directory.
        fields: maps our field names (``id``, ``prompt``, ``response``, ``text``) to the file's
            column names, e.g. ``{"prompt": "question", "response": "answer"}`` (or a
            :class:`FieldMapping`).
        split: for a saved ``DatasetDict``, which split to read (default ``"train"``).

    Missing ids default to ``"<file stem>-<row index>"``. Raises :class:`DataError` naming the
    file and line (or row) of the first bad record, and on duplicate ids.
    """
    path = Path(path)
    mapping = _resolve_mapping(fields)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    records: list[Record] = []
    wheres: list[str] = []
    if path.is_dir():
        for i, row in enumerate(_iter_hf_rows(path, split=split)):
            where = f"{path} (row {i})"
            records.append(
                _row_to_record(row, mapping=mapping, default_id=f"{path.name}-{i}", where=where)
            )
            wheres.append(where)
    elif path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for i, (lineno, obj) in enumerate(read_jsonl(path)):
            where = f"{path}:{lineno}"
            records.append(
                _row_to_record(obj, mapping=mapping, default_id=f"{path.stem}-{i}", where=where)
            )
            wheres.append(where)
    elif path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise DataError(f"{path}: empty CSV file; the first line must be a header")
            try:
                for i, row in enumerate(reader):
                    # the reader's line_num is the physical line where this row ended
                    where = f"{path}:{reader.line_num}"
                    if None in row:
                        raise DataError(
                            f"{where}: more values than header columns ({len(reader.fieldnames)})"
                        )
                    clean = {k: (v if v != "" else None) for k, v in row.items()}
                    records.append(
                        _row_to_record(
                            clean, mapping=mapping, default_id=f"{path.stem}-{i}", where=where
                        )
                    )
                    wheres.append(where)
            except csv.Error as exc:
                raise DataError(f"{path}:{reader.line_num}: malformed CSV ({exc})") from None
    else:
        raise DataError(
            f"{path}: unsupported data file type {path.suffix!r}; use .jsonl, .csv, or a "
            f"directory saved with datasets' save_to_disk"
        )
    if not records:
        raise DataError(f"{path}: no records found")
    _check_unique(records, wheres)
    return records


def _iter_hf_rows(path: Path, *, split: str | None) -> Iterator[Mapping[str, Any]]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        from scpdr.errors import missing_dependency

        raise missing_dependency("datasets") from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataError(
            f"{path}: not a dataset directory written by datasets' save_to_disk ({exc})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise DataError(f"{path}: no split {name!r}; available splits: {sorted(ds)}")
        ds = ds[name]
    elif split is not None:
        raise DataError(f"{path}: is a single Dataset, not a DatasetDict; drop split={split!r}")
    yield from ds


def save_records(path: str | os.PathLike[str], records: Iterable[Record]) -> Path:
    """Write records as JSONL (atomically); :func:`load_records` reads them back unchanged."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")

    return atomic_write(path, write)
