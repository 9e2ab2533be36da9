"""Training sized to the data: the plan of one constituent's run, printed before it trains.

The paper's defaults (App. E, Table 6: packing to 2048 tokens, batch 1, 50 warm-up steps) suit
thousands of long examples. On a few hundred short records they give a handful of optimizer steps,
all inside the warm-up, and the learning rate never leaves ~0. :func:`fit_to_data` keeps what
the user set and sizes the rest to the data:

- **packing** (unset): off when the records are short (the longest ≤ ``seq_len / 4`` tokens), so
  each record is its own sequence — as the extraction attacks query it (a fresh prompt at the
  record's start) — and the sequences are padded to the longest record, not to ``seq_len``;
  otherwise the paper's default for the mode;
- **batch size** (unset, unpacked full fine-tuning): up to 8 records per step (at least 8 steps
  an epoch), instead of the paper's one 2048-token block;
- **warm-up** (unset): at most 10% of the optimizer steps (the paper's 50 when there are ≥ 500);
- **length grouping** (``group_by_length`` unset): on for unpacked records, so that each batch,
  padded to its own longest sequence, holds records of similar length;
- **padding multiple** (``pad_to_multiple_of`` unset, :func:`default_pad_multiple`): training
  in bf16, each unpacked batch's width rounded up to a multiple of
  :data:`~scpdr.training.config.PAD_TO_MULTIPLE_OF` tokens, so that a run has few distinct batch
  shapes (:class:`~scpdr.training.sequences.CausalCollator`): oneDNN, which runs torch's bf16
  matmuls on CPU, keeps kernels per shape; in fp32 the longest exactly (the matmuls' memory did
  not creep with the shapes, and the rounding gained neither time nor more than 2% of memory
  for twice the padding tokens). The padding share and the ``max_batch_tokens`` split count
  that width;
- **memory** (on the device ``fit_to_data`` is given): gradient checkpointing
  (``gradient_checkpointing`` unset) on when training on CPU — a laptop runs out of memory long
  before a GPU does, and the activations are most of a step's memory (135M model, 8 x 256 tokens,
  bf16, AdamW: peak RSS 4.9 GiB without, 3.4 GiB with, for 3% more time per step there and 13%
  in a 500-record run;
  ``benchmarks/bench_train.py``) — and a batch wider than
  ``max_batch_tokens`` (unset: :data:`~scpdr.training.config.CPU_MAX_BATCH_TOKENS` on CPU)
  split into gradient-accumulation micro-batches: the same records per optimizer step (the
  loss counts every token of the accumulated batch once: :mod:`scpdr.training.trainer`), at most
  that many tokens, padding included, in one forward pass. LoRA's paper batch of 64 records of
  a few hundred tokens would otherwise hold 20k tokens' activations at once.

:class:`TrainPlan` is what the run will do (records, tokens, sequences, steps, epochs, the lr
schedule, the share of padding in its batches, the precision and why) and
:meth:`TrainPlan.warnings` says when it cannot learn (no step past the warm-up, too few steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from scpdr.data.records import Record
from scpdr.training.config import (
    CPU_MAX_BATCH_TOKENS,
    PAD_TO_MULTIPLE_OF,
    TrainConfig,
    make_config,
)
from scpdr.training.sequences import epoch_order, example_order, padded_width, padding_share

if TYPE_CHECKING:
    from scpdr.training.precision import PrecisionChoice

__all__ = [
    "MAX_WARMUP_FRACTION",
    "MIN_STEPS",
    "TrainPlan",
    "default_pad_multiple",
    "example_lengths",
    "fit_to_data",
]

#: The warm-up the sizing allows, as a fraction of the optimizer steps.
MAX_WARMUP_FRACTION = 0.1
#: Fewer optimizer steps than this is a warning: the run can hardly learn anything.
MIN_STEPS = 10
#: Records whose longest is at most ``seq_len / SHORT_RATIO`` tokens are "short" (no packing).
SHORT_RATIO = 4
#: Records per step the sizing picks for unpacked full fine-tuning (batch size unset).
AUTO_BATCH = 8


@dataclass(frozen=True)
class TrainPlan:
    """What one fine-tuning run will do (:func:`fit_to_data`); ``changes`` lists what the sizing
    set differently from the paper's defaults, and why."""

    records: int
    tokens: int
    longest: int
    sequences: int
    seq_len: int
    packing: bool
    batch_size: int
    grad_accum: int
    steps_per_epoch: int
    epochs: float
    total_steps: int
    warmup_steps: int
    learning_rate: float
    lr_scheduler: str
    lora: bool
    name: str = ""
    changes: list[str] = field(default_factory=list)
    #: length-grouped batches (``group_by_length``, resolved)
    grouped: bool = False
    #: pad tokens / all tokens of the first epoch's batches, as they will be built
    padding: float = 0.0
    #: the same without length grouping (unpacked records only)
    padding_ungrouped: float | None = None
    #: the precision and why (:attr:`~scpdr.training.precision.PrecisionChoice.summary`)
    precision: str = ""
    #: activations recomputed in the backward pass (``gradient_checkpointing``, resolved)
    gradient_checkpointing: bool = False
    #: the most tokens one forward pass holds (``max_batch_tokens``, resolved; None: no limit)
    max_batch_tokens: int | None = None
    #: each batch padded to its longest rounded up to a multiple of this (1: packed, or exact)
    pad_to_multiple_of: int = 1

    def warnings(self) -> list[str]:
        """Why this plan cannot (or can hardly) learn, in words; empty when it can."""
        out = []
        if self.warmup_steps >= self.total_steps:
            out.append(
                f"every one of the {self.total_steps} optimizer steps is inside the "
                f"{self.warmup_steps}-step warm-up: the learning rate never reaches "
                f"{self.learning_rate:g}; lower --warmup-steps or train longer (--epochs)"
            )
        if self.total_steps < MIN_STEPS:
            out.append(
                f"only {self.total_steps} optimizer steps: too few to learn; raise --epochs, "
                "lower --batch-size, or add records"
            )
        return out

    def summary(self) -> str:
        """The plan in a few lines (what ``scpdr train`` prints before training)."""
        name = f"{self.name}: " if self.name else ""
        mode = "LoRA" if self.lora else "full fine-tuning"
        if self.packing:
            seqs = (
                f"packed into {self.sequences} sequences of {self.seq_len} tokens "
                f"(padding {self.padding:.0%} of the batches' tokens)"
            )
        else:
            how = "length-grouped batches" if self.grouped else "batches in random order"
            other = (
                f"; {self.padding_ungrouped:.0%} {'without' if self.grouped else 'with'} grouping"
                if self.padding_ungrouped is not None
                else ""
            )
            to = (
                f"its longest rounded up to a multiple of {self.pad_to_multiple_of}"
                if self.pad_to_multiple_of > 1
                else "its longest"
            )
            seqs = (
                f"one per sequence, each batch padded to {to}: padding {self.padding:.0%} "
                f"of the batches' tokens ({how}{other})"
            )
        lines = [
            f"{name}{self.records} records, {self.tokens} tokens (longest {self.longest}), {seqs}",
            f"  {mode}: batch {self.batch_size} x {self.grad_accum} accumulation, "
            f"{self.steps_per_epoch} steps/epoch x {self.epochs:g} epochs = "
            f"{self.total_steps} optimizer steps",
            f"  lr {self.learning_rate:g}, {self.lr_scheduler} schedule, "
            f"{self.warmup_steps} warm-up steps",
        ]
        if self.precision:
            lines.append(f"  precision {self.precision}")
        limit = f"at most {self.max_batch_tokens} tokens" if self.max_batch_tokens else "no limit"
        lines.append(
            f"  memory: gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}, "
            f"{self.batch_size} x {self.seq_len} tokens per forward pass ({limit})"
        )
        lines += [f"  sized to the data: {c}" for c in self.changes]
        lines += [f"  WARNING: {w}" for w in self.warnings()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "warnings": self.warnings()}


