"""An experiment's config: the schema (:class:`ExperimentConfig`, assembled from the sections of
:mod:`scpdr.experiment.sections`), :func:`validate_config` and :func:`load_config` (YAML, with
``extends:`` and paths relative to the config file).

``extra="forbid"`` everywhere: an unknown key or a bad value is a :class:`~scpdr.errors.ConfigError`
naming the key path and the fix, e.g. ``train.epochs: must be > 0 (got 0)``. Method names are
result-row names of :mod:`scpdr.methods`; an alias ("scp-delta-r") is stored as its row
("SCP-Δr-b").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from scpdr import methods as M
from scpdr.device import DEVICE_PATTERN
from scpdr.errors import ConfigError
from scpdr.experiment.sections import (
    ATTACKS,
    BUILTIN_CORPORA,
    GOLDFISH,
    REQUESTABLE_METHODS,
    STAGE_KINDS,
    AttacksConfig,
    BaselinesConfig,
    BoundsConfig,
    CorpusConfig,
    PartitionConfig,
    ReferenceConfig,
    ReportConfig,
    ResourceRequest,
    Section,
    SweepConfig,
)
from scpdr.training import TrainConfig

__all__ = [
    "DEFAULT_METHODS",
    "ExperimentConfig",
    "get_dotted",
    "load_config",
    "validate_config",
]

DEFAULT_METHODS: tuple[str, ...] = M.MAIN_TABLE_METHODS
"""The rows of the paper's main table (Table 3), in its order."""


class ExperimentConfig(Section):
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
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="fine-tuning of every model: scpdr.training.TrainConfig (the top-level seed "
        "seeds it)",
    )
    references: ReferenceConfig = Field(default_factory=ReferenceConfig)
    baselines: BaselinesConfig = Field(default_factory=BaselinesConfig)
    methods: list[str] = Field(default_factory=lambda: list(DEFAULT_METHODS))
    m: int = Field(10, ge=1, description="smoothing parameter m of SCP-Δr (Alg. 1)")
    attacks: AttacksConfig = Field(default_factory=AttacksConfig)
    bounds: BoundsConfig = Field(default_factory=BoundsConfig)
    sweeps: list[SweepConfig] = Field(default_factory=list, description="one-dimensional sweeps")
    report: ReportConfig = Field(default_factory=ReportConfig)
    device: str | None = Field(
        None,
        description="where the stages run models: cpu, cuda or cuda:N (default: $SCPDR_DEVICE, "
        "else cuda when available); not part of the stage hashes",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="the weights the attack, bounds and budget stages load the models in: what "
        "`scpdr serve --precision` would serve (fp32, bf16, or auto: bf16 on CUDA; on CPU bf16 "
        "where the CPU has bf16 units and they are measured faster, else fp32), resolved where "
        "the plan is made; a dtype other than the device's default is part of those stages' "
        "hashes",
    )
    resources: dict[str, ResourceRequest] = Field(
        default_factory=dict,
        description="per stage kind (partitions, train, bundle, attack, bounds, report), what a "
        "stage asks the Ray executor for, e.g. {train: {num_gpus: 1}}",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        if v is not None and not DEVICE_PATTERN.match(v):
            raise ValueError("must be cpu, cuda or cuda:N (e.g. cuda:0)")
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, ResourceRequest]) -> dict[str, ResourceRequest]:
        bad = sorted(set(v) - set(STAGE_KINDS))
        if bad:
            raise ValueError(f"unknown stage kind(s) {bad}; use {list(STAGE_KINDS)}")
        return v

    def resource_request(self, kind: str) -> ResourceRequest:
        """What a stage of ``kind`` asks a distributed executor for (default: one CPU)."""
        return self.resources.get(kind) or ResourceRequest()

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
        self._check_train()
        if "cp-fuse" in self.methods and self.partitions.k != 2:
            raise ValueError(
                f"methods: cp-fuse fuses exactly 2 constituents, but partitions.k = "
                f"{self.partitions.k}; drop cp-fuse or use k = 2"
            )
        if self.bounds.methods is not None:
            self.bounds.methods = _check_methods(self.bounds.methods, where="bounds.methods")
            if "cp-fuse" in self.bounds.methods:
                raise ValueError(
                    "bounds.methods: cp-fuse is stateful and has no per-position NAF bound; "
                    "remove it"
                )
        gen = self.attacks.generations
        gen.methods = self._evaluated(gen.methods, "attacks.generations.methods")
        budget = self.attacks.budget
        if budget.methods is not None:
            budget.methods = self._evaluated(budget.methods, "attacks.budget.methods")
        for i, s in enumerate(self.sweeps):
            if s.key.split(".")[0] in {"sweeps", "corpora", "name"}:
                raise ValueError(f"sweeps.{i}.key: {s.key!r} cannot be swept")
            try:
                get_dotted(self.model_dump(), s.key)
            except KeyError:
                raise ValueError(
                    f"sweeps.{i}.key: {s.key!r} is not a config key (use a dotted path such as "
                    "'m' or 'train.epochs')"
                ) from None
            if s.methods is not None:
                s.methods = _check_methods(s.methods, where=f"sweeps.{i}.methods")
            if s.attacks is not None and any(a not in ATTACKS for a in s.attacks):
                raise ValueError(f"sweeps.{i}.attacks: must be among {list(ATTACKS)}")
        return self

    def _check_train(self) -> None:
        """The training settings every model gets are valid ones: ``train`` (already a
        :class:`TrainConfig`) with the top-level seed, and with the goldfish baseline's fields."""
        if self.train.seed not in (0, self.seed):
            raise ValueError(
                f"train.seed: the top-level `seed` seeds training (got train.seed = "
                f"{self.train.seed}, seed = {self.seed}); set `seed:` and drop train.seed"
            )
        goldfish = self.baselines.goldfish
        if goldfish is not None:
            try:
                TrainConfig.model_validate({**self.train.model_dump(), **goldfish.train_fields()})
            except ValidationError as exc:
                msg = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(f"baselines.goldfish: {msg}") from None
        dp = self.baselines.dp
        for method in dp.methods if dp is not None else ():
            try:
                TrainConfig.model_validate({**self.train.model_dump(), **dp.train_fields(method)})
            except ValidationError as exc:
                msg = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(f"baselines.dp: {msg}") from None

    # -- derived -------------------------------------------------------------------------

    def _evaluated(self, methods: Sequence[str], where: str) -> list[str]:
        """``methods`` as their result rows, once each; an error naming ``where`` for any that
        is not evaluated."""
        out = list(dict.fromkeys(M.canonical(m) for m in methods))
        bad = [m for m in out if m not in self.all_methods]
        if bad:
            raise ValueError(
                f"{where}: {bad} are not among the evaluated methods {self.all_methods}"
            )
        return out

    @property
    def all_methods(self) -> list[str]:
        """The evaluated methods: ``methods`` plus the training-time baselines."""
        out = list(self.methods)
        if self.baselines.goldfish is not None:
            out.append(GOLDFISH)
        if self.baselines.dp is not None:
            out += self.baselines.dp.methods
        return out

    @property
    def bound_methods(self) -> list[str]:
        if self.bounds.methods is not None:
            return list(self.bounds.methods)
        # every NAF method with per-position bounds but No CP (whose k_x protects nothing)
        return [m for m in self.methods if M.SPECS[m].bounded and m != "none"]

    @property
    def needs_reference(self) -> bool:
        if self.references.enabled is not None:
            return self.references.enabled
        # LiRA's p0: the MIA suite's, and the budget sweep's lira
        mia = any({"mia", "budget"} & set(c.resolved_attacks) for c in self.corpora)
        return mia or (self.bounds.enabled and self.bounds.v_x)

    def with_value(self, key: str, value: Any) -> ExperimentConfig:
        """A copy with the dotted ``key`` set to ``value`` (validated)."""
        data = self.model_dump()
        _set_dotted(data, key, value)
        return validate_config(data)


