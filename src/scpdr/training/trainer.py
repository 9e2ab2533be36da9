"""The ``transformers.Trainer`` that :func:`~scpdr.training.finetune.finetune` runs, with two
changes, each of which can be turned off in the :class:`~scpdr.training.config.TrainConfig`:

- **length-grouped batches** (``group_by_length``): the Trainer's sampler is
  :class:`~scpdr.training.sequences.GroupedSampler` — transformers' ``group_by_length`` order,
  drawn from a generator seeded by ``seed + epoch``, so a run resumed in the middle of any epoch
  replays the same batches (transformers' own grouped sampler draws from the global RNG, which a
  resumed run has not advanced as far); its epoch is set at each epoch's start by
  :func:`grouped_epoch_callback` (accelerate's ``set_epoch`` does not reach it in a run resumed
  under DDP, where it is nested three samplers deep);
- **the chunked loss** (``chunked_loss``): the model is asked for its hidden states (and the
  logits of its last position only), and :class:`~scpdr.training.loss.ChunkedCausalLMLoss` is
  the Trainer's ``compute_loss_func``; the Trainer then counts the labelled tokens of the
  accumulated batches (``num_items_in_batch``) and scales the loss for gradient accumulation and
  several processes as it does for the model's own loss. Not under FSDP or DeepSpeed (the
  output layer is called outside the model's forward, where those hold sharded weights), nor for
  a model whose forward takes no ``logits_to_keep``, nor one whose logits are not
  ``lm_head(hidden_states[-1])`` (a config that softcaps or scales them — Gemma 2/3's
  ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling`` — or, for
  any other model, the head's output differing from the model's own logits on a few positions
  of the first sequence): there the model's own loss is used (logged).

With ``trim_heap`` (``TrainConfig.trim_heap``, CPU, on by default) it also hands the heap's free
pages back to the system inside each step, after the forward and before the optimizer step
(:mod:`scpdr.training.memory`: a lower peak for a little more time per step). A bf16 run's
autocast keeps no cache of its weight casts (:data:`~scpdr.training.memory.AUTOCAST_CACHE`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from scpdr.training.loss import ChunkedCausalLMLoss
from scpdr.training.memory import AUTOCAST_CACHE, heap_trim_callback
from scpdr.training.sequences import (
    CausalCollator,
    GroupedSampler,
    ListDataset,
    set_grouped_epoch,
)

__all__ = ["make_trainer"]

logger = logging.getLogger(__name__)


def _accepts_logits_to_keep(model: Any) -> bool:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


#: Config attributes of models whose logits are a function of ``lm_head``'s output, with the
#: values that leave it as it is.
LOGIT_TRANSFORMS: dict[str, tuple[Any, ...]] = {
    "final_logit_softcapping": (None, 0, 0.0),  # Gemma 2/3: cap * tanh(logits / cap)
    "logit_scale": (None, 1, 1.0),  # Cohere: logits * scale
    "logits_scaling": (None, 1, 1.0),  # Granite: logits / scaling
}
#: Tokens of the first sequence the head is checked on against the model's logits.
CHECK_TOKENS = 16


def logits_transform(model: Any) -> str | None:
    """``name=value`` of the first :data:`LOGIT_TRANSFORMS` attribute that ``model``'s config
    (or its ``text_config``) sets to something other than a no-op, else ``None``."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        for name, neutral in LOGIT_TRANSFORMS.items():
            value = getattr(cfg, name, None)
            if value not in neutral:
                return f"{name}={value}"
    return None


def head_mismatch(model: Any, input_ids: Sequence[int]) -> str | None:
    """Why ``lm_head(hidden_states[-1])`` is not the model's logits on ``input_ids`` (its first
    :data:`CHECK_TOKENS`), or ``None`` when it is, to ``sqrt(eps)`` of the logits' dtype times
    their largest magnitude (float rounding of the same matmul is ~eps; a scaled or capped
    logit is far off). Run in eval mode without gradients, the RNG untouched."""
    import torch

    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(input_ids)[:CHECK_TOKENS]], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            out = model(input_ids=ids, output_hidden_states=True)
            ref = out.logits  # (1, T, V)
            mine = model.get_output_embeddings()(out.hidden_states[-1]).to(ref.dtype)
    finally:
        model.train(was_training)
    scale = max(1.0, float(ref.abs().max()))
    tol = torch.finfo(ref.dtype).eps ** 0.5 * scale
    diff = float((mine - ref).abs().max())
    if diff <= tol:
        return None
    return f"lm_head(hidden states) differs from its logits by up to {diff:.3g} (> {tol:.2g})"


