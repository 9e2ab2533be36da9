"""End-to-end experiments: one YAML config → cached, resumable stages → ``results.json`` → report.

The pipeline of ``shared/DESIGN.md`` (layer 6)::

    data → partitions (+ audit) → train constituents (+ reference / baseline models) → bundles
         → attacks (one stage per corpus × method × attack) → bounds → report

Every stage writes its outputs into ``OUT/stages/<name>/<hash>/``, where ``hash`` is the SHA-256 of
the stage's inputs: its config section, the hashes of the stages it depends on and the version of
the code it runs (the source of the scpdr modules it calls, plus a per-stage version number). A
stage is *done* once its marker file ``_stage.json`` is written; the marker is written last, into a
``<hash>.partial`` working dir that is then renamed into place, so an interrupted run never leaves a
half stage that looks finished, and the next run continues in the same working dir (the trainer
resumes from its last checkpoint there). Re-running skips finished stages; a changed setting
changes the hashes of exactly the stages that depend on it, so only those re-run.

The config schema (:class:`ExperimentConfig`) is pydantic with ``extra="forbid"`` everywhere: an
unknown key or a bad value is a :class:`~scpdr.errors.ConfigError` naming the key path and the fix,
e.g. ``train.epochs: must be ≥ 1 (got 0)``.

Method names in results and reports follow ``scpdr.naf`` plus the variants of DESIGN.md:
``"scp-delta-r-b"`` / ``"scp-delta-r-c"`` (SCP-Δr with the base model / a constant base vector,
paper §5.1), ``"cp-fuse"``, and ``"none-val"`` (No CP on validation data, paper Table 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scpdr.errors import ConfigError, ScpdrError
from scpdr.io import atomic_write_json, read_json

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------

METHOD_SPECS: dict[str, tuple[str, str]] = {
    "none": ("none", "model"),
    "cp-delta": ("cp-delta", "model"),
    "cp-kl": ("cp-kl", "model"),
    "cp-fuse": ("cp-fuse", "model"),
    "cp-delta-r": ("cp-delta-r", "model"),
    "scp-delta-r-c": ("scp-delta-r", "constant"),
    "scp-delta-r-b": ("scp-delta-r", "model"),
    "scp-delta": ("scp-delta", "model"),
}
"""Result-row method name → (``ProtectedLM`` method, base variant: "model" or "constant")."""

DEFAULT_METHODS: tuple[str, ...] = (
    "none",
    "cp-delta",
    "cp-kl",
    "cp-fuse",
    "cp-delta-r",
    "scp-delta-r-c",
    "scp-delta-r-b",
)
"""The rows of the paper's main table (Table 3), in its order."""

SMOOTHED_METHODS = frozenset({"scp-delta-r-b", "scp-delta-r-c", "scp-delta"})
"""Methods whose output depends on the smoothing parameter m (Alg. 1)."""

BASELINE_METHODS = frozenset({"goldfish"})
"""Training-time baselines evaluated as a single model, like No CP."""

ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "lira", "utility", "generations")
BUILTIN_CORPORA: tuple[str, ...] = ("names2ids", "pycode", "pydocs")
_DEFAULT_ATTACKS: dict[str, tuple[str, ...]] = {
    "names2ids": ("pii", "tte", "lira", "utility", "generations"),
    "pycode": ("tte", "lira", "utility", "generations"),
    "pydocs": ("tte", "lira", "utility", "generations"),
}
_DEFAULT_LABELS = {"names2ids": "IDs", "pycode": "Code", "pydocs": "Docs"}

STAGE_VERSIONS: dict[str, int] = {
    "data": 1,
    "partitions": 1,
    "train": 1,
    "bundle": 1,
    "attack": 1,
    "bounds": 1,
    "report": 1,
}
"""Bumped when the orchestration of a stage kind changes (part of every stage hash)."""

