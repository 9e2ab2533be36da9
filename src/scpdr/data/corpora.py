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

import ast
import inspect
import logging
import os
import random
import re
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from scpdr.data.records import DataError, FieldMapping, Record
from scpdr.data.user_data import load_user_split

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

# Parts of the stdlib that are tests, demos, vendored code or GUI tooling, not library code.
_EXCLUDED_PARTS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "pydoc_data",
        "__pycache__",
        "tkinter",
        "venv",
    }
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


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests, demos, GUI and vendored code excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in _EXCLUDED_PARTS or part.startswith("config-") for part in rel.parts):
            continue
        out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _module_name(path: Path) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _iter_defs(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]]:
    """Yield ``(qualname, node)`` for top-level functions/classes and methods of classes."""
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = f"{prefix}{node.name}"
            yield qual, node
            if isinstance(node, ast.ClassDef):
                yield from _iter_defs(node, prefix=f"{qual}.")


def _public(qualname: str) -> bool:
    return not any(part.startswith("_") for part in qualname.split("."))


@lru_cache(maxsize=8192)
def _file_candidates(
    path: str, name: str, params: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, str, str], ...]:
    """``(source, prompt, response)`` candidates of one stdlib file (cached: parsing dominates)."""
    tree = _parse(Path(path))
    if tree is None:
        return ()
    extract = _EXTRACTORS[name]
    module = _module_name(Path(path))
    out = []
    for qual, node in [("", tree), *_iter_defs(tree)]:
        if not _public(qual):
            continue
        got = extract(module, qual, node, **dict(params))
        if got is not None:
            out.append((f"{module}.{qual}" if qual else module, *got))
    return tuple(out)


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


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
            for c in _file_candidates(str(path), name, params)
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
    records = []
    for i, (_src, prompt, response) in enumerate(pairs[:n]):
        split, idx = ("train", i) if i < n_train else ("val", i - n_train)
        records.append(
            Record.make(id=f"{name}-{split}-{idx:06d}", prompt=prompt, response=response)
        )
    return Corpus(
        name=name,
        train=records[:n_train],
        validation=records[n_train:],
        meta={"seed": seed, "source": "python-stdlib", "sources": [s for s, _, _ in pairs[:n]]},
    )


_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _first_sentence(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    para = " ".join(para.split())
    m = _SENTENCE_END.search(para)
    return para[: m.start()] if m else para


def _strip_docstring(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
) -> ast.FunctionDef | ast.AsyncFunctionDef:
    import copy

    node = copy.deepcopy(node)
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    node.body = body
    return node


def _pycode_extract(
    module: str, qual: str, node: ast.AST, *, max_chars: int
) -> tuple[str, str] | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    instruction = _first_sentence(doc)
    if not 20 <= len(instruction) <= 300 or ">>>" in instruction:
        return None
    stripped = _strip_docstring(node)
    if len(stripped.body) < 2:  # trivial one-liners (e.g. `return self._x`) teach nothing
        return None
    try:
        code = ast.unparse(stripped)
    except Exception:  # pragma: no cover - unparse handles everything parse produced
        return None
    if len(code) > max_chars:
        return None
    return f"Instruction: {instruction}\nCode:\n", code


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


def _signature(node: ast.AST) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"({ast.unparse(node.args)})"
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = ast.unparse(item.args)
                args = re.sub(r"^self(, )?", "", args)
                return f"({args})"
    return ""


def _prose(doc: str, *, max_chars: int) -> str:
    """The docstring's prose: paragraphs up to the first doctest, capped at ``max_chars`` on a
    paragraph (or, for a single long paragraph, sentence) boundary."""
    paras = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        if ">>>" in para:
            break
        para = para.strip()
        if para:
            paras.append(para)
    out = ""
    for para in paras:
        candidate = f"{out}\n\n{para}" if out else para
        if len(candidate) > max_chars:
            if not out:  # one long paragraph: cut at the last sentence end that fits
                cut = para[:max_chars]
                ends = [m.start() for m in _SENTENCE_END.finditer(cut)]
                out = cut[: ends[-1]] if ends else ""
            break
        out = candidate
    return out


def _pydocs_extract(
    module: str, qual: str, node: ast.AST, *, min_chars: int, max_chars: int
) -> tuple[str, str] | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    prose = _prose(doc, max_chars=max_chars)
    if len(prose) < min_chars:
        return None
    title = f"{module}.{qual}{_signature(node)}" if qual else f"module {module}"
    return f"Title: {title}\nAbstract:", f" {prose}"


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


_EXTRACTORS: dict[str, Callable[..., tuple[str, str] | None]] = {
    "pycode": _pycode_extract,
    "pydocs": _pydocs_extract,
}

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
    val_fraction: float = 0.0,
    chat: Callable[..., tuple[str, str]] | None = None,
) -> Corpus:
    """A built-in corpus by name (sizes default to the builder's) or a user file/directory
    (:func:`~scpdr.data.records.load_records`; ``chat`` renders chat records).

    For a user file, a seeded random ``n_val`` records (or ``val_fraction`` of them) are held out
    for validation — whole data subjects (``group``) at a time — and a seeded random ``n_train``
    of the rest (all by default) are the training records, kept in file order; fewer than
    ``n_train`` left is a logged warning. A ``datasets`` directory's ``validation`` split is used
    when ``n_val`` is not given (:func:`~scpdr.data.user_data.load_user_split`).
    """
    name = os.fspath(source)
    if name in CORPORA:
        sizes = {k: v for k, v in (("n_train", n_train), ("n_val", n_val)) if v is not None}
        return CORPORA[name](seed=seed, **sizes)
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
