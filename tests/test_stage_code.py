"""The stage cache's code versions (``scpdr.experiment.cache.STAGE_CODE``): every listed name is
a real module or package whose files are all hashed, and a stage kind lists every scpdr package
its code imports, so that a change to that code re-runs the stage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scpdr.experiment.cache import CODE_SUFFIXES, STAGE_CODE, code_files, module_files

SRC = Path(__file__).resolve().parents[1] / "src"

#: Where each stage kind's code starts (the modules its stage body in ``scpdr.experiment.stages``
#: / ``stages_eval`` imports).
ENTRIES = {
    "partitions": ["scpdr.data.pipeline"],
    "train": ["scpdr.training", "scpdr.tiny"],
    "bundle": ["scpdr.models"],
    "attack": ["scpdr.attacks.evaluation"],
    "bounds": ["scpdr.attacks.evaluation", "scpdr.attacks.bounds_analysis"],
    "report": ["scpdr.report"],
}
#: Imported by everything, changing no result: left out of every hash.
NOT_HASHED = {"scpdr", "scpdr.errors", "scpdr.io"}


def _path(module: str) -> Path | None:
    base = SRC.joinpath(*module.split("."))
    for p in (base / "__init__.py", base.with_suffix(".py")):
        if p.is_file():
            return p
    return None


def _imports(module: str) -> set[str]:
    """The scpdr modules ``module`` imports (lazy imports too), as the longest existing name."""
    path = _path(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            while parts and _path(".".join(parts)) is None:
                parts.pop()
            if parts and parts[0] == "scpdr":
                found.add(".".join(parts))
    return found


def _closure(starts: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        mod = todo.pop()
        if mod in seen or mod in NOT_HASHED:
            continue
        seen.add(mod)
        todo += _imports(mod)
    return seen


def _covered(module: str, listed: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in listed)


@pytest.mark.parametrize("kind", sorted(STAGE_CODE))
def test_every_listed_name_exists(kind):
    missing = [name for name in STAGE_CODE[kind] if not module_files(name)]
    assert not missing, f"stage kind {kind!r} hashes names that are no module: {missing}"


PACKAGES = sorted(
    {n for names in STAGE_CODE.values() for n in names if SRC.joinpath(*n.split(".")).is_dir()}
)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_hashes_all_its_files(package):
    root = SRC.joinpath(*package.split("."))
    want = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
    )
    assert [p.resolve() for p in module_files(package)] == [p.resolve() for p in want]
    assert any(p.suffix == ".py" for p in want) or package == "scpdr.resources"


def test_kernel_sources_are_part_of_the_code():
    names = {p.name for p in module_files("scpdr.kernels")}
    assert {"scp_delta_r.c", "cp_fuse.c", "packed_gemm.c", "fast_math.h", "build.py"} <= names


@pytest.mark.parametrize("kind", sorted(ENTRIES))
def test_a_stage_kind_hashes_every_package_its_code_imports(kind):
    assert set(ENTRIES) == set(STAGE_CODE)
    uncovered = sorted(m for m in _closure(ENTRIES[kind]) if not _covered(m, STAGE_CODE[kind]))
    assert not uncovered, f"stage kind {kind!r} runs code its hash leaves out: {uncovered}"
    assert code_files(kind)