def grouped_epoch_callback(trainer: Any) -> Any:
    """A ``TrainerCallback`` that sets the epoch of ``trainer``'s :class:`GroupedSampler` at
    each epoch's start, before the Trainer skips a resumed epoch's first batches and iterates:
    ``int(state.epoch)`` (the epochs done: exact at an epoch's start, ``e + k/n`` in a run
    resumed ``k`` batches into epoch ``e``)."""
    import math

    from transformers import TrainerCallback

    class _GroupedEpoch(TrainerCallback):
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            epoch = math.floor(float(state.epoch or 0))
            found = set_grouped_epoch(kw.get("train_dataloader"), epoch)
            sampler = getattr(trainer, "_grouped_sampler", None)
            if sampler is not None:
                sampler.set_epoch(epoch)
            elif not found:
                logger.debug("no GroupedSampler to set epoch %d on", epoch)

    return _GroupedEpoch()


def make_trainer(
    *,
    model: Any,
    args: Any,
    rows: list[dict[str, list[int]]],
    collator: CausalCollator,
    grouped: bool,
    chunked_loss: bool,
    autocast: str | None,
    callbacks: Sequence[Any] = (),
    trim_heap: bool = False,
) -> tuple[Any, bool]:
    """``(trainer, chunked)``: a Trainer over ``rows`` (length-grouped when ``grouped``), and
    whether it uses the chunked loss (``chunked_loss`` where it applies). ``autocast``: the
    device type of a bf16 run (its loss runs under the same autocast as the forward), else
    ``None``. ``trim_heap`` (CPU runs): the heap's free pages go back to the system inside each
    step (:mod:`scpdr.training.memory`)."""
    from transformers import Trainer

    lengths = [len(r["input_ids"]) for r in rows]

    class _Trainer(Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            if grouped:
                per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
                seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
                self._grouped_sampler = GroupedSampler(lengths, batch_size=per_step, seed=seed)
                return self._grouped_sampler
            return super()._get_train_sampler(train_dataset)

        def compute_loss(
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            if isinstance(self.compute_loss_func, ChunkedCausalLMLoss):
                # hidden states for the chunked loss; the logits of one position, not of all
                inputs = {**inputs, "output_hidden_states": True, "logits_to_keep": 1}
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    trainer = _Trainer(
        model=model,
        args=args,
        train_dataset=ListDataset(rows),
        data_collator=collator,
        callbacks=list(callbacks),
    )
    if grouped:
        trainer.add_callback(grouped_epoch_callback(trainer))
    if autocast is not None:  # read when the Trainer prepares the model (training/memory.py)
        from accelerate.utils import AutocastKwargs

        trainer.accelerator.autocast_handler = AutocastKwargs(cache_enabled=AUTOCAST_CACHE)
    if trim_heap:
        trainer.add_callback(heap_trim_callback())
    chunked = bool(chunked_loss)
    if chunked and (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        logger.info("FSDP/DeepSpeed shard the output layer: the model's own loss is used")
        chunked = False
    if chunked and not _accepts_logits_to_keep(model):
        logger.info("%s takes no logits_to_keep: its own loss is used", type(model).__name__)
        chunked = False
    if chunked:
        why = logits_transform(model)
        if why is None and rows:
            why = head_mismatch(model, rows[0]["input_ids"])
        if why is not None:
            logger.info(
                "%s: its logits are not lm_head(hidden states) (%s): its own loss is used",
                type(model).__name__,
                why,
            )
            chunked = False
    if chunked:
        trainer.compute_loss_func = ChunkedCausalLMLoss(
            model.get_output_embeddings(),
            vocab_size=int(model.config.vocab_size),
            autocast=autocast,
            trim_heap=trim_heap,
        )
    return trainer, chunked
