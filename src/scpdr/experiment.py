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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scpdr.errors import ConfigError, ScpdrError
from scpdr.io import atomic_write_json, read_json
from scpdr.methods import MAIN_TABLE_METHODS

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

DEFAULT_METHODS: tuple[str, ...] = MAIN_TABLE_METHODS
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
    "train": ("scpdr.train", "scpdr.models", "scpdr.tiny", "scpdr.data"),
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
    n_per_repetition: int = Field(5, ge=1, description="canaries per repetition count")
    num_words: int = Field(3, ge=1, le=16, description="random words per canary (the secret part)")
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
        0.7, gt=0.0, lt=1.0, description="shingle Jaccard at or above which records are grouped"
    )
    num_perm: int = Field(128, ge=16, description="MinHash permutations")
    allow_overlap: bool = Field(
        False, description="bundle even if the audit finds overlaps (recorded in the bundle)"
    )


class TrainSection(_Section):
    """Fine-tuning of every constituent (paper App. E, Table "training defaults"); mapped onto
    :class:`scpdr.train.TrainConfig`. Fields left null take the paper's default for the mode
    (full fine-tuning / LoRA)."""

    epochs: int | None = Field(None, ge=1, description="training epochs (paper: 50 / LoRA 20)")
    learning_rate: float | None = Field(
        None, gt=0.0, description="peak learning rate (paper: 5e-5 / LoRA 5e-4)"
    )
    batch_size: int | None = Field(None, ge=1, description="sequences per step (paper: 1 / 64)")
    grad_accum: int = Field(1, ge=1, description="gradient accumulation steps")
    seq_len: int = Field(2048, ge=8, description="sequence length in tokens")
    packing: bool | None = Field(
        None, description="concatenate examples with EOS (paper: full FT) or pad each (LoRA)"
    )
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps")
    max_grad_norm: float = Field(2.0, gt=0.0, description="gradient clipping norm")
    neftune_alpha: float | None = Field(
        None, ge=0.0, description="NEFTune noise alpha (paper: 5 full / none LoRA; 0 disables)"
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (smoke runs)")
    lora: bool = Field(False, description="train LoRA adapters instead of full fine-tuning")
    lora_r: int = Field(64, ge=1, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="LoRA dropout")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="further scpdr.train.TrainConfig fields (e.g. optim, bf16), passed through",
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
        if "cp-fuse" in self.methods and self.partitions.k != 2:
            raise ValueError(
                f"methods: cp-fuse fuses exactly 2 constituents, but partitions.k = "
                f"{self.partitions.k}; drop cp-fuse or use k = 2"
            )
        if self.bounds.methods is not None:
            _check_methods(self.bounds.methods, where="bounds.methods")
            if "cp-fuse" in self.bounds.methods:
                raise ValueError(
                    "bounds.methods: cp-fuse is stateful and has no per-position NAF bound; "
                    "remove it"
                )
        if self.references.enabled is False:
            lira = [c.name for c in self.corpora if "lira" in c.resolved_attacks]
            if lira:
                raise ValueError(
                    f"references.enabled: false, but attack 'lira' (corpora {lira}) needs the "
                    "reference model p0; enable it or drop 'lira' from the corpus attacks"
                )
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


def _check_methods(v: Sequence[str], *, where: str | None = None) -> list[str]:
    """Known, non-empty, unique method names; ``where`` prefixes the message (model validators,
    whose errors carry no key path of their own)."""
    prefix = f"{where}: " if where else ""
    known = list(METHOD_SPECS)
    bad = [m for m in v if m not in METHOD_SPECS]
    if bad:
        hint = ""
        if "scp-delta-r" in bad:
            hint = " (name the SCP-Δr variant: 'scp-delta-r-b' or 'scp-delta-r-c')"
        raise ValueError(f"{prefix}unknown method(s) {bad}{hint}; known: {known}")
    if not v:
        raise ValueError(f"{prefix}must list at least one method")
    if len(set(v)) != len(v):
        raise ValueError(
            f"{prefix}methods repeated: {sorted({m for m in v if list(v).count(m) > 1})}"
        )
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


def load_config(path: str | os.PathLike[str], *, _depth: int = 0) -> ExperimentConfig:
    """Read and validate a YAML config. Relative paths (corpus sources, base model) resolve
    against the config's dir; ``extends: OTHER.yaml`` starts from another config and overrides
    it key by key (mappings merge, lists replace)."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config {path} is a directory; a YAML config file is expected (e.g. configs/demo.yaml)"
        )
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
        parent = data.pop("extends", None)
        if parent is not None:
            if not isinstance(parent, str):
                raise ConfigError(f"{path}: extends: must be a path to another config")
            if _depth > 8:
                raise ConfigError(f"{path}: extends: chain too deep (a cycle?)")
            base = load_config(path.parent / parent, _depth=_depth + 1)
            data = _deep_merge(base.model_dump(mode="json"), data)
    return validate_config(data, source=str(path))


def _deep_merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` over ``base``: mappings merge key by key, everything else (lists too) replaces."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


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
    def label(self) -> str:
        """The name, plus the sweep point (``[m=100]``) for a stage only a sweep runs: sweep points
        share the main run's stage names, and the display and ``--force`` tell them apart by this."""
        return self.meta.get("label", self.name)

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
        forced = [s for s in order if any(_matches_stage(s, pat) for pat in force)]
        with _progress(self.progress, len(order)) as advance:
            for stage in order:
                if stage.key in self.outcomes:
                    advance(stage.label, "cached", 0.0)
                    continue
                outcome = self._run_one(stage, force=stage in forced, advance=advance)
                self.outcomes[stage.key] = outcome
        return [self.outcomes[s.key] for s in order]

    def _run_one(self, stage: Stage, *, force: bool, advance: Callable[..., None]) -> StageOutcome:
        final = self.stage_dir(stage)
        if not force and self.is_done(stage):
            advance(stage.label, "cached", 0.0)
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
        advance(stage.label, "running", None)
        t0 = time.perf_counter()
        logger.debug("stage %s: running in %s", stage.name, partial)
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
        advance(stage.label, "ran", seconds)
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


def _matches_stage(stage: Stage, pattern: str) -> bool:
    """``--force`` matching on the stage's name or its label (``"attack/*[m=100]"``)."""
    return _matches(stage.name, pattern) or _matches(stage.label, pattern)


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return (
        name == pattern
        or fnmatch.fnmatch(name, pattern)
        or name.startswith(pattern.rstrip("/") + "/")
    )


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
    from rich.markup import escape as rich_escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True, log_path=False)
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
            name = rich_escape(name)  # a sweep label holds "[m=100]"
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


