"""The file formats user data comes in: JSONL, CSV, Parquet, and a ``datasets`` directory.

:func:`iter_rows` yields ``(where, row)`` for every row of a file (``where`` names the file and
the line or row, for error messages); :func:`saved_splits` lists the splits of a directory written
by ``datasets``' ``save_to_disk`` (a ``validation`` split there is used as the validation set
instead of carving one, :mod:`scpdr.data.user_data`).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from scpdr.errors import ScpdrError

__all__ = ["FORMATS", "DataError", "iter_rows", "read_jsonl", "saved_splits"]

#: File suffixes read as records, by format.
FORMATS: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "csv": (".csv",),
    "parquet": (".parquet", ".pq"),
}


class DataError(ScpdrError, ValueError):
    """A data file or record is malformed; the message names the file, the line and the fix
    (also ``scpdr.data.records.DataError``)."""


def _error(msg: str) -> DataError:
    return DataError(msg)


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
                raise _error(
                    f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}); each line "
                    f"of a .jsonl file must be one JSON object"
                ) from None


def _csv_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise _error(f"{path}: empty CSV file; the first line must be a header")
        try:
            for row in reader:
                # the reader's line_num is the physical line where this row ended
                where = f"{path}:{reader.line_num}"
                if None in row:
                    raise _error(
                        f"{where}: more values than header columns ({len(reader.fieldnames)})"
                    )
                yield where, {k: (v if v != "" else None) for k, v in row.items()}
        except csv.Error as exc:
            raise _error(f"{path}:{reader.line_num}: malformed CSV ({exc})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow comes with datasets
        from scpdr.errors import missing_dependency

        raise missing_dependency("pyarrow") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) and OSError subclasses
        raise _error(f"{path}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} (row {i})", row


def saved_splits(path: Path) -> list[str] | None:
    """The split names of a ``datasets`` ``DatasetDict`` saved at ``path``; None for a single
    ``Dataset`` (or a directory ``datasets`` did not write)."""
    dd = path / "dataset_dict.json"
    if not dd.is_file():
        return None
    try:
        return list(json.loads(dd.read_text(encoding="utf-8")).get("splits", []))
    except (json.JSONDecodeError, AttributeError):
        return None


def _hf_rows(path: Path, *, split: str | None) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        from scpdr.errors import missing_dependency

        raise missing_dependency("datasets") from exc
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise _error(
            f"{path}: not a dataset directory written by datasets' save_to_disk ({exc})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise _error(f"{path}: no split {name!r}; available splits: {sorted(ds)}")
        ds = ds[name]
    elif split is not None:
        raise _error(f"{path}: is a single Dataset, not a DatasetDict; drop split={split!r}")
    for i, row in enumerate(ds):
        yield f"{path} (row {i})", row


def iter_rows(path: Path, *, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a ``.jsonl``/``.json``/``.ndjson``, ``.csv``,
    ``.parquet`` file or a ``datasets`` directory (``split``: which split of a saved
    ``DatasetDict``, default ``"train"``). CSV cells that are empty read as None."""
    if path.is_dir():
        yield from _hf_rows(path, split=split)
        return
    suffix = path.suffix.lower()  # split applies to a datasets directory only
    if suffix in FORMATS["jsonl"]:
        for lineno, obj in read_jsonl(path):
            yield f"{path}:{lineno}", obj
    elif suffix in FORMATS["csv"]:
        yield from _csv_rows(path)
    elif suffix in FORMATS["parquet"]:
        yield from _parquet_rows(path)
    else:
        raise _error(
            f"{path}: unsupported data file type {path.suffix!r}; use .jsonl, .csv, .parquet, "
            "or a directory saved with datasets' save_to_disk"
        )
