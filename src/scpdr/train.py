"""Deprecated import path: the training code moved to :mod:`scpdr.training` (config, sequences,
goldfish, finetune, bundle). This module re-exports its public names until the redesign's merge
removes it; import from :mod:`scpdr.training` instead."""

from __future__ import annotations

from scpdr.training import (
    LORA_TARGET_MODULES,
    TRAIN_INFO,
    CausalCollator,
    TrainConfig,
    audit_for_bundle,
    build_sequences,
    finetune,
    goldfish_mask,
    train_bundle,
)

__all__ = [
    "LORA_TARGET_MODULES",
    "TRAIN_INFO",
    "CausalCollator",
    "TrainConfig",
    "audit_for_bundle",
    "build_sequences",
    "finetune",
    "goldfish_mask",
    "train_bundle",
]
