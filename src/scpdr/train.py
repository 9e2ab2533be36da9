"""Fine-tune one constituent per partition with the HF Trainer (full fine-tuning or LoRA).

Defaults follow the paper's training table (App. E, Table 6, after Abad et al. 2025): full
fine-tuning for 50 epochs at lr 5e-5 with batch 1, NEFTune α = 5, examples concatenated with EOS up
to the sequence length; LoRA (r 64, α 32, dropout 0.05 on every projection and ``lm_head``) for 20
epochs at lr 5e-4 with batch 64 and short, EOS-padded sequences; warmup 50 steps, max grad norm
2.0. CPU deviations: ``adamw_torch`` instead of ``adamw_bnb_8bit`` (bitsandbytes needs CUDA).
No separator token is added (the prompt and response are concatenated as they are, as the paper
does for LoRA), so no new embedding needs initializing.

Training-time baseline beside NAF: the goldfish loss (Hans et al. 2024) drops every ``k``-th token
(chosen by a hash of the ``h`` preceding tokens) from the loss; see :func:`goldfish_mask`.

Runs are resumable and their outputs atomic: a run trains in ``<out>.tmp-<fingerprint>``
(checkpoints every ``save_steps``); re-running the same call resumes from the last checkpoint;
the final directory (model safetensors or adapter, tokenizer, ``train_info.json``) is renamed to
``out`` at the end. The same code runs under ``accelerate launch`` on several GPUs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scpdr.data.records import Record, records_hash
from scpdr.errors import ConfigError
from scpdr.io import atomic_write_json, read_json

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

    from scpdr.data.partition import PartitionSet

logger = logging.getLogger(__name__)

__all__ = [
    "LORA_TARGET_MODULES",
    "TRAIN_INFO",
    "CausalCollator",
    "TrainConfig",
    "build_sequences",
    "finetune",
    "goldfish_mask",
    "train_bundle",
]

TRAIN_INFO = "train_info.json"
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

# Paper defaults (App. E, Table 6) by mode: (full fine-tuning, LoRA).
_PAPER = {
    "epochs": (50.0, 20.0),
    "learning_rate": (5e-5, 5e-4),
    "batch_size": (1, 64),
    "neftune_alpha": (5.0, 0.0),
    "packing": (True, False),
}


class TrainConfig(BaseModel):
    """Fine-tuning settings for one constituent (STYLE.md 6: validated, JSON round trip).

    Fields left ``None`` take the paper's default for the chosen mode (App. E, Table 6) when the
    config is built, so a saved config always holds the values actually used.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    lora: bool = Field(False, description="Train a LoRA adapter instead of all weights.")
    epochs: float | None = Field(
        None, gt=0, description="Training epochs (paper: 50 full / 20 LoRA)."
    )
    max_steps: int = Field(
        -1, description="Stop after this many optimizer steps (overrides epochs when > 0)."
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
        description="Optimizer; the paper used adamw_bnb_8bit (CUDA only), adamw_torch here.",
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
    goldfish_k: int = Field(4, ge=2, description="Goldfish: drop 1 in k tokens.")
    goldfish_h: int = Field(13, ge=1, description="Goldfish: hash context width (tokens).")
    seed: int = Field(0, description="Seed for model init, data order, dropout and NEFTune noise.")
    shuffle_examples: bool = Field(
        True, description="Shuffle examples (seeded) once before packing them into sequences."
    )
    save_steps: int = Field(200, ge=1, description="Checkpoint every this many steps (resume).")
    save_total_limit: int = Field(1, ge=1, description="Checkpoints kept while training.")
    logging_steps: int = Field(10, ge=1, description="Log the loss every this many steps.")
    bf16: bool = Field(False, description="bf16 mixed precision (GPU).")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory.")
    progress: bool = Field(True, description="Show progress bars.")

    @model_validator(mode="after")
    def _fill_paper_defaults(self) -> TrainConfig:
        mode = 1 if self.lora else 0
        for name, values in _PAPER.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, values[mode])
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError("max_steps must be -1 (use epochs) or a positive number of steps")
        if self.goldfish and self.goldfish_h >= self.seq_len:
            raise ValueError(
                f"goldfish_h={self.goldfish_h} must be smaller than seq_len={self.seq_len}"
            )
        if not self.lora_target_modules:
            raise ValueError("lora_target_modules must name at least one module")
        return self

    @classmethod
    def paper(cls, *, lora: bool = False, **overrides: Any) -> TrainConfig:
        """The paper's defaults for full fine-tuning or LoRA, with ``overrides``."""
        return cls(lora=lora, **overrides)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        try:
            return cls.model_validate_json(text)
        except ValueError as exc:
            raise ConfigError(f"invalid training config: {exc}") from None

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def fingerprint(self) -> str:
        """SHA-256 of the settings that change the trained weights (not logging or progress)."""
        d = self.model_dump(mode="json")
        for k in ("progress", "logging_steps", "save_steps", "save_total_limit"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _make_config(config: TrainConfig | dict[str, Any] | None) -> TrainConfig:
    if config is None:
        return TrainConfig()
    if isinstance(config, TrainConfig):
        return config
    try:
        return TrainConfig.model_validate(config)
    except ValueError as exc:
        raise ConfigError(f"invalid training config: {exc}") from None


# --------------------------------------------------------------------------- data preparation


def build_sequences(
    records: Sequence[Record],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    packing: bool,
    seed: int = 0,
    shuffle: bool = True,
) -> list[dict[str, list[int]]]:
    """Tokenize ``records`` (``text`` + EOS each) into training sequences.

    ``packing=True`` (paper App. E, full fine-tuning): examples concatenated with EOS and cut
    into ``seq_len`` blocks, the last block EOS-padded. ``packing=False`` (paper App. E, LoRA):
    one example per sequence, truncated to ``seq_len`` and EOS-padded to the longest example.
    Padding has ``attention_mask`` 0 and label -100; each example's own EOS is a label.

    Returns dicts with ``input_ids``, ``attention_mask``, ``labels`` (lists of equal length).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token; set tokenizer.eos_token")
    order = list(range(len(records)))
    if shuffle:
        random.Random(f"examples:{seed}").shuffle(order)
    examples = []
    for i in order:
        ids = list(tokenizer(records[i].text)["input_ids"])
        if not ids or ids[-1] != eos:
            ids.append(eos)
        examples.append(ids)
    out: list[dict[str, list[int]]] = []

    def padded(ids: list[int], length: int) -> dict[str, list[int]]:
        n = len(ids)
        return {
            "input_ids": ids + [eos] * (length - n),
            "attention_mask": [1] * n + [0] * (length - n),
            "labels": ids + [-100] * (length - n),
        }

    if packing:
        stream = [t for ids in examples for t in ids]
        for start in range(0, len(stream), seq_len):
            out.append(padded(stream[start : start + seq_len], seq_len))
    else:
        n_trunc = sum(len(ids) > seq_len for ids in examples)
        if n_trunc:
            logger.warning(
                "%d of %d examples truncated to %d tokens", n_trunc, len(examples), seq_len
            )
        length = min(seq_len, max(len(ids) for ids in examples))
        out = [padded(ids[:length], length) for ids in examples]
    return out


_GOLDFISH_KEY = b"scpdr-goldfish"


def goldfish_mask(input_ids: torch.Tensor, *, k: int, h: int) -> torch.Tensor:
    """Goldfish loss mask (Hans et al. 2024, hashed variant): ``True`` where a token is dropped.

    Position ``t`` of ``input_ids`` (``LongTensor[B, T]``) is dropped iff ``t >= h`` and
    ``H(input_ids[b, t-h:t]) mod k == 0``, where ``H`` is a keyed 64-bit BLAKE2b hash of the ``h``
    preceding token ids (int64, little endian). The first ``h`` positions (no full context) are
    always kept. The same context always drops the same next token, so repeated text loses the
    same tokens every time it is seen. Returns ``BoolTensor[B, T]``.
    """
    import torch

    if k < 2 or h < 1:
        raise ValueError(f"goldfish needs k >= 2 and h >= 1, got k={k}, h={h}")
    ids = input_ids.detach().to("cpu", torch.int64).numpy()
    B, T = ids.shape
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b in range(B):
        row = ids[b].astype("<i8")
        for t in range(h, T):
            digest = hashlib.blake2b(row[t - h : t].tobytes(), digest_size=8, key=_GOLDFISH_KEY)
            if int.from_bytes(digest.digest(), "little") % k == 0:
                mask[b, t] = True
    return mask.to(input_ids.device)


class CausalCollator:
    """Stack ``build_sequences`` features into tensors; with ``goldfish_k`` set, drop the goldfish
    positions from ``labels`` (set to -100). Never modifies the features it is given."""

    def __init__(self, *, goldfish_k: int | None = None, goldfish_h: int = 13) -> None:
        self.goldfish_k = goldfish_k
        self.goldfish_h = goldfish_h

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        batch = {
            key: torch.tensor([list(f[key]) for f in features], dtype=torch.long)
            for key in ("input_ids", "attention_mask", "labels")
        }
        if self.goldfish_k:
            drop = goldfish_mask(batch["input_ids"], k=self.goldfish_k, h=self.goldfish_h)
            batch["labels"] = batch["labels"].masked_fill(drop, -100)
        return batch


class _ListDataset:
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


# --------------------------------------------------------------------------- fine-tuning


def _load_base(base: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """(model, tokenizer, ref string recorded in outputs) from a ref or a (model, tok) pair."""
    if isinstance(base, tuple):
        model, tok = base
        import copy

        ref = str(getattr(model.config, "_name_or_path", "") or "in-memory")
        return copy.deepcopy(model), tok, ref
    from scpdr.models import load_model, load_tokenizer

    ref = os.fspath(base)
    if ref == "embedded":
        from scpdr.models import base_model_dir

        path = base_model_dir()
        return load_model(path), load_tokenizer(path), "embedded"
    return load_model(ref), load_tokenizer(ref), str(Path(ref).resolve())


def _tmp_dir(out: Path, fingerprint: str) -> Path:
    return out.parent / f"{out.name}.tmp-{fingerprint[:16]}"


def _latest_checkpoint(d: Path) -> Path | None:
    ckpts = [p for p in d.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    ckpts = [p for p in ckpts if (p / "trainer_state.json").is_file()]
    return max(ckpts, key=lambda p: int(p.name.split("-")[-1])) if ckpts else None


def finetune(
    records: Sequence[Record],
    *,
    base: Any,
    config: TrainConfig | dict[str, Any] | None = None,
    out: str | os.PathLike[str],
    overwrite: bool = False,
    callbacks: Sequence[TrainerCallback] = (),
) -> Path:
    """Fine-tune ``base`` on ``records`` and write the result to ``out`` (atomically).

    Args:
        records: the partition's training records (their ``text`` is trained on).
        base: ``"embedded"``, a model directory (HF or anything :func:`scpdr.models.load_model`
            reads), or a ``(model, tokenizer)`` pair (copied, never modified).
        config: a :class:`TrainConfig` (or its dict); default: the paper's full fine-tuning.
        out: the output directory: model safetensors (or a PEFT adapter for LoRA), tokenizer,
            and ``train_info.json`` (config, seeds, losses, time, data hash).
        overwrite: replace an existing ``out`` trained with different settings.
        callbacks: extra ``transformers.TrainerCallback`` objects.

    Resuming: the run trains in ``<out>.tmp-<fingerprint>``; calling ``finetune`` again with the
    same records, base and config after an interruption resumes from the last checkpoint there
    and reaches the same weights. If ``out`` already holds a finished run with the same
    fingerprint it is returned as is. Returns ``out``.
    """
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    cfg = _make_config(config)
    records = list(records)
    if not records:
        raise ConfigError("finetune needs at least one record")
    out = Path(out)
    base_key = os.fspath(base) if not isinstance(base, tuple) else "in-memory"
    data_hash = records_hash(records)
    fp = hashlib.sha256(f"{cfg.fingerprint()}|{data_hash}|{base_key}".encode()).hexdigest()
    tmp = _tmp_dir(out, fp)

    info_path = out / TRAIN_INFO
    if info_path.is_file():
        info = read_json(info_path)
        if info.get("fingerprint") == fp:
            logger.info("%s already trained with these settings; skipping", out)
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        if not overwrite:
            raise ConfigError(
                f"{out} holds a model trained with other data or settings; delete {out} to train "
                "there again, or choose another --out directory (in Python: another out, or "
                "finetune's overwrite argument replaces it)"
            )
    elif out.exists() and not overwrite:
        raise ConfigError(f"{out} exists and is not a finished training run; remove it first")

    model, tok, base_ref = _load_base(base)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rows = build_sequences(
        records,
        tok,
        seq_len=cfg.seq_len,
        packing=bool(cfg.packing),
        seed=cfg.seed,
        shuffle=cfg.shuffle_examples,
    )
    n_tokens = sum(sum(r["attention_mask"]) for r in rows)
    model.config.use_cache = False
    merge_lora = cfg.merge_lora
    if cfg.lora:
        if base_ref != "embedded" and not Path(base_ref).is_dir() and not merge_lora:
            logger.info("in-memory base %r cannot back an adapter; saving merged", base_ref)
            merge_lora = True
        from transformers import set_seed

        set_seed(cfg.seed)  # the adapter's random init (the Trainer seeds only later)
        model = _wrap_lora(model, cfg)

    resume = _latest_checkpoint(tmp) if tmp.is_dir() else None
    if resume is not None:
        logger.info("resuming %s from %s", out, resume)
    use_cpu = not torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=str(tmp),
        num_train_epochs=float(cfg.epochs),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=int(cfg.batch_size),
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=float(cfg.learning_rate),
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        weight_decay=cfg.weight_decay,
        optim=cfg.optim,
        neftune_noise_alpha=cfg.neftune_alpha or None,
        seed=cfg.seed,
        data_seed=cfg.seed,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        logging_steps=cfg.logging_steps,
        logging_first_step=True,
        report_to="none",
        disable_tqdm=not cfg.progress,
        bf16=cfg.bf16,
        activation_checkpointing=cfg.gradient_checkpointing,
        use_cpu=use_cpu,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_ListDataset(rows),
        data_collator=CausalCollator(
            goldfish_k=cfg.goldfish_k if cfg.goldfish else None, goldfish_h=cfg.goldfish_h
        ),
        callbacks=list(callbacks),
    )
    trainer.add_callback(_skip_final_checkpoint())
    if not cfg.progress:  # the Trainer then prints logs to stdout; log them instead
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(_log_callback())
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    elapsed = time.time() - t0

    stage = tmp / "final"
    if trainer.is_world_process_zero():
        shutil.rmtree(stage, ignore_errors=True)
        final_model = trainer.model
        if cfg.lora:
            final_model.peft_config["default"].base_model_name_or_path = base_ref
            if merge_lora:
                _untie_lm_head(final_model.get_base_model())
                final_model = final_model.merge_and_unload()
        if cfg.lora and not merge_lora:
            # the frozen embeddings are the base's: keep them out of the adapter
            final_model.save_pretrained(str(stage), save_embedding_layers=False)
        else:
            final_model.save_pretrained(str(stage))
        tok.save_pretrained(str(stage))
        info = {
            "fingerprint": fp,
            "config": cfg.model_dump(mode="json"),
            "base": base_ref,
            "seeds": {"seed": cfg.seed, "data_seed": cfg.seed},
            "data": {
                "records": len(records),
                "records_sha256": data_hash,
                "sequences": len(rows),
                "tokens": n_tokens,
            },
            "global_step": trainer.state.global_step,
            "epochs_done": trainer.state.epoch,
            "train_loss": result.training_loss,
            "log_history": trainer.state.log_history,
            "resumed_from": resume.name if resume else None,
            "train_seconds": elapsed,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
            "adapter": bool(cfg.lora and not merge_lora),
        }
        atomic_write_json(stage / TRAIN_INFO, info)
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    return out


def _skip_final_checkpoint() -> TrainerCallback:
    """Skip the Trainer's extra checkpoint after the last step (model + optimizer state, ~1.6 GB
    for the 135M base): the final model is saved right after training anyway."""
    from transformers import TrainerCallback

    class _Skip(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step >= state.max_steps and state.global_step % args.save_steps:
                control.should_save = False

    return _Skip()


def _log_callback() -> TrainerCallback:
    """A callback that sends the Trainer's log lines to :mod:`logging` (no stdout prints)."""
    from transformers import TrainerCallback

    class _LogCallback(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and state.is_world_process_zero:
                logger.info("step %d: %s", state.global_step, logs)

    return _LogCallback()


def _wrap_lora(model: PreTrainedModel, cfg: TrainConfig) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a dependency
        from scpdr.errors import missing_dependency

        raise missing_dependency("peft") from exc
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in cfg.lora_target_modules if m not in present]
    if missing:
        raise ConfigError(
            f"LoRA target modules {missing} do not exist in this model; available leaf modules "
            f"include {sorted(present)[:20]}"
        )
    lcfg = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lcfg)


