"""The one training configuration: :class:`TrainConfig`, shared by the library (:func:`finetune`),
the experiment's YAML ``train:`` section and ``scpdr train``'s options (generated from its fields).

After PEFT's ``tuners/*/config.py`` (STYLE.md 6): every field has help text and bounds, the config
is validated at construction, and it round-trips through JSON and YAML. Fields left ``None`` mean
"the paper's default for the chosen mode" (App. E, Table 6; :data:`PAPER_DEFAULTS`); they stay
``None`` in the config (so a copy with ``lora`` switched still gets the LoRA defaults, e.g. in an
experiment sweep) and :meth:`TrainConfig.resolved` fills them in: what training uses and records.
"""

from __future__ import annotations

import hashlib
import json
import os
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scpdr.errors import ConfigError, format_validation_error
from scpdr.training.goldfish import GOLDFISH_H, GOLDFISH_K

__all__ = [
    "CPU_MAX_BATCH_TOKENS",
    "DP_FIELDS",
    "LORA_TARGET_MODULES",
    "PAPER_DEFAULTS",
    "Precision",
    "TrainConfig",
    "make_config",
]

#: The paper's LoRA target modules (App. E, Table 6).
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)

#: Paper defaults (App. E, Table 6) of the mode-dependent fields: ``{field: (full FT, LoRA)}``.
PAPER_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "epochs": (50.0, 20.0),
    "learning_rate": (5e-5, 5e-4),
    "batch_size": (1, 64),
    "neftune_alpha": (5.0, 0.0),
    "packing": (True, False),
}

#: Unpacked batches trained in bf16 are padded to a multiple of this many tokens
#: (``pad_to_multiple_of`` unset; in fp32: 1, the longest exactly:
#: :func:`scpdr.training.plan.default_pad_multiple`).
PAD_TO_MULTIPLE_OF = 16

#: Tokens one forward pass holds when training on CPU and ``max_batch_tokens`` is unset (about
#: 0.4 GB of activations for the 135M model with gradient checkpointing; 8 x 256 fits whole).
CPU_MAX_BATCH_TOKENS = 4096

#: Settings that do not change the trained weights (left out of the fingerprint); the chunked
#: loss is the same loss with the same gradients (to float rounding) as the model's own, and
#: trimming the heap only changes where freed memory goes.
NOT_IN_FINGERPRINT = (
    "progress",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "chunked_loss",
    "trim_heap",
)


