"""The sections of an experiment config (``configs/*.yaml``, ``docs/experiments.md``): pydantic
models with ``extra="forbid"``, every field with its help text and bounds (STYLE.md 6, after PEFT
``tuners/*/config.py``). :class:`scpdr.experiment.config.ExperimentConfig` assembles them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scpdr import methods as M
from scpdr.data import CanaryConfig, GroupingConfig
from scpdr.training import TrainConfig

__all__ = [
    "ATTACKS",
    "BUILTIN_CORPORA",
    "GOLDFISH",
    "REQUESTABLE_METHODS",
    "STAGE_KINDS",
    "AttacksConfig",
    "BaselinesConfig",
    "BoundsConfig",
    "BudgetAttackConfig",
    "CanaryAttackConfig",
    "CorpusConfig",
    "DPBaselinesConfig",
    "GenerationsConfig",
    "GoldfishConfig",
    "MiaAttackConfig",
    "PIIAttackConfig",
    "PartitionConfig",
    "ReferenceConfig",
    "ReportConfig",
    "ResourceRequest",
    "Section",
    "SweepConfig",
    "TTEAttackConfig",
    "UtilityAttackConfig",
]

#: Result rows a config's ``methods`` may name (aliases resolve to their row): every NAF rule
#: over a bundle's constituents. Training-time baselines are switched on under ``baselines:``.
REQUESTABLE_METHODS: tuple[str, ...] = M.AGGREGATE_METHODS
#: The goldfish-loss baseline (Hans et al. 2024): its result row, and the name of its section
#: under ``baselines:`` and of its training stage.
GOLDFISH = M.GOLDFISH

#: The attack names of a corpus: the evaluation pipeline's (``scpdr.attacks.evaluation.ATTACKS``)
#: and "generations" (greedy continuations side by side, no rows). "mia" is the membership-
#: inference suite (LiRA included); "lira" is accepted as its older name.
ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "mia", "utility", "generations", "budget")
_ATTACK_ALIASES = {"lira": "mia"}
BUILTIN_CORPORA: tuple[str, ...] = ("names2ids", "pycode", "pydocs")
#: The kinds of stages (``resources:`` keys; :data:`scpdr.experiment.cache.STAGE_VERSIONS`).
STAGE_KINDS: tuple[str, ...] = ("partitions", "train", "bundle", "attack", "bounds", "report")
_DEFAULT_ATTACKS: dict[str, tuple[str, ...]] = {
    "names2ids": ("pii", "tte", "mia", "utility", "generations"),
    "pycode": ("tte", "mia", "utility", "generations"),
    "pydocs": ("tte", "mia", "utility", "generations"),
}
_DEFAULT_LABELS = {"names2ids": "IDs", "pycode": "Code", "pydocs": "Docs"}


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CorpusConfig(Section):
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
    canaries: CanaryConfig | None = Field(
        None, description="insert canaries into this corpus (scpdr.data.CanaryConfig)"
    )
    attacks: list[str] | None = Field(
        None,
        description="attacks run on this corpus; default: pii (names2ids only), tte, mia, "
        "utility, generations, plus canary when canaries are inserted ('lira' = 'mia')",
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
        bad = [a for a in v if a not in ATTACKS and a not in _ATTACK_ALIASES]
        if bad:
            raise ValueError(f"unknown attack(s) {bad}; known: {list(ATTACKS)}")
        return list(dict.fromkeys(_ATTACK_ALIASES.get(a, a) for a in v))

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
            _DEFAULT_ATTACKS.get(self.resolved_source, ("tte", "mia", "utility", "generations"))
        )
        if self.canaries is not None:
            out.insert(0, "canary")
        return out


class PartitionConfig(GroupingConfig):
    """K disjoint partitions, near-duplicates kept together: the number of partitions, the audit
    override, and the fields of :class:`scpdr.data.GroupingConfig` (MinHash LSH; ``threshold``,
    ``num_perm``, ...), the settings of :func:`scpdr.data.prepare_partitions`."""

    k: int = Field(2, ge=2, description="number of partitions = constituents (K)")
    allow_overlap: bool = Field(
        False, description="bundle even if the audit finds overlaps (recorded in the bundle)"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # `threshold` was `near_duplicate_threshold` before it became GroupingConfig's field
        if isinstance(data, dict) and "near_duplicate_threshold" in data:
            data = dict(data)
            data.setdefault("threshold", data.pop("near_duplicate_threshold"))
        return data

    @property
    def grouping(self) -> GroupingConfig:
        """The near-duplicate grouping settings alone."""
        return GroupingConfig(**self.model_dump(include=set(GroupingConfig.model_fields)))


class ReferenceConfig(Section):
    """The reference model p0 (trained on partition 0 minus ``holdout`` examples) that LiRA and
    v_x (Theorem 4.2, r0 = CP(p0, q)) need; the held-out examples are the attack targets."""

    enabled: bool | None = Field(
        None,
        description="train p0; default: when mia or v_x is requested (without p0, LiRA's "
        "reference is q alone: Thm 4.4)",
    )
    holdout: int = Field(8, ge=1, description="partition-0 examples left out of p0 (the targets)")


class GoldfishConfig(Section):
    """Goldfish loss (Hans et al. 2024): drop every k-th token (hashed context of h tokens). The
    fields, defaults and bounds of :class:`scpdr.training.TrainConfig`'s ``goldfish_k`` /
    ``goldfish_h``."""

    k: int = TrainConfig.model_fields["goldfish_k"]
    h: int = TrainConfig.model_fields["goldfish_h"]

    def train_fields(self) -> dict[str, Any]:
        """The :class:`~scpdr.training.TrainConfig` fields that switch this baseline on."""
        return {"goldfish": True, "goldfish_k": self.k, "goldfish_h": self.h}


class DPBaselinesConfig(Section):
    """The DP-SGD baselines (:mod:`scpdr.training.dp`, rows :data:`scpdr.methods.DP_METHODS`):
    one LoRA model trained with DP on all partitions together at each row's ε (what a user would
    deploy instead), and SCP-Δr-b over K constituents each trained with DP on its partition. The
    ``train`` section's settings, with LoRA, one record per sequence and no accumulation (what
    DP needs); ``delta`` and ``max_grad_norm`` are :class:`~scpdr.training.TrainConfig`'s
    ``dp_delta`` / ``dp_max_grad_norm``. ``learning_rate`` replaces the ``train`` section's for
    these models only: DP-SGD's clipped, noised gradients need a larger step than the
    non-private fine-tuning it is compared with (what DP-LoRA recipes use)."""

    methods: list[str] = Field(
        default_factory=lambda: list(M.DP_METHODS),
        description="the DP rows trained and evaluated (default: all of them)",
    )
    delta: float | None = TrainConfig.model_fields["dp_delta"]
    max_grad_norm: float = TrainConfig.model_fields["dp_max_grad_norm"]
    learning_rate: float | None = Field(
        None, gt=0, description="peak learning rate of the DP models (default: the train section's)"
    )

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if M.canonical(m) not in M.DP_METHODS]
        if bad:
            raise ValueError(f"unknown DP row(s) {bad}; known: {list(M.DP_METHODS)}")
        return list(dict.fromkeys(M.canonical(m) for m in v))

    def train_fields(self, method: str) -> dict[str, Any]:
        """The :class:`~scpdr.training.TrainConfig` fields that train ``method``'s models."""
        return {
            "dp_epsilon": M.SPECS[method].dp_epsilon,
            "dp_delta": self.delta,
            "dp_max_grad_norm": self.max_grad_norm,
            "lora": True,
            "packing": False,
            "grad_accum": 1,
        } | ({} if self.learning_rate is None else {"learning_rate": self.learning_rate})