def _check_methods(v: Sequence[str], *, where: str | None = None) -> list[str]:
    """Known, non-empty, unique method names (:data:`REQUESTABLE_METHODS`), aliases replaced by
    their result row; ``where`` prefixes the message (model validators, whose errors carry no
    key path of their own)."""
    prefix = f"{where}: " if where else ""
    known = list(REQUESTABLE_METHODS)
    bad = [m for m in v if M.canonical(m) not in REQUESTABLE_METHODS]
    if bad:
        hint = ""
        if any(M.canonical(m) in M.BASELINE_METHODS for m in bad):
            hint = " (training-time baselines are switched on under `baselines:`)"
        raise ValueError(f"{prefix}unknown method(s) {bad}{hint}; known: {known}")
    if not v:
        raise ValueError(f"{prefix}must list at least one method")
    rows = [M.canonical(m) for m in v]
    if len(set(rows)) != len(rows):
        raise ValueError(
            f"{prefix}methods repeated: {sorted({m for m in rows if rows.count(m) > 1})}"
        )
    return rows


def get_dotted(data: Mapping[str, Any], key: str) -> Any:
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


def _bound(value: Any) -> Any:
    """A bound as written in a config: ``0`` for the float bound ``0.0``."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _format_validation_error(exc: ValidationError, *, source: str | None) -> str:
    lines = []
    for err in exc.errors():
        loc = _format_loc(err["loc"])
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind in _ERROR_TEMPLATES:
            msg = _ERROR_TEMPLATES[kind].format(**{k: _bound(v) for k, v in ctx.items()})
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