class Precision(str, Enum):
    """Training precision (:mod:`scpdr.training.precision`)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"


#: The DP-SGD fields (:mod:`scpdr.training.dp`); left out of the fingerprint when DP is off, so
#: runs trained before they existed keep theirs.
DP_FIELDS = ("dp_epsilon", "dp_delta", "dp_max_grad_norm")


class TrainConfig(BaseModel):
    """Fine-tuning settings for every constituent (paper App. E, Table 6; STYLE.md 6).

    Bounds, where the copies this replaces disagreed: ``epochs`` is a float > 0 (the Trainer's
    ``num_train_epochs`` is a float; fractional epochs are useful on large corpora and for smoke
    runs); ``seq_len`` ≥ 2 (one input and one target token is what a causal-LM step needs; the
    paper's shortest setting is 25); ``max_steps`` is ``None`` (train for ``epochs``) or ≥ 1.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=True)

    lora: bool = Field(False, description="Train a LoRA adapter instead of all weights.")
    epochs: float | None = Field(
        None, gt=0, description="Training epochs, may be fractional (paper: 50 full / 20 LoRA)."
    )
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (overrides epochs)."
    )
    learning_rate: float | None = Field(
        None, gt=0, description="Peak learning rate (paper: 5e-5 full / 5e-4 LoRA)."
    )
    batch_size: int | None = Field(
        None, ge=1, description="Sequences per device per step (paper: 1 full / 64 LoRA)."
    )
    grad_accum: int = Field(1, ge=1, description="Gradient accumulation steps (paper: 1).")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps (paper: 50).")
    lr_scheduler: str = Field("linear", description="transformers lr_scheduler_type.")
    max_grad_norm: float = Field(2.0, gt=0, description="Gradient clipping norm (paper: 2.0).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    optim: str = Field(
        "adamw_torch",
        description="Optimizer; the paper used adamw_bnb_8bit (CUDA only), adamw_torch here (run "
        "as torch's fused kernel where the device has one).",
    )
    neftune_alpha: float | None = Field(
        None, ge=0, description="NEFTune noise alpha; 0 disables (paper: 5 full / none LoRA)."
    )
    seq_len: int = Field(2048, ge=2, description="Sequence length in tokens (paper: 2048).")
    packing: bool | None = Field(
        None,
        description="Concatenate examples with EOS into seq_len blocks (paper: full FT) instead "
        "of one EOS-padded example per sequence (paper: LoRA).",
    )
    lora_r: int = Field(64, ge=1, description="LoRA rank (paper: 64).")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (paper: 32).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout (paper: 0.05).")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        description="Modules that get LoRA adapters (paper: all projections and lm_head).",
    )
    merge_lora: bool = Field(
        False, description="Save the LoRA-merged full model instead of the adapter."
    )
    goldfish: bool = Field(
        False, description="Goldfish loss (Hans et al. 2024): drop hashed tokens from the loss."
    )
    goldfish_k: int = Field(GOLDFISH_K, ge=2, description="Goldfish: drop 1 in k tokens.")
    goldfish_h: int = Field(GOLDFISH_H, ge=1, description="Goldfish: hash context width (tokens).")
    seed: int = Field(0, description="Seed for model init, data order, dropout and NEFTune noise.")
    shuffle_examples: bool = Field(
        True, description="Shuffle examples (seeded) once before packing them into sequences."
    )
    save_steps: int = Field(
        200,
        ge=1,
        description="Checkpoint every this many steps, and at least once per epoch (--resume).",
    )
    save_total_limit: int = Field(1, ge=1, description="Checkpoints kept while training.")
    logging_steps: int = Field(10, ge=1, description="Log the loss every this many steps.")
    precision: Precision = Field(
        Precision.auto,
        description="auto: bf16 mixed precision (fp32 master weights) where the CPU has bf16 "
        "units (amx_bf16, avx512_bf16) and a first-use micro-benchmark finds it faster, or the "
        "GPU supports it; fp32 otherwise. fp32 or bf16 force one.",
    )
    group_by_length: bool | None = Field(
        None,
        description="Batch sequences of similar length (as transformers' group_by_length), so "
        "each batch pads little; unset: on for unpacked records, off when packing.",
    )
    pad_to_multiple_of: int | None = Field(
        None,
        ge=1,
        description="Pad each batch of unpacked records to its longest sequence rounded up to a "
        "multiple of this many tokens: fewer distinct batch shapes, so the kernels oneDNN "
        "builds and keeps per shape stay few (135M model, bf16 on CPU: peak RSS flat after 10 "
        "steps of varied lengths instead of +0.53 GiB over 40, measured; fp32 matmuls crept "
        "< 0.1 GiB either way); 1: pad to the longest exactly; unset: "
        f"{PAD_TO_MULTIPLE_OF} when training in bf16, 1 in fp32.",
    )
    chunked_loss: bool = Field(
        True,
        description="Compute lm_head and the cross-entropy in chunks of tokens, recomputed in "
        "the backward pass: memory grows with the tokens, not tokens x vocabulary.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute each layer's activations in the backward pass instead of "
        "keeping them (two thirds of the peak memory for 3-13% more time per step, measured); "
        "unset: on when training on CPU, where memory runs out first, off on a GPU.",
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens (padding included) one forward pass holds: a larger batch is "
        "split into gradient-accumulation micro-batches (the same effective batch); unset: "
        f"{CPU_MAX_BATCH_TOKENS} when training on CPU, no limit on a GPU.",
    )
    trim_heap: bool = Field(
        True,
        description="CPU: return the heap's free pages to the system inside each step (after "
        "the forward, before the optimizer step): a lower peak for a little more time per step "
        "(135M model: peak 3.25 -> 2.84 GiB for about 5% more time per step, measured); false "
        "keeps them resident.",
    )
    progress: bool = Field(
        True,
        description="Show progress: a bar on a terminal, log lines (step, loss, ETA) otherwise.",
    )
    dp_epsilon: float | None = Field(
        None,
        gt=0,
        description="Train with DP-SGD (Opacus, PRV accountant) to this epsilon over the whole "
        "run; DP trains LoRA adapters (implies --lora), one record per sequence, Poisson "
        "sampling. Needs the `dp` extra.",
    )
    dp_delta: float | None = Field(
        None, gt=0, lt=1, description="DP delta (default: 1/n, n = the constituent's records)."
    )
    dp_max_grad_norm: float = Field(
        1.0, gt=0, description="DP-SGD: each example's gradient is clipped to this L2 norm."
    )

    @field_validator("max_steps", mode="before")
    @classmethod
    def _minus_one_is_none(cls, v: Any) -> Any:
        # -1 is the Trainer's (and this config's former) spelling of "no step limit": configs
        # saved before it became None keep loading.
        return None if v == -1 else v

    @model_validator(mode="before")
    @classmethod
    def _bf16_is_precision(cls, data: Any) -> Any:
        # configs and train_info.json files written before `precision` have `bf16: bool`: true
        # is precision bf16, false what those runs trained in, fp32
        if not isinstance(data, dict) or "bf16" not in data:
            return data
        data = dict(data)
        bf16 = data.pop("bf16")
        if not isinstance(bf16, bool):
            raise ValueError(f"bf16 must be true or false, got {bf16!r} (now: precision)")
        old = "bf16" if bf16 else "fp32"
        given = data.get("precision")
        given = getattr(given, "value", given)
        if given is not None and given != old:
            raise ValueError(
                f"bf16: {str(bf16).lower()} contradicts precision: {given}; drop bf16 (it is "
                "the former spelling of precision)"
            )
        data["precision"] = old
        return data

    @model_validator(mode="before")
    @classmethod
    def _dp_implies_lora(cls, data: Any) -> Any:
        # DP-SGD trains LoRA adapters on one record per sequence: what DP forces is filled in,
        # and an explicit contradiction is an error naming the option
        if not isinstance(data, dict) or data.get("dp_epsilon") is None:
            return data  # dp_delta alone: an error after the fields' own bounds (_check)
        if data.get("lora") is False:
            raise ValueError(
                "DP training (dp_epsilon) trains LoRA adapters only: drop --no-lora / lora: false"
            )
        if data.get("packing") is True:
            raise ValueError(
                "DP training protects records, so each sequence holds one record: drop "
                "--packing / packing: true"
            )
        if data.get("grad_accum", 1) not in (1, None):
            raise ValueError(
                "DP training draws each step's batch by Poisson sampling: grad_accum must be 1 "
                "(raise --batch-size instead)"
            )
        return {**data, "lora": True, "packing": False}

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.goldfish and self.goldfish_h >= self.seq_len:
            raise ValueError(
                f"goldfish_h={self.goldfish_h} must be smaller than seq_len={self.seq_len}"
            )
        if not self.lora_target_modules:
            raise ValueError("lora_target_modules must name at least one module")
        if self.dp_delta is not None and self.dp_epsilon is None:
            raise ValueError("dp_delta without dp_epsilon does nothing; add --dp-epsilon")
        return self

    @property
    def dp(self) -> bool:
        """Whether this is a DP-SGD run (:mod:`scpdr.training.dp`)."""
        return self.dp_epsilon is not None

    # ------------------------------------------------------------------ paper defaults

    def resolved(self) -> TrainConfig:
        """A copy with every ``None`` field set to the paper's default for the mode
        (:data:`PAPER_DEFAULTS`): the settings training uses and records."""
        mode = 1 if self.lora else 0
        fill = {k: v[mode] for k, v in PAPER_DEFAULTS.items() if getattr(self, k) is None}
        return self.model_copy(update=fill) if fill else self

    @classmethod
    def paper(cls, *, lora: bool = False, **overrides: Any) -> TrainConfig:
        """The paper's settings for full fine-tuning or LoRA, with ``overrides`` (resolved)."""
        return cls(lora=lora, **overrides).resolved()

    @classmethod
    def default_text(cls, name: str) -> str | None:
        """How the default of field ``name`` reads in help text: ``"50.0 (LoRA: 20.0)"`` for a
        mode-dependent field, the value otherwise, ``None`` when there is none."""
        if name in PAPER_DEFAULTS:
            full, lora = PAPER_DEFAULTS[name]
            return f"{full} (LoRA: {lora})"
        info = cls.model_fields[name]
        value = info.get_default(call_default_factory=True)
        if value is None:
            return None
        value = getattr(value, "value", value)  # an Enum's value ("auto"), not its name
        return ", ".join(value) if isinstance(value, list) else str(value)

    # ------------------------------------------------------------------ serialization

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, what: str = "training config") -> TrainConfig:
        """Validate ``data``; a bad field raises :class:`~scpdr.errors.ConfigError` naming it."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid {what}: {format_validation_error(exc)}") from None

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls.from_dict(_parse(text, "JSON"))

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_yaml(cls, text: str) -> TrainConfig:
        return cls.from_dict(_parse(text, "YAML"))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TrainConfig:
        """Read a ``.json``, ``.yaml`` or ``.yml`` file of settings, or a finished run's
        ``train_info.json`` (its ``config``: the settings that run used)."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        data = _parse(text, "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON")
        if {"fingerprint", "config"} <= set(data) and isinstance(data["config"], dict):
            data = data["config"]  # a train_info.json
        return cls.from_dict(data)

    def fingerprint(self) -> str:
        """SHA-256 of the resolved settings that change the trained weights (not logging,
        checkpointing, progress or the chunked loss). Runs trained before ``precision`` and
        ``group_by_length`` existed keep theirs: precision counts as ``bf16: true/false``
        (``auto`` as false: :func:`~scpdr.training.finetune.finetune` adds what it resolves to)
        and ``group_by_length`` and ``pad_to_multiple_of`` only when set."""
        d = self.resolved().model_dump(mode="json")
        for k in NOT_IN_FINGERPRINT:
            d.pop(k)
        if d["dp_epsilon"] is None:
            for k in DP_FIELDS:
                d.pop(k)
        # as before `precision` and `group_by_length` existed: `bf16` (auto counts as fp32 here;
        # finetune adds the precision auto resolves to), and length grouping only when set
        d["bf16"] = d.pop("precision") == "bf16"
        if d["group_by_length"] is None:
            d.pop("group_by_length")
        if d["pad_to_multiple_of"] is None:  # likewise only when set (runs from before it)
            d.pop("pad_to_multiple_of")
        # neither changes what is learned: checkpointing recomputes the same activations, and
        # micro-batches accumulate to the same batch (kept as it was before either existed)
        d["gradient_checkpointing"] = bool(d["gradient_checkpointing"])
        if d["max_batch_tokens"] is None:
            d.pop("max_batch_tokens")
        # "no step limit" was -1 before it was None: finished runs keep their fingerprint
        d["max_steps"] = -1 if d["max_steps"] is None else d["max_steps"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _parse(text: str, fmt: str) -> dict[str, Any]:
    """``text`` (JSON or YAML) as a mapping; anything else is a :class:`ConfigError`."""
    import yaml

    try:
        data = json.loads(text) if fmt == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"invalid training config: not {fmt} ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid training config: expected a {fmt} mapping of settings")
    return data


def make_config(config: TrainConfig | dict[str, Any] | None) -> TrainConfig:
    """``config`` as a resolved :class:`TrainConfig` (``None``: the paper's full fine-tuning)."""
    if config is None:
        return TrainConfig().resolved()
    if isinstance(config, TrainConfig):
        return config.resolved()
    return TrainConfig.from_dict(dict(config)).resolved()