class BaselinesConfig(Section):
    goldfish: GoldfishConfig | None = Field(
        None,
        description="also train partition 0 with goldfish loss; evaluated as the Goldfish row",
    )
    dp: DPBaselinesConfig | None = Field(
        None,
        description="also train the DP-SGD baselines (one model on all partitions at ε = 1 and "
        "8; SCP-Δr-b over constituents trained at ε = 8); needs the `dp` extra",
    )


class CanaryAttackConfig(Section):
    n_reference: int = Field(
        10_000, ge=100, description="random reference candidates for the exposure extrapolation"
    )


class PIIAttackConfig(Section):
    n: int | None = Field(None, ge=1, description="names attacked (default: the target partition)")
    n_val: int | None = Field(None, ge=1, description="validation names (No CP-val)")


class TTEAttackConfig(Section):
    n: int | None = Field(64, ge=1, description="training examples attacked (null: all)")
    q_fails_only: bool = Field(
        False, description="only tokens the other constituent fails to predict (paper Fig. 4b)"
    )


class MiaAttackConfig(Section):
    """The membership-inference suite (``scpdr.attacks.mia``): loss, zlib, Min-K%, Min-K%++, ref
    (reference: the base model) and LiRA (reference: the method over p0) on the same members
    and non-members."""

    n: int | None = Field(None, ge=1, description="members and non-members each (null: all)")
    population: str = Field(
        "auto",
        description="'canaries' (membership canaries inserted once vs never: `canaries.members`), "
        "'records' (partition-0 records vs validation records), 'auto' (canaries when inserted)",
    )
    k: float = Field(0.2, gt=0, le=1, description="fraction of lowest tokens Min-K% averages")

    @field_validator("population")
    @classmethod
    def _population(cls, v: str) -> str:
        if v not in ("auto", "canaries", "records"):
            raise ValueError(f"must be 'auto', 'canaries' or 'records', got {v!r}")
        return v


