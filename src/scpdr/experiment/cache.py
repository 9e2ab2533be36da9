"""The content-addressed stage cache of ``scpdr experiment``.

Every stage writes its outputs into ``OUT/stages/<name>/<hash16>/``, where ``hash`` is the SHA-256
of the stage's inputs: its config section, the hashes of the stages it depends on and the version
of the code it runs (:func:`code_version`: the source of the scpdr modules it calls, plus a
per-kind version number). A stage is *done* once its marker file ``_stage.json`` is written; the
marker is written last, into a ``<hash16>.partial`` working dir that is then renamed into place,
so an interrupted run never leaves a half stage that looks finished, and the next run continues in
the same working dir (the trainer resumes from its last checkpoint there).

:class:`StageCache` owns that protocol (:meth:`StageCache.run`), so any executor — the local one of
:mod:`scpdr.experiment.run`, or one running stages in other processes over a shared filesystem —
writes the same layout. :func:`run_lock` keeps two runs out of one ``OUT``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from scpdr.errors import ScpdrError
from scpdr.experiment.peak import sampled_peak
from scpdr.io import atomic_write_json, read_json

if TYPE_CHECKING:  # pragma: no cover
    from scpdr.experiment.config import ExperimentConfig

__all__ = [
    "MARKER",
    "STAGE_CODE",
    "STAGE_VERSIONS",
    "Stage",
    "StageCache",
    "StageContext",
    "StageOutcome",
    "code_files",
    "code_version",
    "module_files",
    "run_lock",
]

logger = logging.getLogger(__name__)

STAGE_VERSIONS: dict[str, int] = {
    "partitions": 2,  # 2: the data stage merged in (scpdr.data.prepare_partitions)
    "train": 1,
    "bundle": 1,
    "attack": 1,
    "bounds": 1,
    "report": 1,
}
"""Bumped when the orchestration of a stage kind changes (part of every stage hash)."""

_EVAL_CODE = (
    "scpdr.attacks",
    "scpdr.methods",
    "scpdr.runtime",
    "scpdr.lora",
    "scpdr.kernels",
    "scpdr.naf",
    "scpdr.bounds",
    "scpdr.models",
    "scpdr.data",
    "scpdr.device",
)
STAGE_CODE: dict[str, tuple[str, ...]] = {
    # scpdr.data renders chat records with a model's template (data/chat.py loads a tokenizer)
    "partitions": (
        "scpdr.data",
        "scpdr.resources",
        "scpdr.models",
        "scpdr.methods",
        "scpdr.naf",
        "scpdr.kernels",
    ),
    "train": (
        "scpdr.training",
        "scpdr.models",
        "scpdr.tiny",
        "scpdr.data",
        "scpdr.methods",
        "scpdr.naf",
        "scpdr.kernels",
        "scpdr.device",
    ),
    "bundle": ("scpdr.models", "scpdr.methods", "scpdr.naf", "scpdr.kernels"),
    "attack": _EVAL_CODE,
    "bounds": _EVAL_CODE,
    "report": ("scpdr.report", "scpdr.attacks", "scpdr.methods"),
}
"""Modules and packages whose source is part of a stage kind's hash (the "code version"): every
scpdr module the stage's code imports, directly or not (``tests/test_stage_code.py`` checks the
table against the imports), except ``scpdr.errors`` and ``scpdr.io``. A package counts with all
its files (:func:`code_files`)."""

#: File kinds of a package that are part of its code: Python, the C kernels and their header,
#: resource text.
CODE_SUFFIXES = (".py", ".c", ".h", ".txt")

MARKER = "_stage.json"
HASH_LEN = 16


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def module_files(module: str) -> list[Path]:
    """The files of ``module``: a module's source file, or every file of a package (its
    subpackages too) with a suffix of :data:`CODE_SUFFIXES`; ``[]`` when it does not exist."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        files: list[Path] = []
        for loc in spec.submodule_search_locations:
            files += [
                p
                for p in Path(loc).rglob("*")
                if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
            ]
        return sorted(files)
    return [Path(spec.origin)] if spec.origin and spec.origin != "built-in" else []


def code_files(kind: str) -> list[Path]:
    """The files whose contents are part of stage kind ``kind``'s code version."""
    return [f for mod in STAGE_CODE.get(kind, ()) for f in module_files(mod)]


_CODE_CACHE: dict[str, str] = {}


def code_version(kind: str) -> str:
    """Hash of the source of the modules a stage kind runs, plus its version number."""
    if kind not in _CODE_CACHE:
        from scpdr import __version__

        h = hashlib.sha256(f"{__version__}:{kind}:{STAGE_VERSIONS[kind]}".encode())
        for f in code_files(kind):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        _CODE_CACHE[kind] = h.hexdigest()
    return _CODE_CACHE[kind]


@dataclasses.dataclass
class StageContext:
    """What a stage function gets: its working dir, its dependencies' output dirs, the config,
    and ``memo``: objects the stages run by one executor in one process share (loaded models);
    never part of a result."""

    stage: Stage
    dir: Path
    deps: dict[str, Path]
    config: ExperimentConfig
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def dep(self, role: str) -> Path:
        return self.deps[role]