# --------------------------------------------------------------------------------------------
# The plan: config → stages
# --------------------------------------------------------------------------------------------

TARGETS_NAME = "targets.json"
ROWS_NAME = "rows.json"


def _stage_inputs_corpus(cfg: ExperimentConfig, corpus: CorpusConfig) -> dict[str, Any]:
    return {
        "source": corpus.resolved_source,
        "source_fingerprint": _source_fingerprint(corpus.resolved_source),
        "n_train": corpus.n_train,
        "n_val": corpus.n_val,
        "fields": corpus.fields,
        "canaries": corpus.canaries.model_dump() if corpus.canaries else None,
        "seed": cfg.seed,
    }


def _source_fingerprint(source: str) -> str | None:
    """Size and mtime of a user data file (a changed file re-runs the data stage)."""
    if source in BUILTIN_CORPORA:
        return None
    p = Path(source).expanduser()
    if p.is_file():
        st = p.stat()
        return f"{st.st_size}:{int(st.st_mtime)}"
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return hashlib.sha256(
            "".join(
                f"{f.relative_to(p)}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files
            ).encode()
        ).hexdigest()
    return None


def _train_inputs(cfg: ExperimentConfig) -> dict[str, Any]:
    return {"train": cfg.train.model_dump(), "base": cfg.base, "seed": cfg.seed}


@dataclasses.dataclass
class _CorpusStages:
    corpus: CorpusConfig
    data: Stage
    partitions: Stage
    constituents: list[Stage]
    bundle: Stage
    reference: Stage | None = None
    ref_bundle: Stage | None = None
    goldfish: Stage | None = None


def plan(cfg: ExperimentConfig) -> tuple[list[Stage], Stage]:
    """All stages of ``cfg`` (main run and sweep points) and the report stage."""
    base_stage = _base_stage(cfg)
    main = _plan_point(cfg, base_stage)
    sources: list[tuple[str, Stage, dict[str, Any]]] = [(s.name, s, {}) for s in main]
    stages = list(main)
    main_keys = {s.key for s in main}
    for i, sweep in enumerate(cfg.sweeps):
        for value in sweep.values:
            point_cfg = _sweep_point(cfg, sweep, value, where=f"sweeps.{i}")
            point = _plan_point(point_cfg, _base_stage(point_cfg))
            tag = {"sweep": sweep.key, "sweep_value": value}
            for st in point:
                if st.key not in main_keys:
                    st.meta.setdefault("label", f"{st.name} [{sweep.key}={value}]")
            stages += point
            sources += [(f"sweep{i}={value!s}:{s.name}", s, tag) for s in point]
    result_stages = [(role, s, tag) for role, s, tag in sources if s.kind in ("attack", "bounds")]
    report = Stage(
        name="report",
        kind="report",
        inputs={
            "report": cfg.report.model_dump(),
            "title": cfg.report.title or cfg.name,
            "labels": {c.name: c.resolved_label for c in cfg.corpora},
            "methods": cfg.all_methods,
            "generation_methods": cfg.attacks.generations.methods,
            "tags": {role: tag for role, _, tag in result_stages},
            "summary": _summary(cfg),
        },
        run=_run_report,
        deps={role: s for role, s, _ in result_stages},
    )
    return stages, report


def _summary(cfg: ExperimentConfig) -> str:
    corpora = ", ".join(
        f"{c.resolved_label} ({c.resolved_source}, {c.n_train} train / {c.n_val} val"
        + (f", canaries ×{c.canaries.repetitions}" if c.canaries else "")
        + ")"
        for c in cfg.corpora
    )
    t = cfg.train
    mode = "LoRA" if t.lora else "full fine-tuning"
    epochs = t.epochs if t.epochs is not None else (20 if t.lora else 50)
    lr = t.learning_rate if t.learning_rate is not None else (5e-4 if t.lora else 5e-5)
    steps = f", max {t.max_steps} steps" if t.max_steps else ""
    return (
        f"Base model: {cfg.base}. Data: {corpora}. K = {cfg.partitions.k} partitions; {mode}, "
        f"{epochs} epochs, lr {lr:g}{steps}. Smoothing m = {cfg.m}."
    )


def _sweep_point(
    cfg: ExperimentConfig, sweep: SweepConfig, value: Any, *, where: str
) -> ExperimentConfig:
    try:
        point = cfg.with_value(sweep.key, value)
    except ConfigError as exc:
        raise ConfigError(
            f"{where}: value {value!r} for {sweep.key!r} is invalid:\n{exc}"
        ) from None
    data = point.model_dump()
    data["sweeps"] = []
    if sweep.methods is not None:
        data["methods"] = [m for m in point.methods if m in sweep.methods]
        if "goldfish" not in sweep.methods:
            data["baselines"]["goldfish"] = None
        data["attacks"]["generations"]["methods"] = [
            m for m in point.attacks.generations.methods if m in sweep.methods
        ]
    if sweep.attacks is not None:
        for c in data["corpora"]:
            current = CorpusConfig.model_validate(c).resolved_attacks
            c["attacks"] = [a for a in current if a in sweep.attacks]
        if "bounds" not in sweep.attacks:
            data["bounds"]["enabled"] = False
    return validate_config(data)