class UtilityAttackConfig(Section):
    n: int | None = Field(None, ge=1, description="validation examples (null: all)")


class BudgetAttackConfig(Section):
    """The budget sweep (attack ``budget``, ``docs/accountant.md``): PII AEL/FER, ``ref``/``lira``
    TPR@1% FPR, next-token accuracy and tokens per answer, each example one response held to
    each budget (nats; null = no budget)."""

    budgets: list[float | None] = Field(
        default_factory=lambda: [1.0, 2.0, 5.0, 10.0, 20.0, None],
        min_length=1,
        description="the budgets swept, in nats per example (null: no budget)",
    )
    pii_n: int | None = Field(None, ge=1, description="names attacked (null: the partition's)")
    mia_n: int | None = Field(
        None, ge=1, description="members and non-members each (null: the holdout / all)"
    )
    utility_n: int | None = Field(64, ge=1, description="validation texts echoed (null: all)")
    answer_n: int | None = Field(32, ge=1, description="greedy answers (validation prompts)")
    answer_prompt_tokens: int = Field(16, ge=1, description="tokens of each answer's prompt")
    answer_tokens: int = Field(32, ge=1, description="most tokens of an answer")
    max_tokens: int | None = Field(128, ge=2, description="tokens of each echoed example")
    modes: list[str] = Field(
        default_factory=lambda: ["stop"],
        min_length=1,
        description="serving modes: stop, fallback (to the base at each budget), anchor (at each "
        "of `anchors`); fallback and anchor run on variant-'b' methods only",
    )
    anchors: list[float] = Field(
        default_factory=list, description="the anchored mode's radii c, nats per token"
    )
    methods: list[str] | None = Field(
        None,
        description="methods swept (null: every evaluated method); the others keep their "
        "unbudgeted rows on the frontier",
    )

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in ("stop", "fallback", "anchor")]
        if bad:
            raise ValueError(f"modes must be among stop, fallback, anchor, got {bad}")
        return list(dict.fromkeys(v))

    @field_validator("anchors")
    @classmethod
    def _anchors(cls, v: list[float]) -> list[float]:
        bad = [c for c in v if not (0 <= c < float("inf"))]
        if bad:
            raise ValueError(f"anchors must be finite numbers of nats >= 0, got {bad}")
        return list(dict.fromkeys(float(c) for c in v))

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[float | None]) -> list[float | None]:
        bad = [b for b in v if b is not None and not (b >= 0 and b != float("inf"))]
        if bad:
            raise ValueError(f"budgets must be finite numbers of nats >= 0 or null, got {bad}")
        return list(dict.fromkeys(v))


