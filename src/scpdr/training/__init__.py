"""Training: one constituent fine-tuned per partition (paper App. E), then the bundle.

- :mod:`~scpdr.training.config`: :class:`TrainConfig`, the one training configuration (library,
  the experiment's YAML ``train:`` section, ``scpdr train``'s options);
- :mod:`~scpdr.training.sequences`: records → packed or one-record sequences → length-grouped
  batches, each padded to its longest;
- :mod:`~scpdr.training.loss`: the causal-LM loss in chunks of tokens (no tokens x V logits kept);
- :mod:`~scpdr.training.precision`: fp32, or bf16 autocast where the hardware has it and it is
  measured faster;
- :mod:`~scpdr.training.trainer`: the HF Trainer that runs grouped batches and the chunked loss;
- :mod:`~scpdr.training.goldfish`: the goldfish loss mask (Hans et al. 2024);
- :mod:`~scpdr.training.plan`: :func:`fit_to_data`, packing/batch/warm-up sized to the records,
  and the :class:`TrainPlan` printed before training (with a warning when it cannot learn);
- :mod:`~scpdr.training.progress`: a rich progress bar per constituent (log lines without a
  terminal);
- :mod:`~scpdr.training.resume`: interrupted runs, resumed only when asked (``--resume``);
- :mod:`~scpdr.training.finetune`: :func:`finetune`, one resumable, atomic run;
- :mod:`~scpdr.training.bundle`: :func:`train_bundle`, every constituent (K >= 2) and the bundle.

See ``docs/training.md``.
"""

from __future__ import annotations

from scpdr.data.pipeline import audit_for_bundle
from scpdr.training.bundle import train_bundle
from scpdr.training.config import (
    LORA_TARGET_MODULES,
    PAPER_DEFAULTS,
    Precision,
    TrainConfig,
    make_config,
)
from scpdr.training.finetune import TRAIN_INFO, finetune
from scpdr.training.goldfish import GOLDFISH_H, GOLDFISH_K, goldfish_mask
from scpdr.training.plan import TrainPlan, example_lengths, fit_to_data
from scpdr.training.sequences import CausalCollator, build_sequences

__all__ = [
    "GOLDFISH_H",
    "GOLDFISH_K",
    "LORA_TARGET_MODULES",
    "PAPER_DEFAULTS",
    "TRAIN_INFO",
    "CausalCollator",
    "Precision",
    "TrainConfig",
    "TrainPlan",
    "audit_for_bundle",
    "build_sequences",
    "example_lengths",
    "finetune",
    "fit_to_data",
    "goldfish_mask",
    "make_config",
    "train_bundle",
]