def _base_stage(cfg: ExperimentConfig) -> Stage | None:
    if cfg.base != "tiny":
        return None
    return Stage(name="base/tiny", kind="train", inputs={"seed": cfg.seed}, run=_run_tiny_base)


def _plan_point(cfg: ExperimentConfig, base_stage: Stage | None) -> list[Stage]:
    stages: list[Stage] = []
    if base_stage is not None:
        stages.append(base_stage)
    base_deps = {"base": base_stage} if base_stage is not None else {}
    for corpus in cfg.corpora:
        cs = _plan_corpus(cfg, corpus, base_deps)
        stages += [cs.data, cs.partitions, *cs.constituents]
        stages += [s for s in (cs.reference, cs.goldfish) if s is not None]
        stages += [s for s in (cs.bundle, cs.ref_bundle) if s is not None]
        stages += _plan_attacks(cfg, cs)
        if cfg.bounds.enabled and len(cfg.bound_methods) > 0:
            deps = {"bundle": cs.bundle, "partitions": cs.partitions}
            if cs.ref_bundle is not None and cfg.bounds.v_x:
                deps["ref_bundle"] = cs.ref_bundle
            stages.append(
                Stage(
                    name=f"bounds/{corpus.name}",
                    kind="bounds",
                    inputs={
                        "bounds": cfg.bounds.model_dump(),
                        "methods": cfg.bound_methods,
                        "m": cfg.m,
                        "corpus": corpus.name,
                        "batch_size": cfg.attacks.batch_size,
                        "seed": cfg.seed,
                    },
                    run=_run_bounds,
                    deps=deps,
                )
            )
    return stages


def _plan_corpus(
    cfg: ExperimentConfig, corpus: CorpusConfig, base_deps: dict[str, Stage]
) -> _CorpusStages:
    data = Stage(
        name=f"data/{corpus.name}",
        kind="data",
        inputs=_stage_inputs_corpus(cfg, corpus),
        run=_run_data,
    )
    partitions = Stage(
        name=f"partitions/{corpus.name}",
        kind="partitions",
        inputs={
            "partitions": cfg.partitions.model_dump(),
            "seed": cfg.seed,
            "holdout": cfg.references.holdout,
        },
        run=_run_partitions,
        deps={"data": data},
    )
    train_in = _train_inputs(cfg)
    constituents = [
        Stage(
            name=f"train/{corpus.name}/c{i}",
            kind="train",
            inputs={**train_in, "partition": i, "role": "constituent"},
            run=_run_train,
            deps={"partitions": partitions, **base_deps},
        )
        for i in range(cfg.partitions.k)
    ]
    bundle = Stage(
        name=f"bundle/{corpus.name}",
        kind="bundle",
        inputs={"base": cfg.base, "n_constant_prompts": 100},
        run=_run_bundle,
        deps={
            "partitions": partitions,
            **{f"c{i}": s for i, s in enumerate(constituents)},
            **base_deps,
        },
    )
    cs = _CorpusStages(corpus, data, partitions, constituents, bundle)
    if cfg.needs_reference:
        cs.reference = Stage(
            name=f"train/{corpus.name}/ref",
            kind="train",
            inputs={**train_in, "partition": 0, "role": "reference"},
            run=_run_train,
            deps={"partitions": partitions, **base_deps},
        )
        cs.ref_bundle = Stage(
            name=f"bundle/{corpus.name}/ref",
            kind="bundle",
            inputs={"base": cfg.base, "reference": True},
            run=_run_ref_bundle,
            deps={
                "main": bundle,
                "c0": cs.reference,
                **{f"c{i}": s for i, s in enumerate(constituents) if i > 0},
            },
        )
    if cfg.baselines.goldfish is not None:
        cs.goldfish = Stage(
            name=f"train/{corpus.name}/goldfish",
            kind="train",
            inputs={
                **train_in,
                "partition": 0,
                "role": "goldfish",
                "goldfish": cfg.baselines.goldfish.model_dump(),
            },
            run=_run_train,
            deps={"partitions": partitions, **base_deps},
        )
    return cs