class GenerationsConfig(Section):
    n: int = Field(3, ge=1, description="training prompts shown side by side")
    max_new_tokens: int = Field(24, ge=1, description="tokens generated per prompt")
    methods: list[str] = Field(
        default_factory=lambda: ["none", M.canonical("scp-delta-r")],  # No CP vs SCP-Δr-b
        description="methods compared",
    )


class AttacksConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # `mia` was `lira` while LiRA was the only membership attack
        if isinstance(data, dict) and "lira" in data:
            data = dict(data)
            if "mia" in data:
                raise ValueError("give `attacks.mia` only (`attacks.lira` is its older name)")
            data["mia"] = data.pop("lira")
        return data

    batch_size: int = Field(16, ge=1, description="sequences per scoring/generation batch")
    canary: CanaryAttackConfig = Field(default_factory=CanaryAttackConfig)
    pii: PIIAttackConfig = Field(default_factory=PIIAttackConfig)
    tte: TTEAttackConfig = Field(default_factory=TTEAttackConfig)
    mia: MiaAttackConfig = Field(default_factory=MiaAttackConfig)
    utility: UtilityAttackConfig = Field(default_factory=UtilityAttackConfig)
    generations: GenerationsConfig = Field(default_factory=GenerationsConfig)
    budget: BudgetAttackConfig = Field(default_factory=BudgetAttackConfig)


class BoundsConfig(Section):
    """Per-position bound distributions: k_x (Thms 2.1/2.2), t_x (Thm 4.1), v_x (Thm 4.2)."""

    enabled: bool = Field(True, description="compute the bound distributions")
    n_prompts: int = Field(32, ge=1, description="training examples whose positions are used")
    methods: list[str] | None = Field(
        None, description="methods (default: the NAF methods of `methods`, without none/cp-fuse)"
    )
    t_x: bool = Field(True, description="also t_x")
    v_x: bool = Field(True, description="also v_x at the target tokens (needs the reference p0)")


class SweepConfig(Section):
    """A one-dimensional sweep: the experiment re-run with ``key`` set to each of ``values``."""

    key: str = Field(..., description="dotted config key, e.g. 'm' or 'train.epochs'")
    values: list[Any] = Field(..., min_length=1, description="values of the key")
    methods: list[str] | None = Field(None, description="restrict the sweep to these methods")
    attacks: list[str] | None = Field(None, description="restrict the sweep to these attacks")


class ResourceRequest(Section):
    """What one stage of a kind asks a distributed executor for (``scpdr experiment --executor
    ray``: Ray's task options of the same names); the local executor ignores it."""

    num_cpus: float = Field(1.0, ge=0, description="CPU cores per stage")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per stage (fractions share one GPU)")
    memory: int | None = Field(None, ge=0, description="memory per stage in bytes (scheduling)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per stage, e.g. {a100: 1}"
    )

    def ray_options(self) -> dict[str, Any]:
        """The request as keyword arguments of Ray's ``.options()``."""
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            out["memory"] = self.memory
        if self.resources:
            out["resources"] = dict(self.resources)
        return out


class ReportConfig(Section):
    title: str | None = Field(None, description="report title (default: the experiment name)")
    plots: bool = Field(True, description="draw the plots")