def recorded_batching(cfg: TrainConfig, recorded: dict[str, Any]) -> dict[str, Any]:
    """Config updates pinning the batching a run recorded (``grouped`` and
    ``pad_to_multiple_of``, as its plan and its ``run.json`` hold them), for each of
    ``group_by_length`` and ``pad_to_multiple_of`` that ``cfg`` leaves unset; a run that
    recorded neither predates them: random order (``False``), batches padded to their longest
    exactly (1)."""
    out: dict[str, Any] = {}
    if cfg.group_by_length is None:
        out["group_by_length"] = bool(recorded.get("grouped", False))
    if cfg.pad_to_multiple_of is None:
        out["pad_to_multiple_of"] = int(recorded.get("pad_to_multiple_of", 1))
    return out


def example_lengths(records: Sequence[Record], tokenizer: Any) -> list[int]:
    """Tokens of each record's training example (its text and the EOS that ends it), as
    :func:`~scpdr.training.sequences.build_sequences` makes them."""
    eos = tokenizer.eos_token_id
    out = []
    for r in records:
        ids = tokenizer(r.text)["input_ids"]
        out.append(len(ids) + (0 if ids and ids[-1] == eos else 1))
    return out


def _steps(
    n_sequences: int, batch: int, accum: int, epochs: float, max_steps: int | None
) -> tuple[int, int]:
    # as the Trainer counts them: a last, partial accumulation of an epoch is a step too
    per_epoch = max(math.ceil(math.ceil(n_sequences / batch) / accum), 1)
    total = max_steps if max_steps else max(math.ceil(per_epoch * epochs), 1)
    return per_epoch, total