_STAGE_CODE: dict[str, tuple[str, ...]] = {
    "data": ("scpdr.data",),
    "partitions": ("scpdr.data",),
    "train": ("scpdr.train", "scpdr.models", "scpdr.testing", "scpdr.data"),
    "bundle": ("scpdr.models",),
    "attack": ("scpdr.attacks", "scpdr.protected", "scpdr.naf", "scpdr.bounds", "scpdr.models"),
    "bounds": ("scpdr.attacks", "scpdr.protected", "scpdr.naf", "scpdr.bounds", "scpdr.models"),
    "report": ("scpdr.report",),
}
"""Modules whose source is part of a stage kind's hash (the "code version")."""


# --------------------------------------------------------------------------------------------
# Config schema (STYLE.md 6, after PEFT ``tuners/*/config.py``)
# --------------------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CanaryConfig(_Section):
    """Canaries (Carlini et al. 2019, paper §5.3) inserted into one partition of a corpus."""

    repetitions: list[int] = Field(
        default_factory=lambda: [1, 3, 10],
        description="how many times each canary is inserted; one group of canaries per value",
    )
    per_repetition: int = Field(5, ge=1, description="canaries per repetition count")
    words: int = Field(3, ge=1, description="random words per canary (the secret part)")
    partition: int = Field(0, ge=0, description="the partition the canaries are inserted into")

    @field_validator("repetitions")
    @classmethod
    def _reps(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("must list at least one repetition count")
        if any(r < 1 for r in v):
            raise ValueError(f"every repetition count must be ≥ 1 (got {v})")
        return v


class CorpusConfig(_Section):
    """One dataset: its constituents are trained on its partitions and attacked on it."""

    name: str = Field(..., description="identifier used in stage names and result rows")
    source: str | None = Field(
        None,
        description="'names2ids', 'pycode', 'pydocs' (built-in, generated offline) or a path to a "
        "JSONL/CSV file or a `datasets` save_to_disk dir; default: the name",
    )
    label: str | None = Field(None, description="column label in the report (default from source)")
    n_train: int = Field(64, ge=2, description="training examples in total (split over partitions)")
    n_val: int = Field(32, ge=1, description="held-out validation examples")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="field mapping for user files: {id|prompt|response|text: column name}",
    )
    canaries: CanaryConfig | None = Field(None, description="insert canaries into this corpus")
    attacks: list[str] | None = Field(
        None,
        description="attacks run on this corpus; default: pii (names2ids only), tte, lira, "
        "utility, generations, plus canary when canaries are inserted",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError(
                f"must be a plain identifier (letters, digits, '_', '.', '-'), got {v!r}"
            )
        return v

    @field_validator("attacks")
    @classmethod
    def _attacks(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        bad = [a for a in v if a not in ATTACKS]
        if bad:
            raise ValueError(f"unknown attack(s) {bad}; known: {list(ATTACKS)}")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _check_source(self) -> CorpusConfig:
        src = self.resolved_source
        if src not in BUILTIN_CORPORA and not Path(src).expanduser().exists():
            raise ValueError(
                f"source {src!r} is neither a built-in corpus {list(BUILTIN_CORPORA)} nor an "
                "existing file/dir; fix the path (relative paths are relative to the config file)"
            )
        if self.attacks is not None and "canary" in self.attacks and self.canaries is None:
            raise ValueError("attack 'canary' needs canaries: add a `canaries:` section")
        if (
            self.attacks is not None
            and "pii" in self.attacks
            and self.resolved_source != "names2ids"
        ):
            raise ValueError(
                "attack 'pii' needs the names2ids corpus (prompts 'Name: <name>, ID:')"
            )
        return self

    @property
    def resolved_source(self) -> str:
        return self.source or self.name

    @property
    def builtin(self) -> bool:
        return self.resolved_source in BUILTIN_CORPORA

    @property
    def resolved_label(self) -> str:
        if self.label:
            return self.label
        return _DEFAULT_LABELS.get(self.resolved_source, self.name)

    @property
    def resolved_attacks(self) -> list[str]:
        if self.attacks is not None:
            return list(self.attacks)
        out = list(
            _DEFAULT_ATTACKS.get(self.resolved_source, ("tte", "lira", "utility", "generations"))
        )
        if self.canaries is not None:
            out.insert(0, "canary")
        return out


class PartitionConfig(_Section):
    """K disjoint partitions, near-duplicates kept together (MinHash LSH)."""

    k: int = Field(2, ge=2, description="number of partitions = constituents (K)")
    near_duplicate_threshold: float = Field(
        0.8, gt=0.0, le=1.0, description="Jaccard threshold for grouping near-duplicates"
    )
    num_perm: int = Field(128, ge=16, description="MinHash permutations")
    allow_overlap: bool = Field(
        False, description="bundle even if the audit finds overlaps (recorded in the bundle)"
    )


class TrainSection(_Section):
    """Fine-tuning of every constituent (paper App. E, Table 'training defaults')."""

    epochs: int = Field(50, ge=1, description="training epochs")
    learning_rate: float = Field(5e-5, gt=0.0, description="peak learning rate")
    batch_size: int = Field(1, ge=1, description="per-device batch size")
    gradient_accumulation_steps: int = Field(1, ge=1, description="gradient accumulation")
    seq_len: int = Field(2048, ge=8, description="sequence length (examples joined with EOS)")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps")
    max_grad_norm: float = Field(2.0, gt=0.0, description="gradient clipping norm")
    neftune_noise_alpha: float | None = Field(
        5.0, ge=0.0, description="NEFTune noise (full fine-tuning only; null to disable)"
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (smoke runs)")
    lora: bool = Field(False, description="train LoRA adapters instead of full fine-tuning")
    lora_r: int = Field(64, ge=1, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoRA dropout")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training dtype")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="further scpdr.train.TrainConfig fields, passed through"
    )


class ReferenceConfig(_Section):
    """The reference model p0 (trained on partition 0 minus ``holdout`` examples) that LiRA and
    v_x (Theorem 4.2, r0 = CP(p0, q)) need; the held-out examples are the attack targets."""

    enabled: bool | None = Field(
        None, description="train p0; default: when lira or v_x is requested"
    )
    holdout: int = Field(8, ge=1, description="partition-0 examples left out of p0 (the targets)")


class GoldfishConfig(_Section):
    """Goldfish loss (Hans et al. 2024): drop every k-th token (hashed context of h tokens)."""

    k: int = Field(4, ge=2, description="drop one token in k from the loss")
    h: int = Field(13, ge=1, description="context width of the hash")


class BaselinesConfig(_Section):
    goldfish: GoldfishConfig | None = Field(
        None,
        description="also train partition 0 with goldfish loss; evaluated as method 'goldfish'",
    )


class CanaryAttackConfig(_Section):
    n_reference: int = Field(
        10_000, ge=100, description="random reference candidates for the exposure extrapolation"
    )


class PIIAttackConfig(_Section):
    n: int | None = Field(None, ge=1, description="names attacked (default: the target partition)")
    n_val: int | None = Field(None, ge=1, description="validation names (No CP-val)")


class TTEAttackConfig(_Section):
    n: int | None = Field(64, ge=1, description="training examples attacked (null: all)")
    q_fails_only: bool = Field(
        False, description="only tokens the other constituent fails to predict (paper Fig. 4b)"
    )


class LiraAttackConfig(_Section):
    n: int | None = Field(None, ge=1, description="members/non-members each (default: holdout)")


class UtilityAttackConfig(_Section):
    n: int | None = Field(None, ge=1, description="validation examples (null: all)")


class GenerationsConfig(_Section):
    n: int = Field(3, ge=1, description="training prompts shown side by side")
    max_new_tokens: int = Field(24, ge=1, description="tokens generated per prompt")
    methods: list[str] = Field(
        default_factory=lambda: ["none", "scp-delta-r-b"], description="methods compared"
    )


class AttacksConfig(_Section):
    batch_size: int = Field(16, ge=1, description="sequences per scoring/generation batch")
    canary: CanaryAttackConfig = Field(default_factory=CanaryAttackConfig)
    pii: PIIAttackConfig = Field(default_factory=PIIAttackConfig)
    tte: TTEAttackConfig = Field(default_factory=TTEAttackConfig)
    lira: LiraAttackConfig = Field(default_factory=LiraAttackConfig)
    utility: UtilityAttackConfig = Field(default_factory=UtilityAttackConfig)
    generations: GenerationsConfig = Field(default_factory=GenerationsConfig)


class BoundsConfig(_Section):
    """Per-position bound distributions: k_x (Thms 2.1/2.2), t_x (Thm 4.1), v_x (Thm 4.2)."""

    enabled: bool = Field(True, description="compute the bound distributions")
    n_prompts: int = Field(32, ge=1, description="training examples whose positions are used")
    methods: list[str] | None = Field(
        None, description="methods (default: the NAF methods of `methods`, without none/cp-fuse)"
    )
    t_x: bool = Field(True, description="also t_x")
    v_x: bool = Field(True, description="also v_x at the target tokens (needs the reference p0)")


class SweepConfig(_Section):
    """A one-dimensional sweep: the experiment re-run with ``key`` set to each of ``values``."""

    key: str = Field(..., description="dotted config key, e.g. 'm' or 'train.epochs'")
    values: list[Any] = Field(..., min_length=1, description="values of the key")
    methods: list[str] | None = Field(None, description="restrict the sweep to these methods")
    attacks: list[str] | None = Field(None, description="restrict the sweep to these attacks")


class ReportConfig(_Section):
    title: str | None = Field(None, description="report title (default: the experiment name)")
    plots: bool = Field(True, description="draw the plots")


class ExperimentConfig(_Section):
    """The whole experiment; see ``configs/demo.yaml`` and ``docs/experiments.md``."""

    name: str = Field("experiment", description="experiment name (report title)")
    seed: int = Field(0, ge=0, description="seed for data, partitions and training")
    base: str = Field(
        "embedded",
        description="base model: 'embedded' (SmolLM2-135M-Instruct), 'tiny' (random tiny model "
        "for smoke runs) or an HF dir / .gguf path",
    )
    corpora: list[CorpusConfig] = Field(..., min_length=1, description="datasets")
    partitions: PartitionConfig = Field(default_factory=PartitionConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    references: ReferenceConfig = Field(default_factory=ReferenceConfig)
    baselines: BaselinesConfig = Field(default_factory=BaselinesConfig)
    methods: list[str] = Field(default_factory=lambda: list(DEFAULT_METHODS))
    m: int = Field(10, ge=1, description="smoothing parameter m of SCP-Δr (Alg. 1)")
    attacks: AttacksConfig = Field(default_factory=AttacksConfig)
    bounds: BoundsConfig = Field(default_factory=BoundsConfig)
    sweeps: list[SweepConfig] = Field(default_factory=list, description="one-dimensional sweeps")
    report: ReportConfig = Field(default_factory=ReportConfig)

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        return _check_methods(v)

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        names = [c.name for c in self.corpora]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"corpora: names must be unique, repeated: {dup}")
        for i, c in enumerate(self.corpora):
            if c.canaries is not None and c.canaries.partition >= self.partitions.k:
                raise ValueError(
                    f"corpora.{i}.canaries.partition: must be < partitions.k = "
                    f"{self.partitions.k} (got {c.canaries.partition})"
                )
        if self.bounds.methods is not None:
            _check_methods(self.bounds.methods, where="bounds.methods")
        bad = [m for m in self.attacks.generations.methods if m not in self.all_methods]
        if bad:
            raise ValueError(
                f"attacks.generations.methods: {bad} are not among the evaluated methods "
                f"{self.all_methods}"
            )
        for i, s in enumerate(self.sweeps):
            if s.key.split(".")[0] in {"sweeps", "corpora", "name"}:
                raise ValueError(f"sweeps.{i}.key: {s.key!r} cannot be swept")
            try:
                _get_dotted(self.model_dump(), s.key)
            except KeyError:
                raise ValueError(
                    f"sweeps.{i}.key: {s.key!r} is not a config key (use a dotted path such as "
                    "'m' or 'train.epochs')"
                ) from None
            if s.methods is not None:
                _check_methods(s.methods, where=f"sweeps.{i}.methods")
            if s.attacks is not None and any(a not in ATTACKS for a in s.attacks):
                raise ValueError(f"sweeps.{i}.attacks: must be among {list(ATTACKS)}")
        return self

    # -- derived -------------------------------------------------------------------------

    @property
    def all_methods(self) -> list[str]:
        """The evaluated methods: ``methods`` plus the training-time baselines."""
        out = list(self.methods)
        if self.baselines.goldfish is not None:
            out.append("goldfish")
        return out

    @property
    def bound_methods(self) -> list[str]:
        if self.bounds.methods is not None:
            return list(self.bounds.methods)
        return [m for m in self.methods if m not in ("none", "cp-fuse")]

    @property
    def needs_reference(self) -> bool:
        if self.references.enabled is not None:
            return self.references.enabled
        lira = any("lira" in c.resolved_attacks for c in self.corpora)
        return lira or (self.bounds.enabled and self.bounds.v_x)

    def with_value(self, key: str, value: Any) -> ExperimentConfig:
        """A copy with the dotted ``key`` set to ``value`` (validated)."""
        data = self.model_dump()
        _set_dotted(data, key, value)
        return validate_config(data)


def _check_methods(v: Sequence[str], *, where: str = "methods") -> list[str]:
    known = list(METHOD_SPECS)
    bad = [m for m in v if m not in METHOD_SPECS]
    if bad:
        hint = ""
        if "scp-delta-r" in bad:
            hint = " (name the SCP-Δr variant: 'scp-delta-r-b' or 'scp-delta-r-c')"
        raise ValueError(f"unknown method(s) {bad}{hint}; known: {known}")
    if not v:
        raise ValueError("must list at least one method")
    if len(set(v)) != len(v):
        raise ValueError(f"methods repeated: {sorted({m for m in v if list(v).count(m) > 1})}")
    return list(v)


def _get_dotted(data: Mapping[str, Any], key: str) -> Any:
    cur: Any = data
    for part in key.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(key)
    return cur


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    cur: Any = data
    for part in parts[:-1]:
        cur = cur[int(part)] if isinstance(cur, list) else cur.setdefault(part, {})
    last = parts[-1]
    if isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value


_ERROR_TEMPLATES: dict[str, str] = {
    "greater_than_equal": "must be ≥ {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be ≤ {le}",
    "less_than": "must be < {lt}",
    "missing": "is required",
    "extra_forbidden": "unknown key",
    "too_short": "must have at least {min_length} item(s)",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "literal_error": "must be one of {expected}",
}


def _format_loc(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _format_validation_error(exc: ValidationError, *, source: str | None) -> str:
    lines = []
    for err in exc.errors():
        loc = _format_loc(err["loc"])
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind in _ERROR_TEMPLATES:
            msg = _ERROR_TEMPLATES[kind].format(**{k: v for k, v in ctx.items()})
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        if kind not in ("missing", "extra_forbidden", "model_type"):
            got = err.get("input")
            if not isinstance(got, (dict, list)):
                msg += f" (got {got!r})"
        if kind == "extra_forbidden":
            msg += "; remove it or fix its spelling (see docs/experiments.md for the keys)"
        # Errors raised by model validators carry their own key path in the message.
        if re.match(r"^[\w.]+: ", msg) and loc == "(top level)":
            lines.append(msg)
        else:
            lines.append(f"{loc}: {msg}")
    where = f" in {source}" if source else ""
    return f"invalid experiment config{where}:\n  " + "\n  ".join(lines)


def validate_config(data: Mapping[str, Any], *, source: str | None = None) -> ExperimentConfig:
    """Validate a config mapping; raises :class:`ConfigError` listing every problem by key path."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"invalid experiment config{f' in {source}' if source else ''}: the top level must "
            f"be a mapping of keys, got {type(data).__name__}"
        )
    try:
        return ExperimentConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source=source)) from None


def load_config(path: str | os.PathLike[str]) -> ExperimentConfig:
    """Read and validate a YAML config. Relative corpus paths are resolved against its dir."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: the config is empty; see configs/demo.yaml for an example")
    if isinstance(data, Mapping):
        data = _resolve_paths(dict(data), path.parent)
    return validate_config(data, source=str(path))


def _resolve_paths(data: dict[str, Any], root: Path) -> dict[str, Any]:
    corpora = data.get("corpora")
    if isinstance(corpora, list):
        for c in corpora:
            if isinstance(c, dict):
                src = c.get("source") or c.get("name")
                if isinstance(src, str) and src not in BUILTIN_CORPORA:
                    p = Path(src).expanduser()
                    if not p.is_absolute():
                        c["source"] = str((root / p).resolve())
    base = data.get("base")
    if isinstance(base, str) and base not in ("embedded", "tiny"):
        p = Path(base).expanduser()
        if not p.is_absolute() and (root / p).exists():
            data["base"] = str((root / p).resolve())
    return data


# --------------------------------------------------------------------------------------------
# Stage runner
# --------------------------------------------------------------------------------------------

MARKER = "_stage.json"
_HASH_LEN = 16


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _module_files(module: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        files: list[Path] = []
        for loc in spec.submodule_search_locations:
            root = Path(loc)
            files += [p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".txt")]
        return sorted(files)
    return [Path(spec.origin)] if spec.origin and spec.origin != "built-in" else []


_CODE_CACHE: dict[str, str] = {}


def code_version(kind: str) -> str:
    """Hash of the source of the modules a stage kind runs, plus its version number."""
    if kind not in _CODE_CACHE:
        from scpdr import __version__

        h = hashlib.sha256(f"{__version__}:{kind}:{STAGE_VERSIONS[kind]}".encode())
        for mod in _STAGE_CODE.get(kind, ()):
            for f in _module_files(mod):
                if "__pycache__" in f.parts:
                    continue
                h.update(f.name.encode())
                h.update(f.read_bytes())
        _CODE_CACHE[kind] = h.hexdigest()
    return _CODE_CACHE[kind]


@dataclasses.dataclass
class StageContext:
    """What a stage function gets: its working dir, its dependencies' output dirs, the config."""

    stage: Stage
    dir: Path
    deps: dict[str, Path]
    config: ExperimentConfig
    runner: StageRunner

    def dep(self, role: str) -> Path:
        return self.deps[role]


@dataclasses.dataclass(eq=False)
class Stage:
    """One cached unit of work. ``hash`` covers name, inputs, dependency hashes and code."""

    name: str
    kind: str
    inputs: dict[str, Any]
    run: Callable[[StageContext], None]
    deps: dict[str, Stage] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    hash: str = ""

    def __post_init__(self) -> None:
        payload = {
            "name": self.name,
            "kind": self.kind,
            "inputs": self.inputs,
            "deps": {role: d.hash for role, d in sorted(self.deps.items())},
            "code": code_version(self.kind),
        }
        self.hash = hashlib.sha256(_canonical(payload).encode()).hexdigest()

    @property
    def key(self) -> str:
        return f"{self.name}@{self.hash[:_HASH_LEN]}"


@dataclasses.dataclass
class StageOutcome:
    name: str
    hash: str
    status: Literal["ran", "cached"]
    seconds: float
    dir: Path


class StageRunner:
    """Runs stages in dependency order under ``out/stages`` with content-hash caching.

    Layout: ``out/stages/<name>/<hash16>/`` (done: holds ``_stage.json``) and
    ``out/stages/<name>/<hash16>.partial/`` (in progress; kept across interruptions so the next
    run resumes in it).
    """

    def __init__(self, out: Path, config: ExperimentConfig, *, progress: bool = True) -> None:
        self.out = Path(out)
        self.config = config
        self.progress = progress
        self.outcomes: dict[str, StageOutcome] = {}
        self.cache: dict[Any, Any] = {}  # in-process objects shared by stages (loaded models)

    def stage_dir(self, stage: Stage) -> Path:
        return self.out / "stages" / stage.name / stage.hash[:_HASH_LEN]

    def is_done(self, stage: Stage) -> bool:
        marker = self.stage_dir(stage) / MARKER
        if not marker.is_file():
            return False
        try:
            return read_json(marker).get("hash") == stage.hash
        except (OSError, ValueError):
            return False

    def run_all(self, stages: Sequence[Stage], *, force: Sequence[str] = ()) -> list[StageOutcome]:
        order = _topological(stages)
        forced = [s for s in order if any(_matches(s.name, pat) for pat in force)]
        with _progress(self.progress, len(order)) as advance:
            for stage in order:
                if stage.key in self.outcomes:
                    advance(stage.name, "cached", 0.0)
                    continue
                outcome = self._run_one(stage, force=stage in forced, advance=advance)
                self.outcomes[stage.key] = outcome
        return [self.outcomes[s.key] for s in order]

    def _run_one(self, stage: Stage, *, force: bool, advance: Callable[..., None]) -> StageOutcome:
        final = self.stage_dir(stage)
        if not force and self.is_done(stage):
            advance(stage.name, "cached", 0.0)
            return StageOutcome(stage.name, stage.hash, "cached", 0.0, final)
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
        for role, d in stage.deps.items():
            if not self.is_done(d):
                raise ScpdrError(f"stage {stage.name}: dependency {role} ({d.name}) is not done")
        advance(stage.name, "running", None)
        t0 = time.perf_counter()
        logger.info("stage %s: running in %s", stage.name, partial)
        stage.run(
            StageContext(stage=stage, dir=partial, deps=deps, config=self.config, runner=self)
        )
        seconds = time.perf_counter() - t0
        atomic_write_json(
            partial / MARKER,
            {
                "name": stage.name,
                "hash": stage.hash,
                "seconds": round(seconds, 3),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        advance(stage.name, "ran", seconds)
        return StageOutcome(stage.name, stage.hash, "ran", seconds, final)

    def collect_garbage(self, stages: Sequence[Stage]) -> list[Path]:
        """Remove cached dirs of the planned stage names whose hash is not planned any more."""
        keep: dict[str, set[str]] = {}
        for s in stages:
            keep.setdefault(s.name, set()).add(s.hash[:_HASH_LEN])
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


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatch(name, pattern) or name.startswith(pattern.rstrip("/") + "/")


def _topological(stages: Sequence[Stage]) -> list[Stage]:
    seen: dict[str, Stage] = {}
    order: list[Stage] = []

    def visit(s: Stage, stack: tuple[str, ...]) -> None:
        if s.key in seen:
            return
        if s.key in stack:
            raise ScpdrError(f"stage cycle through {s.name}")
        for d in s.deps.values():
            visit(d, (*stack, s.key))
        seen[s.key] = s
        order.append(s)

    for s in stages:
        visit(s, ())
    return order


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[..., None]]:
    """A rich progress display over the stages: one line per stage as it finishes."""
    if not enabled:

        def quiet(name: str, status: str, seconds: float | None) -> None:
            if status != "running":
                logger.info("stage %s: %s%s", name, status, _fmt_secs(seconds))

        yield quiet
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]stages[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("", total=total)

        def advance(name: str, status: str, seconds: float | None) -> None:
            if status == "running":
                progress.update(task, description=f"[cyan]{name}[/] …")
                return
            style = "green" if status == "ran" else "dim"
            progress.console.log(f"[{style}]{status:>6}[/] {name}{_fmt_secs(seconds)}")
            progress.update(task, advance=1, description="")

        yield advance


def _fmt_secs(seconds: float | None) -> str:
    return f" ({seconds:.1f} s)" if seconds else ""


@contextlib.contextmanager
def _run_lock(out: Path) -> Iterator[None]:
    import fcntl

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