@dataclasses.dataclass(eq=False)
class Stage:
    """One cached unit of work. ``hash`` covers name, inputs, dependency hashes and code.

    ``run`` is a module-level function of :mod:`scpdr.experiment.stages` (picklable, so an
    executor may run the stage in another process)."""

    name: str
    kind: str
    inputs: dict[str, Any]
    run: Callable[[StageContext], None]
    deps: dict[str, Stage] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    hash: str = ""

    def __post_init__(self) -> None:
        self.rehash()

    def rehash(self) -> None:
        """Recompute :attr:`hash` (after its ``inputs`` changed)."""
        payload = {
            "name": self.name,
            "kind": self.kind,
            "inputs": self.inputs,
            "deps": {role: d.hash for role, d in sorted(self.deps.items())},
            "code": code_version(self.kind),
        }
        self.hash = hashlib.sha256(_canonical(payload).encode()).hexdigest()

    @property
    def label(self) -> str:
        """The name, plus the sweep point (``[m=100]``) for a stage only a sweep runs: sweep points
        share the main run's stage names, and the display and ``--force`` tell them apart by this."""
        return self.meta.get("label", self.name)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.hash[:HASH_LEN]}"


@dataclasses.dataclass
class StageOutcome:
    name: str
    hash: str
    status: Literal["ran", "cached"]
    seconds: float
    dir: Path
    peak_mib: float | None = None  # the resident set's sampled peak while it ran (ran only)


class StageCache:
    """The stage dirs under ``out/stages``: ``<name>/<hash16>/`` (done: holds ``_stage.json``) and
    ``<name>/<hash16>.partial/`` (in progress; kept across interruptions so the next run resumes
    in it)."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)

    def stage_dir(self, stage: Stage) -> Path:
        return self.out / "stages" / stage.name / stage.hash[:HASH_LEN]

    def is_done(self, stage: Stage) -> bool:
        marker = self.stage_dir(stage) / MARKER
        if not marker.is_file():
            return False
        try:
            return read_json(marker).get("hash") == stage.hash
        except (OSError, ValueError):
            return False

    def run(
        self,
        stage: Stage,
        config: ExperimentConfig,
        *,
        force: bool = False,
        memo: dict[Any, Any] | None = None,
        on_start: Callable[[Stage], None] | None = None,
    ) -> StageOutcome:
        """Run ``stage`` unless it is done (or ``force``): in its ``.partial`` dir, marker last
        (with the seconds it took and the resident set's sampled peak while it ran,
        :mod:`scpdr.experiment.peak`), then renamed into place. Its dependencies must be done.
        ``on_start`` is called when it actually runs."""
        final = self.stage_dir(stage)
        if not force and self.is_done(stage):
            return StageOutcome(stage.name, stage.hash, "cached", 0.0, final)
        for role, d in stage.deps.items():
            if not self.is_done(d):
                raise ScpdrError(f"stage {stage.name}: dependency {role} ({d.name}) is not done")
        partial = final.with_name(final.name + ".partial")
        if force and partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            partial / "_inputs.json",
            {
                "name": stage.name,
                "hash": stage.hash,
                "inputs": stage.inputs,
                "deps": {r: d.key for r, d in stage.deps.items()},
            },
        )
        deps = {role: self.stage_dir(d) for role, d in stage.deps.items()}
        if on_start is not None:
            on_start(stage)
        t0 = time.perf_counter()
        logger.debug("stage %s: running in %s", stage.name, partial)
        ctx = StageContext(stage=stage, dir=partial, deps=deps, config=config)
        if memo is not None:
            ctx.memo = memo
        with sampled_peak() as peak:
            stage.run(ctx)
        seconds = time.perf_counter() - t0
        atomic_write_json(
            partial / MARKER,
            {
                "name": stage.name,
                "hash": stage.hash,
                "seconds": round(seconds, 3),
                "peak_rss_mib": peak.mib,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        return StageOutcome(stage.name, stage.hash, "ran", seconds, final, peak.mib)

    def collect_garbage(self, stages: Sequence[Stage]) -> list[Path]:
        """Remove cached dirs of the planned stage names whose hash is not planned any more."""
        keep: dict[str, set[str]] = {}
        for s in stages:
            keep.setdefault(s.name, set()).add(s.hash[:HASH_LEN])
        removed = []
        for name, hashes in keep.items():
            root = self.out / "stages" / name
            if not root.is_dir():
                continue
            for child in root.iterdir():
                if child.is_dir() and child.name.removesuffix(".partial") not in hashes:
                    if (child / MARKER).exists() or child.name.endswith(".partial"):
                        shutil.rmtree(child)
                        removed.append(child)
        return removed


@contextlib.contextmanager
def run_lock(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``out/.lock`` for the duration of a run; a second run in the same ``out`` is a
    :class:`ScpdrError` (not a wait)."""
    import fcntl

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ScpdrError(
                f"another `scpdr experiment` is running in {out}; wait for it or use another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
