"""Atomic file writes: a reader never sees a half-written file (write to a temp file, then rename)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` then atomically rename ``tmp_path`` onto ``path``.

    An :class:`OSError` (permission denied, disk full, ``path`` is a directory, ...) names
    ``path``, not the hidden temp file; the original is its ``__cause__``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _naming_target(exc, path, None) from exc
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        os.replace(tmp_path, path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise _naming_target(exc, path, tmp_path) from exc
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def _naming_target(exc: OSError, path: Path, tmp: Path | None) -> OSError:
    """``exc`` told about ``path`` instead of the temp file (same errno, so the same subclass:
    ``OSError(errno, ...)`` gives PermissionError, IsADirectoryError, ...)."""
    if exc.errno is not None and exc.strerror:
        return OSError(exc.errno, exc.strerror, str(path))
    msg = str(exc)
    if tmp is not None:
        msg = msg.replace(str(tmp), str(path))
    try:
        return type(exc)(f"cannot write {path}: {msg}")
    except TypeError:  # a subclass with its own constructor
        return OSError(f"cannot write {path}: {msg}")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