def default_pad_multiple(precision: PrecisionChoice | None) -> int:
    """The padding multiple of unpacked batches when ``pad_to_multiple_of`` is unset:
    :data:`~scpdr.training.config.PAD_TO_MULTIPLE_OF` for a run in bf16 (or of unknown
    precision), 1 (the longest exactly) in fp32.

    Measured (135M model, full fine-tuning, 2 threads, 40 steps of 8 records of 40-173 tokens,
    Intel Xeon with AMX; docs/training.md): in bf16 the peak RSS crept 2.73 -> 3.26 GiB at the
    exact widths and stayed at 2.89 at a multiple of 16; in fp32 it crept by < 0.1 GiB either
    way, and the multiple's extra tokens took 1.0x (AVX-512) to 1.04x (torch and MKL held to
    AVX2) the time; a 500-record fp32 run peaked at 3.10 GiB exact against 3.04 at 16, in the
    same 12:58."""
    return PAD_TO_MULTIPLE_OF if precision is None or precision.bf16 else 1


def fit_to_data(
    config: TrainConfig | dict[str, Any] | None,
    lengths: Sequence[int],
    *,
    name: str = "",
    precision: PrecisionChoice | None = None,
    device: str | None = None,
) -> tuple[TrainConfig, TrainPlan]:
    """The resolved config a run on examples of these token ``lengths`` uses, and its plan.

    Fields the caller set are kept (an explicit ``warmup_steps`` longer than the run is a
    warning, not a change); unset ones are sized as the module docstring says. ``precision``:
    what the run trains in (:func:`~scpdr.training.precision.resolve_precision`), for the
    padding multiple (:func:`default_pad_multiple`) and the plan's precision line; the plan has
    no such line without it. ``device``: where the run trains (``"cpu"``,
    ``"cuda:0"``); the memory settings left unset follow it (module docstring), and without it
    checkpointing is off and batches are not split."""
    raw = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(dict(config or {}))
    given = raw.model_fields_set
    cfg = make_config(raw)
    n, tokens = len(lengths), int(sum(lengths))
    longest = max(lengths) if lengths else 0
    changes: list[str] = []
    update: dict[str, Any] = {}

    packing = bool(cfg.packing)
    if raw.packing is None and packing and longest * SHORT_RATIO <= cfg.seq_len:
        packing = False
        update["packing"] = False
        changes.append(
            f"no packing: the records are short (longest {longest} tokens <= seq_len "
            f"{cfg.seq_len} / {SHORT_RATIO})"
        )
    batch = int(cfg.batch_size)
    if raw.batch_size is None and not packing and not cfg.lora and batch < AUTO_BATCH:
        batch = max(1, min(AUTO_BATCH, n // AUTO_BATCH))
        if batch != cfg.batch_size:
            update["batch_size"] = batch
            changes.append(f"batch {batch} records per step (unpacked short records)")
    accum = cfg.grad_accum
    on_cpu = device == "cpu"
    checkpointing = on_cpu if cfg.gradient_checkpointing is None else cfg.gradient_checkpointing
    if cfg.gradient_checkpointing is None:  # the config keeps "unset"; the plan says what runs
        if checkpointing:
            changes.append(
                "gradient checkpointing on (CPU: activations recomputed in the backward pass, "
                "two thirds of the peak memory for 3-13% more time per step)"
            )
    max_tokens = cfg.max_batch_tokens
    if max_tokens is None and on_cpu:
        max_tokens = CPU_MAX_BATCH_TOKENS
    # packed: every sequence is seq_len long
    multiple = 1 if packing else int(cfg.pad_to_multiple_of or default_pad_multiple(precision))
    # a batch's padded length at most
    width = cfg.seq_len if packing else padded_width(min(cfg.seq_len, longest), multiple)
    if max_tokens and width and batch * width > max_tokens:
        fit = [d for d in range(1, batch + 1) if batch % d == 0 and d * width <= max_tokens]
        micro = max(fit, default=1)  # one sequence longer than the limit still goes alone
        if micro < batch:
            changes.append(
                f"batch {batch} in {batch // micro} micro-batches of {micro} (gradient "
                f"accumulation): {batch} x {width} tokens exceed max_batch_tokens {max_tokens}"
            )
            accum *= batch // micro
            batch = micro
            update.update(batch_size=batch, grad_accum=accum)
    n_seq = math.ceil(tokens / cfg.seq_len) if packing else n
    per_epoch, total = _steps(n_seq, batch, accum, float(cfg.epochs), cfg.max_steps)
    warmup = cfg.warmup_steps
    if "warmup_steps" not in given:
        limit = int(MAX_WARMUP_FRACTION * total)
        if warmup > limit:
            warmup = limit
            update["warmup_steps"] = warmup
            changes.append(
                f"warm-up {warmup} steps (<= {MAX_WARMUP_FRACTION:.0%} of {total} steps; "
                f"the paper's {cfg.warmup_steps} would cover "
                f"{min(cfg.warmup_steps / total, 1):.0%})"
            )
    cfg = cfg.model_copy(update=update) if update else cfg
    grouped = (not packing) if cfg.group_by_length is None else bool(cfg.group_by_length)
    if packing:
        padded = n_seq * cfg.seq_len
        share, ungrouped = ((padded - tokens) / padded if padded else 0.0), None
    else:  # the sequences in build_sequences' order, truncated to seq_len
        order = example_order(n, seed=cfg.seed, shuffle=cfg.shuffle_examples)
        seqs = [min(int(lengths[i]), cfg.seq_len) for i in order]

        def share_of(group: bool) -> float:
            ids = epoch_order(seqs, batch_size=batch * accum, seed=cfg.seed, grouped=group)
            return padding_share(seqs, ids, batch, multiple)

        share, ungrouped = share_of(grouped), share_of(False) if grouped else None
    plan = TrainPlan(
        records=n,
        tokens=tokens,
        longest=longest,
        sequences=n_seq,
        seq_len=width,
        packing=packing,
        batch_size=batch,
        grad_accum=accum,
        steps_per_epoch=per_epoch,
        epochs=float(cfg.epochs),
        total_steps=total,
        warmup_steps=warmup,
        learning_rate=float(cfg.learning_rate),
        lr_scheduler=cfg.lr_scheduler,
        lora=cfg.lora,
        name=name,
        changes=changes,
        grouped=grouped,
        padding=share,
        padding_ungrouped=ungrouped,
        precision=precision.summary if precision is not None else "",
        gradient_checkpointing=bool(checkpointing),
        max_batch_tokens=max_tokens,
        pad_to_multiple_of=multiple,
    )
    return cfg, plan
