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

__all__ = [
    "ATTACKS",
    "BUILTIN_CORPORA",
    "GOLDFISH",
    "REQUESTABLE_METHODS",
    "AttacksConfig",
    "BaselinesConfig",
    "BoundsConfig",
    "CanaryAttackConfig",
    "CanaryConfig",
    "CorpusConfig",
    "GenerationsConfig",
    "GoldfishConfig",
    "LiraAttackConfig",
    "PIIAttackConfig",
    "PartitionConfig",
    "ReferenceConfig",
    "ReportConfig",
    "Section",
    "SweepConfig",
    "TTEAttackConfig",
    "TrainSection",
    "UtilityAttackConfig",
]

#: Result rows a config's ``methods`` may name (aliases resolve to their row): every NAF rule
#: over a bundle's constituents. Training-time baselines are switched on under ``baselines:``.
REQUESTABLE_METHODS: tuple[str, ...] = tuple(n for n, s in M.SPECS.items() if s.kind == "aggregate")
#: The one training-time baseline (Hans et al. 2024's goldfish loss): its result row, and the name
#: of its section under ``baselines:`` and of its training stage.
(GOLDFISH,) = M.BASELINE_METHODS

#: The attack names of a corpus: the evaluation pipeline's (``scpdr.attacks.evaluation.ATTACKS``)
#: and "generations" (greedy continuations side by side, no rows).
ATTACKS: tuple[str, ...] = ("canary", "pii", "tte", "lira", "utility", "generations")
BUILTIN_CORPORA: tuple[str, ...] = ("names2ids", "pycode", "pydocs")
_DEFAULT_ATTACKS: dict[str, tuple[str, ...]] = {
    "names2ids": ("pii", "tte", "lira", "utility", "generations"),
    "pycode": ("tte", "lira", "utility", "generations"),
    "pydocs": ("tte", "lira", "utility", "generations"),
}
_DEFAULT_LABELS = {"names2ids": "IDs", "pycode": "Code", "pydocs": "Docs"}


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CanaryConfig(Section):
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


class PartitionConfig(Section):
    """K disjoint partitions, near-duplicates kept together (MinHash LSH)."""

    k: int = Field(2, ge=2, description="number of partitions = constituents (K)")
    near_duplicate_threshold: float = Field(
        0.7, gt=0.0, lt=1.0, description="shingle Jaccard at or above which records are grouped"
    )
    num_perm: int = Field(128, ge=16, description="MinHash permutations")
    allow_overlap: bool = Field(
        False, description="bundle even if the audit finds overlaps (recorded in the bundle)"
    )


class TrainSection(Section):
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


class ReferenceConfig(Section):
    """The reference model p0 (trained on partition 0 minus ``holdout`` examples) that LiRA and
    v_x (Theorem 4.2, r0 = CP(p0, q)) need; the held-out examples are the attack targets."""

    enabled: bool | None = Field(
        None, description="train p0; default: when lira or v_x is requested"
    )
    holdout: int = Field(8, ge=1, description="partition-0 examples left out of p0 (the targets)")


class GoldfishConfig(Section):
    """Goldfish loss (Hans et al. 2024): drop every k-th token (hashed context of h tokens)."""

    k: int = Field(4, ge=2, description="drop one token in k from the loss")
    h: int = Field(13, ge=1, description="context width of the hash")


class BaselinesConfig(Section):
    goldfish: GoldfishConfig | None = Field(
        None,
        description="also train partition 0 with goldfish loss; evaluated as the Goldfish row",
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


class LiraAttackConfig(Section):
    n: int | None = Field(None, ge=1, description="members/non-members each (default: holdout)")


class UtilityAttackConfig(Section):
    n: int | None = Field(None, ge=1, description="validation examples (null: all)")


class GenerationsConfig(Section):
    n: int = Field(3, ge=1, description="training prompts shown side by side")
    max_new_tokens: int = Field(24, ge=1, description="tokens generated per prompt")
    methods: list[str] = Field(
        default_factory=lambda: ["none", M.canonical("scp-delta-r")],  # No CP vs SCP-Δr-b
        description="methods compared",
    )


class AttacksConfig(Section):
    batch_size: int = Field(16, ge=1, description="sequences per scoring/generation batch")
    canary: CanaryAttackConfig = Field(default_factory=CanaryAttackConfig)
    pii: PIIAttackConfig = Field(default_factory=PIIAttackConfig)
    tte: TTEAttackConfig = Field(default_factory=TTEAttackConfig)
    lira: LiraAttackConfig = Field(default_factory=LiraAttackConfig)
    utility: UtilityAttackConfig = Field(default_factory=UtilityAttackConfig)
    generations: GenerationsConfig = Field(default_factory=GenerationsConfig)


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


class ReportConfig(Section):
    title: str | None = Field(None, description="report title (default: the experiment name)")
    plots: bool = Field(True, description="draw the plots")
