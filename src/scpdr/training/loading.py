"""The base model of a training run and its LoRA wrapping, shared by the HF-Trainer run
(:mod:`scpdr.training.finetune`) and the DP-SGD run (:mod:`scpdr.training.dp`): loading the base
from a ref or a ``(model, tokenizer)`` pair, wrapping it in a PEFT LoRA adapter, and untying a
LoRA-wrapped ``lm_head`` before a merge."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.errors import ConfigError
from scpdr.training.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TRAIN_INFO", "load_base", "untie_lm_head", "wrap_lora"]

#: The record of a finished run, beside its weights.
TRAIN_INFO = "train_info.json"


def load_base(base: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
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


def wrap_lora(model: PreTrainedModel, cfg: TrainConfig) -> Any:
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


def untie_lm_head(model: PreTrainedModel) -> None:
    """Give a (LoRA-wrapped) ``lm_head`` tied to the input embeddings its own weight copy.

    peft applies an ``lm_head`` adapter to the output projection only, so on a tied model (SmolLM2)
    the trained function leaves the input embeddings alone; merging into the shared matrix would
    change them too (peft 0.21). Untying first makes the merged model equal the trained one
    (``scpdr.models.load_model`` does the same for adapters).
    """
    from scpdr.models.loading import untie_head

    untie_head(model)
