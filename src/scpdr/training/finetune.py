"""Fine-tune one constituent on one partition with the HF Trainer (full fine-tuning or LoRA).

Defaults follow the paper's training table (App. E, Table 6, after Abad et al. 2025; see
:class:`~scpdr.training.config.TrainConfig`). CPU deviation: ``adamw_torch`` instead of
``adamw_bnb_8bit`` (bitsandbytes needs CUDA). No separator token is added (the prompt and response
are concatenated as they are, as the paper does for LoRA), so no new embedding needs initializing.

Runs are resumable and their outputs atomic: a run trains in ``<out>.tmp-<fingerprint>``
(``run.json``: what it trains; a checkpoint every ``save_steps`` and at least once per epoch);
``finetune(..., resume=True)`` continues it from its last checkpoint (:func:`finetune` says when
``resume`` is left unset or ``False``); the final directory (model safetensors or adapter,
tokenizer, ``train_info.json``) is renamed to ``out`` at the end. The same code runs under
``accelerate launch`` on several processes.

A step's cost follows the data (:mod:`scpdr.training.trainer`): unpacked records are batched by
length and each batch padded to its own longest; the loss is computed in chunks of tokens
(:mod:`scpdr.training.loss`); and the run trains in bf16 where the hardware has it and it is
measured faster (:mod:`scpdr.training.precision`). ``train_info.json`` records each (``plan``,
``loss``, ``precision``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.data.records import Record, records_hash
from scpdr.errors import ConfigError
from scpdr.io import atomic_write_json, read_json
from scpdr.training.config import TrainConfig, make_config
from scpdr.training.dropout import replace_lora_dropout
from scpdr.training.loading import TRAIN_INFO, load_base, untie_lm_head, wrap_lora
from scpdr.training.memory import trim_heap
from scpdr.training.placement import (
    full_state_dict,
    is_main_process,
    main_result,
    placement_info,
    plain_optim,
    resolve_optim,
    same_update,
    select_device,
    training_device,
    wait_for_everyone,
    world_size,
)
from scpdr.training.plan import example_lengths, fit_to_data, recorded_batching
from scpdr.training.precision import resolve_precision
from scpdr.training.resume import RUN_INFO, choose_checkpoint
from scpdr.training.sequences import CausalCollator, build_sequences
from scpdr.training.trainer import make_trainer

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["TRAIN_INFO", "finetune"]


def _tmp_dir(out: Path, fingerprint: str) -> Path:
    return out.parent / f"{out.name}.tmp-{fingerprint[:16]}"


def finetune(
    records: Sequence[Record],
    *,
    base: Any,
    config: TrainConfig | dict[str, Any] | None = None,
    out: str | os.PathLike[str],
    overwrite: bool = False,
    callbacks: Sequence[TrainerCallback] = (),
    device: str | None = None,
    resume: bool | None = None,
) -> Path:
    """Fine-tune ``base`` on ``records`` and write the result to ``out`` (atomically).

    Args:
        records: the partition's training records (their ``text`` is trained on).
        base: ``"embedded"``, a model directory (HF or anything :func:`scpdr.models.load_model`
            reads), or a ``(model, tokenizer)`` pair (copied, never modified).
        config: a :class:`TrainConfig` (or its dict); default: the paper's full fine-tuning.
            Fields left unset (packing, batch size, warm-up) are sized to the records
            (:func:`~scpdr.training.plan.fit_to_data`); the plan is in ``train_info.json``.
        out: the output directory: model safetensors (or a PEFT adapter for LoRA), tokenizer,
            and ``train_info.json`` (config, seeds, losses, time, data hash).
        overwrite: replace an existing ``out`` trained with different settings.
        callbacks: extra ``transformers.TrainerCallback`` objects.
        device: ``cpu``, ``cuda`` or ``cuda:N`` (default: ``$SCPDR_DEVICE``, else cuda when
            available); under ``accelerate launch`` each process uses its rank's device
            (:mod:`scpdr.training.placement`). An 8-bit optimizer falls back to ``adamw_torch``
            where it cannot run, and ``adamw_torch`` runs as torch's fused kernel where the
            device has one (what ran is recorded in ``train_info.json``).

        resume: what to do with an interrupted run of ``out`` (``<out>.tmp-*`` with a
            checkpoint). ``True``: continue it from its last checkpoint (model, optimizer,
            scheduler, RNG and data order) to the same weights as an uninterrupted run; an
            error if there is none, or if it was started with other records, base or settings
            (the error lists the differences). ``False``: an interrupted run is an error naming
            ``resume=True`` (as the Trainer, which resumes only when asked). ``None``
            (default): resume one with the same fingerprint, and log that it does.

    The run trains in ``<out>.tmp-<fingerprint>`` (``run.json`` there records what it trains),
    with a checkpoint every ``min(save_steps, steps per epoch)`` steps. If ``out`` already holds
    a finished run with the same fingerprint it is returned as is. Returns ``out``.
    """
    import torch
    import transformers
    from transformers import TrainingArguments

    cfg = make_config(config)  # resolved: the paper defaults filled in
    if cfg.dp:  # DP-SGD: Opacus' per-example gradients in a plain loop (training/dp.py)
        from scpdr.training.dp import finetune_dp

        if resume:
            logger.info("%s: DP runs keep no checkpoint; training starts again", out)
        return finetune_dp(
            records, base=base, config=config, out=out, overwrite=overwrite, device=device
        )
    dev = training_device(device)
    optim = resolve_optim(cfg.optim, dev)
    records = list(records)
    if not records:
        raise ConfigError("finetune needs at least one record")
    out = Path(out)
    base_key = os.fspath(base) if not isinstance(base, tuple) else "in-memory"
    data_hash = records_hash(records)
    # another optimizer's checkpoints (not the same one's fused kernel: placement.same_update)
    swapped = "" if same_update(optim, cfg.optim) else f"|optim={plain_optim(optim)}"
    # auto: measured (or recalled) by the main process; every process trains in its choice
    precision = main_result(lambda: resolve_precision(cfg.precision, device=dev))
    if cfg.precision == "auto" and precision.bf16:  # (auto resolving to fp32: as fp32)
        swapped += "|precision=bf16"
    fp = hashlib.sha256(f"{cfg.fingerprint()}|{data_hash}|{base_key}{swapped}".encode()).hexdigest()
    tmp = _tmp_dir(out, fp)
    run = {
        "fingerprint": fp,
        "config": cfg.model_dump(mode="json"),
        "records": len(records),
        "records_sha256": data_hash,
        "base": base_key,
        "optim": optim,
        "precision": precision.precision,
    }

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
    resume_ckpt = choose_checkpoint(out, tmp, run, resume)  # before any model loads
    recorded = _resumed_batching(tmp, resume_ckpt)
    kept = {} if recorded is None else recorded_batching(cfg, recorded)
    wait_for_everyone()  # every process has decided before the main one writes
    if is_main_process():
        if resume_ckpt is None and tmp.is_dir():
            shutil.rmtree(tmp)  # a start without a checkpoint: nothing in it to keep
        tmp.mkdir(parents=True, exist_ok=True)
        # a resumed run's batching is kept (rewritten with the plan's below)
        atomic_write_json(tmp / RUN_INFO, {**run, **(recorded or {})})

    model, tok, base_ref = load_base(base)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # sizing to the data (training/plan.py): packing, batch and warm-up the caller left unset
    if kept:  # a resumed run keeps the grouping and padding it started with
        raw = (
            config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config or {}))
        )
        config = raw.model_copy(update=kept)
    cfg, plan = fit_to_data(
        config,
        example_lengths(records, tok),
        name=out.name,
        precision=precision,
        device=dev,
    )
    if is_main_process():  # the batching resolved (a resumed run reads it back)
        resolved = {"grouped": plan.grouped, "pad_to_multiple_of": plan.pad_to_multiple_of}
        atomic_write_json(tmp / RUN_INFO, {**run, **resolved})
    logger.debug("plan of %s:\n%s", out, plan.summary())
    logger.info("%s: precision %s", out.name, precision.summary)
    if kept:  # scpdr train's printed plan does not know what a checkpoint started with
        logger.info(
            "%s: resumed with the batching it started with: %s, padded to %s",
            out.name,
            "length-grouped batches" if plan.grouped else "batches in random order",
            f"a multiple of {plan.pad_to_multiple_of} tokens"
            if plan.pad_to_multiple_of > 1
            else "the longest exactly",
        )
    for warning in plan.warnings():
        logger.warning("%s: %s", out.name, warning)
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
        model = wrap_lora(model, cfg)
        if dev == "cpu":  # torch's CPU bernoulli_ costs more than the matmuls (dropout.py)
            replace_lora_dropout(model)

    # a checkpoint at least once per epoch: an interrupted run loses at most one epoch
    batches = math.ceil(math.ceil(len(rows) / world_size()) / int(cfg.batch_size))
    save_steps = min(cfg.save_steps, max(batches // cfg.grad_accum, 1))
    select_device(dev)
    args = TrainingArguments(
        output_dir=str(tmp),
        num_train_epochs=float(cfg.epochs),
        max_steps=cfg.max_steps or -1,
        per_device_train_batch_size=int(cfg.batch_size),
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=float(cfg.learning_rate),
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        weight_decay=cfg.weight_decay,
        optim=optim,
        neftune_noise_alpha=cfg.neftune_alpha or None,
        seed=cfg.seed,
        data_seed=cfg.seed,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=cfg.save_total_limit,
        logging_steps=cfg.logging_steps,
        logging_first_step=True,
        report_to="none",
        disable_tqdm=True,  # a rich bar per constituent instead (training/progress.py)
        bf16=precision.bf16,  # autocast bf16, fp32 master weights (training/precision.py)
        activation_checkpointing=plan.gradient_checkpointing,  # resolved for the device
        use_cpu=dev == "cpu",
        ddp_find_unused_parameters=False,  # every trainable weight is used in the forward
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    trainer, chunked = make_trainer(
        model=model,
        args=args,
        rows=rows,
        collator=CausalCollator(
            goldfish_k=cfg.goldfish_k if cfg.goldfish else None,
            goldfish_h=cfg.goldfish_h,
            pad_token_id=tok.eos_token_id,
            pad_to_multiple_of=plan.pad_to_multiple_of,  # 1 when packing (training/plan.py)
        ),
        grouped=plan.grouped,  # group_by_length, resolved by the plan
        chunked_loss=cfg.chunked_loss,
        autocast=("cuda" if dev.startswith("cuda") else "cpu") if precision.bf16 else None,
        callbacks=callbacks,
        trim_heap=dev == "cpu" and cfg.trim_heap,  # training/memory.py
    )
    trainer.add_callback(_skip_final_checkpoint())
    # the Trainer prints its logs to stdout: a progress bar shows them, or they are logged
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if cfg.progress:
        from scpdr.training.progress import progress_callback

        trainer.add_callback(progress_callback(out.name))
    else:
        trainer.add_callback(_log_callback())
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=str(resume_ckpt) if resume_ckpt else None)
    elapsed = time.time() - t0

    stage = tmp / "final"
    gathered = full_state_dict(trainer)  # FSDP: every process hands in its shards
    if gathered is not None and merge_lora:
        raise ConfigError("merge_lora under FSDP: save the adapter (merge_lora: false)")
    if trainer.is_world_process_zero():
        shutil.rmtree(stage, ignore_errors=True)
        final_model = trainer.model
        if cfg.lora:
            final_model.peft_config["default"].base_model_name_or_path = base_ref
            if merge_lora:
                untie_lm_head(final_model.get_base_model())
                final_model = final_model.merge_and_unload()
        if cfg.lora and not merge_lora:
            # the frozen embeddings are the base's: keep them out of the adapter
            final_model.save_pretrained(
                str(stage), save_embedding_layers=False, state_dict=gathered
            )
        else:
            final_model.save_pretrained(str(stage), state_dict=gathered)
        tok.save_pretrained(str(stage))
        info = {
            "fingerprint": fp,
            "config": cfg.model_dump(mode="json"),
            "plan": plan.to_dict(),
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
            "resumed_from": resume_ckpt.name if resume_ckpt else None,
            "save_steps": save_steps,
            "train_seconds": elapsed,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
            "adapter": bool(cfg.lora and not merge_lora),
            "precision": precision.to_dict(),
            "loss": "chunked" if chunked else "model",
            "placement": placement_info(trainer, dev, optim),
        }
        atomic_write_json(stage / TRAIN_INFO, info)
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    del trainer, model
    final_model = gathered = None  # the last references to the model
    trim_heap(collect=True)  # the next constituent starts without this one's heap
    return out


def _resumed_batching(tmp: Path, ckpt: Path | None) -> dict[str, Any] | None:
    """The batching a run resumed from ``ckpt`` recorded in its ``run.json`` (``grouped``,
    ``pad_to_multiple_of``; a run from before either records fewer), or None when nothing is
    resumed. :func:`~scpdr.training.plan.recorded_batching` pins it, so that the run resumes to
    the weights it would have reached."""
    if ckpt is None or not (tmp / RUN_INFO).is_file():
        return None
    info = read_json(tmp / RUN_INFO)
    return {k: info[k] for k in ("grouped", "pad_to_multiple_of") if k in info}


def _skip_final_checkpoint() -> TrainerCallback:
    """Skip the Trainer's checkpoint after the last step (model + optimizer state, ~1.6 GB for
    the 135M base), also when the last step falls on the save interval (the end of an epoch):
    the final model is saved right after training anyway."""
    from transformers import TrainerCallback

    class _Skip(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step >= state.max_steps:
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