def _plan_attacks(cfg: ExperimentConfig, cs: _CorpusStages) -> list[Stage]:
    corpus = cs.corpus
    out: list[Stage] = []
    attacks = corpus.resolved_attacks
    for method in cfg.all_methods:
        for attack in attacks:
            if attack == "generations" and method not in cfg.attacks.generations.methods:
                continue
            if attack == "lira" and cs.ref_bundle is None:
                continue
            section = getattr(cfg.attacks, attack).model_dump()
            inputs: dict[str, Any] = {
                "method": method,
                "attack": attack,
                "config": section,
                "corpus": corpus.name,
                "batch_size": cfg.attacks.batch_size,
                "seed": cfg.seed,
            }
            if method in SMOOTHED_METHODS:
                inputs["m"] = cfg.m
            if attack == "lira":
                inputs["holdout"] = cfg.references.holdout
            deps: dict[str, Stage] = {"bundle": cs.bundle, "partitions": cs.partitions}
            if attack == "lira" and cs.ref_bundle is not None:
                deps["ref_bundle"] = cs.ref_bundle
                if method in ("none", "goldfish") and cs.reference is not None:
                    deps["reference"] = cs.reference
            if method == "goldfish" and cs.goldfish is not None:
                deps["goldfish"] = cs.goldfish
            out.append(
                Stage(
                    name=f"attack/{corpus.name}/{method}/{attack}",
                    kind="attack",
                    inputs=inputs,
                    run=_run_attack,
                    deps=deps,
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# Running an experiment
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExperimentResult:
    """What :func:`run_experiment` returns."""

    out: Path
    rows: list[dict[str, Any]]
    outcomes: list[StageOutcome]
    report_md: Path
    report_html: Path
    results_json: Path
    main_table: Any  # scpdr.report.Table

    @property
    def ran(self) -> list[str]:
        return [o.name for o in self.outcomes if o.status == "ran"]

    @property
    def cached(self) -> list[str]:
        return [o.name for o in self.outcomes if o.status == "cached"]


def run_experiment(
    config: ExperimentConfig | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: Sequence[str] = (),
    progress: bool = True,
    keep_stale: bool = False,
) -> ExperimentResult:
    """Run (or resume) every stage of ``config`` under ``out`` and publish the report.

    ``out`` receives ``results.json``, ``report.md``, ``report.html``, ``plots/`` and the stage
    cache ``stages/``. ``force``: stage names or glob patterns (``"attack/*"``, ``"train"``) to
    re-run even when cached. Cached dirs of the same stages with outdated hashes are deleted
    unless ``keep_stale``.
    """
    config, stages, report = planned(config)
    _check_base(config)
    out = Path(out)
    with _run_lock(out):
        runner = StageRunner(out, config, progress=progress)
        try:
            with _quiet_hf_progress():
                outcomes = runner.run_all([*stages, report], force=force)
        finally:
            runner.cache.clear()
        if not keep_stale:
            removed = runner.collect_garbage([*stages, report])
            if removed:
                logger.info("removed %d outdated stage dir(s)", len(removed))
        report_dir = runner.stage_dir(report)
        _publish(report_dir, out)
    rows = read_json(out / "results.json")
    from scpdr.report.tables import main_table

    table = main_table(
        rows,
        methods=config.all_methods,
        corpus_labels={c.name: c.resolved_label for c in config.corpora},
    )
    return ExperimentResult(
        out=out,
        rows=rows,
        outcomes=outcomes,
        report_md=out / "report.md",
        report_html=out / "report.html",
        results_json=out / "results.json",
        main_table=table,
    )


def planned(
    config: ExperimentConfig | str | os.PathLike[str],
) -> tuple[ExperimentConfig, list[Stage], Stage]:
    """(config, stages, report stage) exactly as :func:`run_experiment` runs them; the report
    embeds the config file's text (the resolved config when it ``extends`` another)."""
    config_text: str | None = None
    if not isinstance(config, ExperimentConfig):
        config_text = Path(config).read_text(encoding="utf-8")
        config = load_config(config)
        if re.search(r"^extends\s*:", config_text, flags=re.MULTILINE):
            config_text = None  # show the resolved config, not just the overrides
    stages, report = plan(config)
    report.inputs["config_text"] = config_text or _dump_yaml(config)
    report.__post_init__()  # re-hash with the config text
    return config, stages, report


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    """No transformers progress bars (loading/writing weights) under the stage display."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_base(cfg: ExperimentConfig) -> None:
    if cfg.base in ("embedded", "tiny"):
        return
    if not Path(cfg.base).expanduser().exists():
        raise ConfigError(
            f"base: model {cfg.base!r} does not exist; give an HF model directory or a .gguf file "
            "(relative to the config file), or 'embedded' for SmolLM2-135M-Instruct"
        )


def _dump_yaml(cfg: ExperimentConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _publish(report_dir: Path, out: Path) -> None:
    """Copy the report stage's outputs to the top of ``out`` (atomically per file)."""
    from scpdr.io import atomic_write

    for name in ("results.json", "report.md", "report.html"):
        src = report_dir / name
        atomic_write(out / name, lambda p, src=src: shutil.copyfile(src, p))
    plots_src = report_dir / "plots"
    plots_dst = out / "plots"
    if plots_dst.exists():
        shutil.rmtree(plots_dst)
    if plots_src.is_dir():
        shutil.copytree(plots_src, plots_dst)


# --------------------------------------------------------------------------------------------
# Stage implementations
# --------------------------------------------------------------------------------------------


def _run_tiny_base(ctx: StageContext) -> None:
    from scpdr.tiny import tiny_model, tiny_tokenizer

    model = tiny_model(int(ctx.stage.inputs["seed"]))
    model.save_pretrained(str(ctx.dir / "model"))
    tiny_tokenizer().save_pretrained(str(ctx.dir / "model"))


def _base_ref(ctx: StageContext) -> str:
    if "base" in ctx.deps:
        return str(ctx.deps["base"] / "model")
    return ctx.config.base


def _run_data(ctx: StageContext) -> None:
    import random

    from scpdr.data import CanaryConfig as DataCanaryConfig
    from scpdr.data import build_corpus, load_records, make_canaries, save_records

    inp = ctx.stage.inputs
    source, n_train, n_val, seed = inp["source"], inp["n_train"], inp["n_val"], inp["seed"]
    if source in BUILTIN_CORPORA:
        corpus = build_corpus(source, n_train=n_train, n_val=n_val, seed=seed)
        train, val = corpus.train, corpus.validation
    else:
        records = load_records(source, fields=inp["fields"] or None)
        rng = random.Random(f"experiment-data:{seed}")
        order = list(range(len(records)))
        rng.shuffle(order)
        if len(records) < n_val + 2:
            raise ConfigError(
                f"{source} has {len(records)} records; need more than n_val + 1 = {n_val + 1}"
            )
        val = [records[i] for i in order[:n_val]]
        train = [records[i] for i in order[n_val : n_val + n_train]]
        if len(train) < n_train:
            logger.warning("%s: only %d training records (n_train=%d)", source, len(train), n_train)
    save_records(ctx.dir / "train.jsonl", train)
    save_records(ctx.dir / "validation.jsonl", val)
    can = inp["canaries"]
    if can is not None:
        registry = make_canaries(
            DataCanaryConfig(
                n_per_repetition=can["n_per_repetition"],
                repetitions=tuple(can["repetitions"]),
                num_words=can["num_words"],
                partition=can["partition"],
                seed=seed,
            )
        )
        registry.save(ctx.dir / "canaries.json")
    atomic_write_json(ctx.dir / "meta.json", {"n_train": len(train), "n_val": len(val)})


def _run_partitions(ctx: StageContext) -> None:
    import random

    from scpdr.data import (
        CanaryRegistry,
        GroupingConfig,
        audit_partitions,
        load_records,
        partition_records,
        save_partitions,
    )

    pcfg = PartitionConfig.model_validate(ctx.stage.inputs["partitions"])
    seed = int(ctx.stage.inputs["seed"])
    data = ctx.dep("data")
    train = load_records(data / "train.jsonl")
    val = load_records(data / "validation.jsonl")
    registry = (
        CanaryRegistry.load(data / "canaries.json") if (data / "canaries.json").exists() else None
    )
    grouping = GroupingConfig(threshold=pcfg.near_duplicate_threshold, num_perm=pcfg.num_perm)
    pset = partition_records(
        train,
        k=pcfg.k,
        seed=seed,
        grouping=grouping,
        canaries=registry,
        validation=val,
        dataset={"records": str(data / "train.jsonl")},
    )
    audit = audit_partitions(pset.manifest, pset.records(), canaries=registry)
    audit_dict = audit.to_dict()
    audit_dict["overridden"] = bool(pcfg.allow_overlap and not audit.passed)
    atomic_write_json(ctx.dir / "audit.json", audit_dict)
    if not audit.passed:
        if not pcfg.allow_overlap:
            audit.raise_if_failed("`partitions: {allow_overlap: true}` in the config")
        logger.warning("partition audit FAILED; continuing because partitions.allow_overlap is set")
    save_partitions(ctx.dir / "partitions", pset)
    # The targets of LiRA / v_x: partition-0 examples left out of the reference model p0.
    holdout = int(ctx.stage.inputs["holdout"])
    canary_ids = {r.id for r in registry.records()} if registry is not None else set()
    pool = [r.id for r in pset.parts[0] if r.id not in canary_ids]
    rng = random.Random(f"experiment-targets:{seed}")
    rng.shuffle(pool)
    if holdout and len(pool) <= holdout:
        raise ConfigError(
            f"references.holdout: must be < the {len(pool)} non-canary examples of partition 0 "
            f"(got {holdout}); raise n_train or lower the holdout"
        )
    atomic_write_json(ctx.dir / TARGETS_NAME, {"holdout": sorted(pool[:holdout])})


def _load_pset(path: Path) -> Any:
    from scpdr.data import load_partitions

    return load_partitions(path / "partitions")


def _training_records(ctx: StageContext) -> list[Any]:
    pset = _load_pset(ctx.dep("partitions"))
    i = int(ctx.stage.inputs["partition"])
    records = list(pset.parts[i])
    if ctx.stage.inputs["role"] == "reference":
        drop = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
        if pset.canaries is not None:
            drop |= {r.id for r in pset.canaries.records()}
        records = [r for r in records if r.id not in drop]
    return records


def _run_train(ctx: StageContext) -> None:
    from scpdr import train as T

    records = _training_records(ctx)
    tcfg = TrainSection.model_validate(ctx.stage.inputs["train"])
    goldfish = ctx.stage.inputs.get("goldfish")
    config = _train_config(T, tcfg, goldfish=goldfish, seed=int(ctx.stage.inputs["seed"]))
    T.finetune(records, base=_base_ref(ctx), config=config, out=ctx.dir / "model")


def _train_config(
    T: Any, tcfg: TrainSection, *, goldfish: Mapping[str, Any] | None, seed: int
) -> Any:
    """Map the experiment's train section onto ``scpdr.train.TrainConfig``."""
    fields: dict[str, Any] = {
        "lora": tcfg.lora,
        "grad_accum": tcfg.grad_accum,
        "seq_len": tcfg.seq_len,
        "warmup_steps": tcfg.warmup_steps,
        "max_grad_norm": tcfg.max_grad_norm,
        "lora_r": tcfg.lora_r,
        "lora_alpha": tcfg.lora_alpha,
        "lora_dropout": tcfg.lora_dropout,
        "seed": seed,
        "progress": False,
    }
    for name in ("epochs", "learning_rate", "batch_size", "packing", "neftune_alpha"):
        value = getattr(tcfg, name)
        if value is not None:
            fields[name] = value
    if tcfg.max_steps is not None:
        fields["max_steps"] = tcfg.max_steps
    if goldfish is not None:
        fields.update(goldfish=True, goldfish_k=goldfish["k"], goldfish_h=goldfish["h"])
    fields.update(tcfg.extra)
    try:
        return T.TrainConfig(**fields)
    except ValueError as exc:
        raise ConfigError(f"train: {exc}") from None


def _validation_texts(pset: Any, n: int | None = None) -> list[str]:
    texts = [r.text for r in pset.validation]
    return texts[:n] if n is not None else texts


def _run_bundle(ctx: StageContext) -> None:
    from scpdr.models import constant_base_vector, load_model, load_tokenizer, write_bundle

    pset = _load_pset(ctx.dep("partitions"))
    base = _base_ref(ctx)
    prompts = _validation_texts(pset, int(ctx.stage.inputs["n_constant_prompts"]))
    base_model = load_model(base)
    vec = constant_base_vector(base_model, load_tokenizer(base), prompts)
    del base_model
    k = sum(1 for r in ctx.deps if re.fullmatch(r"c\d+", r))
    write_bundle(
        ctx.dir / "bundle",
        base=base,
        constituents=[ctx.dep(f"c{i}") / "model" for i in range(k)],
        partition_manifest_hash=pset.manifest.sha256(),
        audit=read_json(ctx.dep("partitions") / "audit.json"),
        constant_base=vec,
        extra={"experiment": ctx.config.name},
    )


def _run_ref_bundle(ctx: StageContext) -> None:
    from scpdr.models import load_constant_base, read_bundle, write_bundle

    main = ctx.dep("main") / "bundle"
    manifest = read_bundle(main)
    k = sum(1 for r in ctx.deps if re.fullmatch(r"c\d+", r))
    write_bundle(
        ctx.dir / "bundle",
        base=manifest.resolve(main, manifest.base) if manifest.base else None,
        constituents=[ctx.dep(f"c{i}") / "model" for i in range(k)],
        constant_base=load_constant_base(main, manifest),
        extra={"experiment": ctx.config.name, "reference_for": str(main)},
    )


# ----------------------------------------------------------------------------- scorers


_MODEL_CACHE_SIZE = 6


def _cached_model(ctx: StageContext, ref: str) -> Any:
    """Load a model once per run (stages of one corpus share constituents); small LRU."""
    from collections import OrderedDict

    from scpdr.models import load_model

    cache: OrderedDict[str, Any] = ctx.runner.cache.setdefault("models", OrderedDict())
    if ref in cache:
        cache.move_to_end(ref)
        return cache[ref]
    model = load_model(ref)
    model.eval()
    cache[ref] = model
    while len(cache) > _MODEL_CACHE_SIZE:
        cache.popitem(last=False)
    return model


def _cached_tokenizer(ctx: StageContext, ref: str) -> Any:
    from scpdr.models import load_tokenizer

    cache: dict[str, Any] = ctx.runner.cache.setdefault("tokenizers", {})
    if ref not in cache:
        cache[ref] = load_tokenizer(ref)
    return cache[ref]


def _scorer(
    ctx: StageContext, method: str, bundle_dir: Path, *, m: int, single: Path | None = None
) -> Any:
    """The scorer of a result-row method over a bundle: a ``ProtectedLM``.

    ``single``: a model dir evaluated alone (goldfish baseline; a reference p0 for "none").
    """
    from scpdr.models import load_constant_base, read_bundle
    from scpdr.protected import ProtectedLM

    manifest = read_bundle(bundle_dir)
    tok = _cached_tokenizer(ctx, manifest.resolve(bundle_dir, manifest.tokenizer))
    if single is not None:
        return ProtectedLM.from_model(_cached_model(ctx, str(single)), tok)
    refs = [manifest.resolve(bundle_dir, r) for r in manifest.constituents]
    if method == "none":
        return ProtectedLM.from_model(_cached_model(ctx, refs[0]), tok)
    pm, variant = METHOD_SPECS[method]
    constituents = [_cached_model(ctx, r) for r in refs]
    base_model = base_vector = None
    if pm in ("scp-delta-r", "scp-delta"):
        if variant == "constant":
            base_vector = load_constant_base(bundle_dir, manifest)
        else:
            if manifest.base is None:
                raise ScpdrError(f"bundle {bundle_dir} has no base model for {method}")
            base_model = _cached_model(ctx, manifest.resolve(bundle_dir, manifest.base))
    return ProtectedLM(
        constituents, tok, base_model=base_model, base_vector=base_vector, method=pm, m=m
    )


def _subset(items: Sequence[Any], n: int | None, *, seed: int, salt: str) -> list[Any]:
    import random

    items = list(items)
    if n is None or n >= len(items):
        return items
    rng = random.Random(f"{salt}:{seed}")
    idx = sorted(rng.sample(range(len(items)), n))
    return [items[i] for i in idx]


def _non_canary(pset: Any, part: int = 0) -> list[Any]:
    canary_ids = {r.id for r in pset.canaries.records()} if pset.canaries is not None else set()
    return [r for r in pset.parts[part] if r.id not in canary_ids]


def _pii_records(records: Sequence[Any]) -> list[Any]:
    from scpdr.attacks.pii import PIIRecord

    out = []
    for r in records:
        match = re.fullmatch(r"Name: (.+), ID:", r.prompt or "")
        if match and r.response:
            out.append(PIIRecord(name=match.group(1), id=r.response.strip()))
    return out


# ----------------------------------------------------------------------------- attacks


def _run_attack(ctx: StageContext) -> None:
    import torch

    inp = ctx.stage.inputs
    method, attack, corpus = inp["method"], inp["attack"], inp["corpus"]
    bundle_dir = ctx.dep("bundle") / "bundle"
    pset = _load_pset(ctx.dep("partitions"))
    m = int(inp.get("m", ctx.config.m))
    single = ctx.dep("goldfish") / "model" if method == "goldfish" else None
    scorer = _scorer(ctx, method, bundle_dir, m=m, single=single)
    bs = int(inp["batch_size"])
    seed = int(inp["seed"])
    acfg = inp["config"]
    rows: list[dict[str, Any]] = []

    def add(result_rows: Iterable[Any], *, as_method: str = method) -> None:
        for r in result_rows:
            d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
            d["method"] = as_method
            d["corpus"] = corpus
            rows.append(d)

    with torch.inference_mode():
        if attack == "canary":
            rows += _attack_canary(
                scorer,
                pset,
                method=method,
                corpus=corpus,
                n_reference=acfg["n_reference"],
                bs=bs,
                seed=seed,
            )
        elif attack == "pii":
            targets = _subset(_pii_records(_non_canary(pset)), acfg["n"], seed=seed, salt="pii")
            if not targets:
                raise ConfigError(f"corpora.{corpus}: no 'Name: …, ID:' records for the PII attack")
            from scpdr.attacks.pii import pii_extraction

            add(pii_extraction(scorer, targets, batch_size=bs).rows(method=method, corpus=corpus))
            if method == "none":
                val = _subset(
                    _pii_records(pset.validation), acfg["n_val"], seed=seed, salt="pii-val"
                )
                if val:
                    res = pii_extraction(scorer, val, batch_size=bs)
                    add(res.rows(method="none-val", corpus=corpus), as_method="none-val")
        elif attack == "tte":
            from scpdr.attacks.tte import token_by_token_extraction

            texts = [r.text for r in _subset(_non_canary(pset), acfg["n"], seed=seed, salt="tte")]
            q = None
            if acfg["q_fails_only"]:
                q = _scorer(ctx, "none", bundle_dir, m=m, single=_constituent_dir(bundle_dir, 1))
            add(
                token_by_token_extraction(scorer, texts, q_scorer=q, batch_size=bs).rows(
                    method=method, corpus=corpus
                )
            )
            if method == "none":
                val = [
                    r.text for r in _subset(pset.validation, acfg["n"], seed=seed, salt="tte-val")
                ]
                res = token_by_token_extraction(scorer, val, q_scorer=q, batch_size=bs)
                add(res.rows(method="none-val", corpus=corpus), as_method="none-val")
        elif attack == "utility":
            from scpdr.attacks.utility import utility

            texts = [r.text for r in _subset(pset.validation, acfg["n"], seed=seed, salt="utility")]
            add(utility(scorer, texts, batch_size=bs).rows(method=method, corpus=corpus))
        elif attack == "lira":
            _attack_lira(
                ctx, scorer, pset, method=method, m=m, acfg=acfg, bs=bs, seed=seed, add=add
            )
        elif attack == "generations":
            _attack_generations(ctx, scorer, pset, method=method, acfg=acfg, seed=seed)
        else:  # pragma: no cover - the config validates attack names
            raise ConfigError(f"unknown attack {attack!r}")
    atomic_write_json(ctx.dir / ROWS_NAME, rows)


def _constituent_dir(bundle_dir: Path, i: int) -> Path:
    from scpdr.models import read_bundle

    manifest = read_bundle(bundle_dir)
    return Path(manifest.resolve(bundle_dir, manifest.constituents[i]))


def _attack_canary(
    scorer: Any, pset: Any, *, method: str, corpus: str, n_reference: int, bs: int, seed: int
) -> list[dict[str, Any]]:
    from scpdr.attacks.exposure import Canary, CanarySpace, canary_exposure
    from scpdr.data import load_wordlist

    registry = pset.canaries
    if registry is None:
        raise ConfigError(f"corpora.{corpus}: the canary attack needs `canaries:` in the corpus")
    space = CanarySpace(words=tuple(load_wordlist()), n_words=registry.config.num_words)
    canaries = [
        Canary(prefix=c.prompt, secret=tuple(c.words), repetitions=c.repetitions)
        for c in registry.canaries
    ]
    res = canary_exposure(
        scorer, canaries, space, n_reference=n_reference, batch_size=bs, seed=seed
    )
    rows = []
    for r in res.rows(method=method, corpus=corpus):
        d = r.to_dict()
        d["corpus"] = corpus
        if d.get("baseline") or d.get("repetitions") == 0:
            # Never-inserted canaries: the random-canary baseline. Under No CP this is the
            # paper's "No CP-val" canary value; other methods' baselines are not reported.
            if method != "none":
                continue
            d["method"] = "none-val"
            d["metric"] = str(d["metric"]).removeprefix("baseline_")
            d["repetitions"] = 0
        rows.append(d)
    return rows


def _attack_lira(
    ctx: StageContext,
    scorer: Any,
    pset: Any,
    *,
    method: str,
    m: int,
    acfg: Mapping[str, Any],
    bs: int,
    seed: int,
    add: Callable[..., None],
) -> None:
    from scpdr.attacks.lira import lira

    ref_bundle = ctx.dep("ref_bundle") / "bundle"
    if method in ("none", "goldfish"):
        reference = _scorer(ctx, "none", ref_bundle, m=m, single=ctx.dep("reference") / "model")
    else:
        reference = _scorer(ctx, method, ref_bundle, m=m)
    holdout = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
    # Records, not texts: LiRA then scores a prompted example's response given its prompt (the
    # paper's r1(y|x) / r0(y|x); Names2IDs: the ID given "Name: <name>, ID:"), text-only
    # records whole.
    members = [r for r in pset.parts[0] if r.id in holdout]
    n = acfg["n"] or len(members)
    members = _subset(members, n, seed=seed, salt="lira-members")
    nonmembers = _subset(pset.validation, len(members), seed=seed, salt="lira-non")
    res = lira(scorer, reference, members, nonmembers, batch_size=bs)
    add(res.rows(method=method, corpus=ctx.stage.inputs["corpus"]))
    fpr, tpr = res.roc()
    atomic_write_json(
        ctx.dir / "roc.json",
        {"fpr": [float(x) for x in fpr], "tpr": [float(x) for x in tpr], "auc": float(res.auc)},
    )


def _attack_generations(
    ctx: StageContext, scorer: Any, pset: Any, *, method: str, acfg: Mapping[str, Any], seed: int
) -> None:
    records = [r for r in _non_canary(pset) if r.prompt]
    if not records:  # text-only corpora: the first half of the text is the prompt
        records = _non_canary(pset)
    chosen = _subset(records, acfg["n"], seed=seed, salt="generations")
    prompts, refs = [], []
    for r in chosen:
        if r.prompt:
            prompts.append(r.prompt)
            refs.append(r.response or "")
        else:
            cut = max(1, len(r.text) // 2)
            prompts.append(r.text[:cut])
            refs.append(r.text[cut:])
    gens = scorer.generate(prompts, max_new_tokens=int(acfg["max_new_tokens"]), temperature=0.0)
    atomic_write_json(
        ctx.dir / "generations.json",
        [
            {"prompt": p, "reference": ref, "text": g.text, "method": method}
            for p, ref, g in zip(prompts, refs, gens, strict=True)
        ],
    )


# ----------------------------------------------------------------------------- bounds


DISTRIBUTIONS_NAME = "distributions.npz"


def _run_bounds(ctx: StageContext) -> None:
    """Per-position k_x / t_x (typical tokens: partition-0 training text), v_x(y_s) (the held-out
    targets of the reference p0) and all three on the canaries' secret tokens (rare tokens),
    for every NAF method (``scpdr.attacks.bounds_analysis``)."""
    import numpy as np
    import torch

    from scpdr.attacks.bounds_analysis import bound_distributions
    from scpdr.attacks.scorer import encode
    from scpdr.models import load_constant_base, read_bundle

    inp = ctx.stage.inputs
    bcfg = BoundsConfig.model_validate(inp["bounds"])
    bundle_dir = ctx.dep("bundle") / "bundle"
    pset = _load_pset(ctx.dep("partitions"))
    corpus, seed, m = inp["corpus"], int(inp["seed"]), int(inp["m"])
    methods = list(inp["methods"])
    bs = max(1, min(int(inp["batch_size"]), 4))
    scorer = _scorer(ctx, "scp-delta-r-b", bundle_dir, m=m)
    base_vector = load_constant_base(bundle_dir, read_bundle(bundle_dir))
    ref = None
    if "ref_bundle" in ctx.deps:
        ref = _scorer(ctx, "cp-delta", ctx.dep("ref_bundle") / "bundle", m=m)
    tx = ["t_x"] if bcfg.t_x else []
    common = {"methods": methods, "m": m, "base_vector": base_vector, "batch_size": bs}
    rows: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}

    def keep(dist: Any, *, rare: bool) -> None:
        rows.extend(r.to_dict() | {"corpus": corpus} for r in dist.rows(corpus=corpus, rare=rare))
        for q, per in dist.as_report_distributions(rare=rare).items():
            for method, vals in per.items():
                key = f"{q}/{method}"
                prev = arrays.get(key)
                new = np.asarray(vals, dtype=np.float64)
                arrays[key] = new if prev is None else np.concatenate([prev, new])

    with torch.inference_mode():
        texts = [
            r.text for r in _subset(_non_canary(pset), bcfg.n_prompts, seed=seed, salt="bounds")
        ]
        keep(bound_distributions(scorer, texts, quantities=["k_x", *tx], **common), rare=False)
        if bcfg.v_x and ref is not None:
            holdout = set(read_json(ctx.dep("partitions") / TARGETS_NAME)["holdout"])
            targets = [r.text for r in pset.parts[0] if r.id in holdout]
            if targets:
                dist = bound_distributions(
                    scorer, targets, quantities=["v_x"], ref_scorer=ref, **common
                )
                keep(dist, rare=False)
        if pset.canaries is not None and pset.canaries.inserted:
            tok = scorer.tokenizer
            canaries = list(pset.canaries.inserted)
            starts = [len(encode(tok, c.prompt)) for c in canaries]
            quantities = ["k_x", *tx, *(["v_x"] if bcfg.v_x and ref is not None else [])]
            dist = bound_distributions(
                scorer,
                [c.text for c in canaries],
                quantities=quantities,
                ref_scorer=ref if "v_x" in quantities else None,
                start=starts,
                **common,
            )
            keep(dist, rare=True)
    np.savez_compressed(ctx.dir / DISTRIBUTIONS_NAME, **arrays)
    atomic_write_json(ctx.dir / ROWS_NAME, rows)


# ----------------------------------------------------------------------------- report


def _run_report(ctx: StageContext) -> None:
    import numpy as np

    from scpdr.report import ReportInputs, render_report

    inp = ctx.stage.inputs
    tags: dict[str, dict[str, Any]] = inp["tags"]
    rows: list[dict[str, Any]] = []
    distributions: dict[str, dict[str, dict[str, Any]]] = {}
    roc: dict[str, dict[str, dict[str, Any]]] = {}
    generations: dict[tuple[str, str], dict[str, Any]] = {}
    for role, path in ctx.deps.items():
        tag = tags.get(role, {})
        name = role.split(":", 1)[1] if tag else role
        stage_rows = read_json(path / ROWS_NAME) if (path / ROWS_NAME).exists() else []
        rows += [{**r, **tag} for r in stage_rows]
        if tag:
            continue  # figures and generations come from the main run
        parts = name.split("/")
        if parts[0] == "bounds" and (path / DISTRIBUTIONS_NAME).exists():
            with np.load(path / DISTRIBUTIONS_NAME) as npz:
                for key in npz.files:
                    quantity, method = key.split("/", 1)
                    distributions.setdefault(parts[1], {}).setdefault(quantity, {})[method] = npz[
                        key
                    ]
        if parts[0] == "attack" and parts[3] == "lira" and (path / "roc.json").exists():
            roc.setdefault(parts[1], {})[parts[2]] = read_json(path / "roc.json")
        if parts[0] == "attack" and parts[3] == "generations":
            for i, g in enumerate(read_json(path / "generations.json")):
                entry = generations.setdefault(
                    (parts[1], f"{i:04d}"),
                    {
                        "corpus": parts[1],
                        "prompt": g["prompt"],
                        "reference": g["reference"],
                        "outputs": {},
                    },
                )
                entry["outputs"][parts[2]] = g["text"]
    atomic_write_json(ctx.dir / "results.json", rows)
    render_report(
        ReportInputs(
            rows=rows,
            title=inp["title"],
            corpus_labels=inp["labels"],
            methods=inp["methods"],
            summary=inp["summary"],
            distributions=distributions,
            roc=roc,
            generations=[generations[k] for k in sorted(generations)],
            generation_methods=inp["generation_methods"],
            config_text=inp.get("config_text"),
        ),
        ctx.dir,
        draw=bool(inp["report"]["plots"]),
    )
