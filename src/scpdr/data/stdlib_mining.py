"""Mining the standard library's own source for the built-in corpora ``pycode`` and ``pydocs``
(:mod:`scpdr.data.corpora`): which files (:func:`stdlib_files`), and the ``(source, prompt,
response)`` candidates of one file (:func:`file_candidates`, by the corpus's extractor).
"""

from __future__ import annotations

import ast
import inspect
import re
import sysconfig
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

__all__ = ["file_candidates", "stdlib_files"]

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
def file_candidates(
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


_EXTRACTORS: dict[str, Callable[..., tuple[str, str] | None]] = {
    "pycode": _pycode_extract,
    "pydocs": _pydocs_extract,
}