def _untie_lm_head(model: PreTrainedModel) -> None:
    """Give a (LoRA-wrapped) ``lm_head`` tied to the input embeddings its own weight copy.

    peft applies an ``lm_head`` adapter to the output projection only, so on a tied model (SmolLM2)
    the trained function leaves the input embeddings alone; merging into the shared matrix would
    change them too (peft 0.21). Untying first makes the merged model equal the trained one
    (``scpdr.models.load_model`` does the same for adapters).
    """
    import torch

    head = model.get_output_embeddings()
    layer = getattr(head, "base_layer", head)
    emb = model.get_input_embeddings()
    emb_w = getattr(getattr(emb, "base_layer", emb), "weight", None)
    if emb_w is None or layer.weight is not emb_w:
        return
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_cfg = getattr(model.config, "get_text_config", None)
    if callable(text_cfg):
        text_cfg().tie_word_embeddings = False


# --------------------------------------------------------------------------- all constituents


def train_bundle(
    pset: PartitionSet,
    *,
    base: Any,
    config: TrainConfig | dict[str, Any] | None,
    out: str | os.PathLike[str],
    allow_failed_audit: bool = False,
    method: str = "scp-delta-r",
    m: int = 10,
    constant_base_prompts: Sequence[str] | None = None,
    callbacks: Sequence[TrainerCallback] = (),
) -> Path:
    """Audit the partitions, train one constituent per partition, and write a bundle in ``out``.

    Layout: ``out/partitions/`` (:func:`scpdr.data.partition.save_partitions`),
    ``out/constituent-<i>/`` (:func:`finetune`), ``out/scpdr.json``
    (:func:`scpdr.models.write_bundle` with the manifest hash and the audit; a constant base
    vector for SCP-Δr-c from ``constant_base_prompts``, default the first 100 validation texts).
    A failing audit raises :class:`~scpdr.errors.PartitionAuditError` unless
    ``allow_failed_audit``, which is recorded in the bundle's ``audit`` field. ``base`` is
    ``"embedded"`` or a model directory. Re-running resumes: finished constituents are kept.
    """
    from scpdr.data.partition import load_partitions, save_partitions
    from scpdr.models import constant_base_vector, load_model, load_tokenizer, write_bundle

    cfg = _make_config(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pdir = out / "partitions"
    if (pdir / "manifest.json").is_file():
        saved = load_partitions(pdir)
        if saved.manifest.sha256() != pset.manifest.sha256():
            raise ConfigError(
                f"{out} already holds different partitions; choose another --out directory"
            )
    else:
        save_partitions(pdir, pset)

    audit = audit_for_bundle(pset, allow_failed_audit=allow_failed_audit)

    refs = []
    for i, part in enumerate(pset.parts):
        if not part:
            raise ConfigError(f"partition {i} is empty; use fewer partitions or more data")
        logger.info("training constituent %d/%d on %d records", i + 1, pset.k, len(part))
        refs.append(
            finetune(part, base=base, config=cfg, out=out / f"constituent-{i}", callbacks=callbacks)
        )

    prompts = list(constant_base_prompts or [r.text for r in pset.validation[:100]])
    vec = None
    if prompts:
        base_model = load_model(base)
        vec = constant_base_vector(base_model, load_tokenizer(base), prompts)
        del base_model
    return write_bundle(
        out,
        base=base,
        constituents=refs,
        method=method,
        m=m,
        partition_manifest_hash=pset.manifest.sha256(),
        audit=audit,
        constant_base=vec,
        extra={
            "partitions": "partitions",
            "train_config": cfg.model_dump(mode="json"),
            "dataset": pset.manifest.dataset,
            "canaries": "partitions/canaries.json" if pset.canaries is not None else None,
        },
    )


def audit_for_bundle(pset: PartitionSet, *, allow_failed_audit: bool = False) -> dict[str, Any]:
    """Audit ``pset`` before bundling and return the bundle's ``audit`` field.

    The field is :meth:`~scpdr.data.partition.AuditReport.to_dict` of
    :func:`~scpdr.data.partition.audit_partitions` (with the set's canaries) plus
    ``"overridden"`` (true when the audit failed and ``allow_failed_audit`` let it through). A
    failing audit raises :class:`~scpdr.errors.PartitionAuditError` naming the failed checks and
    the fix unless ``allow_failed_audit``. Used by :func:`train_bundle` and ``scpdr bundle``.
    """
    from scpdr.data.partition import audit_partitions

    report = audit_partitions(pset.manifest, pset.records(), canaries=pset.canaries)
    audit = report.to_dict()
    if not report.passed:
        if not allow_failed_audit:
            report.raise_if_failed()
        logger.warning("partition audit FAILED; continuing because it was overridden")
    audit["overridden"] = bool(allow_failed_audit and not report.passed)
    return audit
