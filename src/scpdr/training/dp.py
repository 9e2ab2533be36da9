"""DP fine-tuning: one constituent (or one model on all partitions) trained with DP-SGD (Abadi et
al. 2016) on LoRA adapters, with Opacus' per-example gradients, clipping, noise and accountant
(``scpdr train --dp-epsilon E``; the ``dp`` extra: ``pip install 'scpdr[dp]'``).

What a run does (:func:`finetune_dp`, called by :func:`scpdr.training.finetune` when
``TrainConfig.dp_epsilon`` is set):

- **the unit of privacy is one record**: each training sequence holds one record (no packing;
  a record longer than ``seq_len`` is truncated), and records of one data subject are separate
  units (group privacy applies to them: k records cost k·ε);
- **LoRA only** (``dp_epsilon`` implies ``lora``; DP-LoRA is what microsoft/dp-transformers
  trains): only the adapters get per-example gradients, the base stays frozen;
- **Poisson sampling** as Opacus' ``make_private`` does: each step includes every record
  independently with probability ``q = batch_size / n`` (the expected batch), so a step may be
  empty (it still adds noise: the sampled Gaussian mechanism);
- **the noise multiplier σ for the whole schedule**: the smallest σ with which ``steps`` steps
  at rate ``q`` stay within ``(ε, δ)`` under the PRV accountant (Gopi et al. 2021;
  ``opacus.accountants.utils.get_noise_multiplier(..., accountant="prv")``), ``δ`` default
  ``1/n``; the ε actually spent is recomputed for the recorded ``(σ, q, steps)``
  (:func:`spent_epsilon`) and is at most the target;
- **a plain training loop** (not the HF Trainer, whose loss averages tokens over the whole batch
  and so couples the examples' gradients): each example's loss is its mean token cross-entropy,
  its gradient clipped to ``dp_max_grad_norm`` by Opacus' ``DPOptimizer`` over AdamW, with the
  learning-rate schedule of :class:`~scpdr.training.config.TrainConfig`.

Everything is recorded in ``train_info.json``'s ``dp`` (:class:`DPPlan`) and, per constituent, in
the bundle manifest's ``extra.dp`` (:func:`bundle_dp_record`). A bundle of K constituents each
trained with (ε, δ)-DP on disjoint partitions is (ε, δ)-DP as a whole (each record is in one
partition: parallel composition). DP runs do not checkpoint: an interrupted one starts again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scpdr.data.records import Record, records_hash
from scpdr.errors import ConfigError
from scpdr.io import atomic_write_json, read_json
from scpdr.training.config import TrainConfig, make_config
from scpdr.training.loading import TRAIN_INFO, load_base, untie_lm_head, wrap_lora
from scpdr.training.plan import example_lengths, fit_to_data
from scpdr.training.precision import PrecisionChoice
from scpdr.training.sequences import CausalCollator, build_sequences

logger = logging.getLogger(__name__)

__all__ = [
    "ACCOUNTANT",
    "DP_PRECISION",
    "DPPlan",
    "bundle_dp_record",
    "dp_plan",
    "finetune_dp",
    "require_opacus",
    "spent_epsilon",
]

#: Opacus' accountant the noise is calibrated with (and ε recomputed by). Where its numerics
#: fail (extreme ε, e.g. 10^3 and more at q = 1: "Discrete mean differs significantly"), the
#: RDP accountant (Mironov 2017; a valid, looser bound) is used instead and recorded.
ACCOUNTANT = "prv"
FALLBACK_ACCOUNTANT = "rdp"
#: what a DP run trains in, whatever ``--precision`` says (no autocast around Opacus' hooks)
DP_PRECISION = PrecisionChoice("fp32", "fp32", "DP-SGD trains in fp32")


def require_opacus() -> Any:
    """The ``opacus`` module, or an ImportError with the install hint (STYLE.md 9)."""
    try:
        import opacus
    except ImportError as exc:
        raise ImportError(
            "DP training (--dp-epsilon) needs Opacus: pip install 'scpdr[dp]' "
            "(or pip install opacus==1.6.0)"
        ) from exc
    return opacus


@dataclass(frozen=True)
class DPPlan:
    """The privacy of one DP run: target ``(target_epsilon, delta)``, the noise multiplier σ
    calibrated for ``steps`` steps at Poisson rate ``sample_rate`` (expected batch
    ``sample_rate · n_records``), the clipping norm, and ``epsilon``: what those spend under
    the accountant (≤ the target)."""

    target_epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    max_grad_norm: float
    n_records: int
    epsilon: float
    accountant: str = ACCOUNTANT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"  DP-SGD: (ε = {self.epsilon:.3g}, δ = {self.delta:.3g}) over {self.steps} steps "
            f"(target ε {self.target_epsilon:g}; {self.accountant.upper()} accountant), noise "
            f"multiplier σ = {self.noise_multiplier:.4g}, Poisson rate q = "
            f"{self.sample_rate:.4g} (expected batch {self.sample_rate * self.n_records:.1f} of "
            f"{self.n_records} records), per-record clipping C = {self.max_grad_norm:g}"
        )


def spent_epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = ACCOUNTANT,
) -> float:
    """ε spent by ``steps`` DP-SGD steps with noise multiplier σ at Poisson rate ``q`` (Opacus'
    ``accountant``: "prv" or "rdp")."""
    require_opacus()
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(acc.get_epsilon(delta=float(delta)))


@functools.lru_cache(maxsize=64)
def _calibrate(
    epsilon: float, delta: float, q: float, steps: int, accountant: str
) -> tuple[float, float]:
    """(σ, ε spent) for a target ``(epsilon, delta)``; remembered (the search takes seconds and
    ``scpdr train`` plans, then trains, each constituent)."""
    from opacus.accountants.utils import get_noise_multiplier

    sigma = float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=q,
            steps=steps,
            accountant=accountant,
        )
    )
    eps = spent_epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=steps, delta=delta, accountant=accountant
    )
    return sigma, eps


def dp_plan(cfg: TrainConfig, *, n_records: int, steps: int) -> DPPlan:
    """σ for ``cfg``'s target ε over ``steps`` steps on ``n_records`` records (one per
    sequence), Poisson rate ``min(1, batch_size / n_records)``, δ = ``cfg.dp_delta`` or 1/n."""
    if cfg.dp_epsilon is None:
        raise ConfigError("dp_plan needs a DP config (dp_epsilon set)")
    if n_records < 1 or steps < 1:
        raise ConfigError(f"DP training needs records and steps, got {n_records} and {steps}")
    require_opacus()
    cfg = cfg.resolved()
    q = min(1.0, int(cfg.batch_size) / n_records)
    delta = cfg.dp_delta if cfg.dp_delta is not None else 1.0 / n_records
    try:
        accountant = ACCOUNTANT
        sigma, eps = _calibrate(float(cfg.dp_epsilon), delta, q, int(steps), accountant)
    except RuntimeError as exc:  # PRV's numerics at extreme settings
        logger.warning("PRV accountant failed (%s); calibrating with RDP instead", exc)
        accountant = FALLBACK_ACCOUNTANT
        sigma, eps = _calibrate(float(cfg.dp_epsilon), delta, q, int(steps), accountant)
    return DPPlan(
        target_epsilon=float(cfg.dp_epsilon),
        delta=delta,
        noise_multiplier=sigma,
        sample_rate=q,
        steps=int(steps),
        max_grad_norm=float(cfg.dp_max_grad_norm),
        n_records=n_records,
        epsilon=eps,
        accountant=accountant,
    )


def bundle_dp_record(constituents: Sequence[str | os.PathLike[str]]) -> dict[str, Any] | None:
    """The bundle manifest's ``extra.dp``: each constituent's :class:`DPPlan` and the bundle's
    guarantee (the largest ε and δ: parallel composition over disjoint partitions); None when no
    constituent was trained with DP."""
    plans = []
    for c in constituents:
        info_path = Path(c) / TRAIN_INFO
        dp = read_json(info_path).get("dp") if info_path.is_file() else None
        plans.append(dp)
    if not any(plans):
        return None
    if not all(plans):
        raise ConfigError("a bundle mixes DP and non-DP constituents; train them all with DP")
    return {
        "epsilon": max(p["epsilon"] for p in plans),
        "delta": max(p["delta"] for p in plans),
        "accountant": "/".join(sorted({p["accountant"] for p in plans})),
        "composition": "parallel (disjoint partitions)",
        "constituents": plans,
    }


def _example_losses(logits: Any, labels: Any) -> Any:
    """Each example's mean token cross-entropy (``float32[B]``): ``logits`` (B, T, V), labels
    (B, T) with -100 where no loss; shifted so position t predicts token t + 1."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    target = labels[:, 1:]  # (B, T-1)
    mask = target != -100
    tok = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return -(tok * mask).sum(1) / mask.sum(1).clamp_min(1)


def finetune_dp(
    records: Sequence[Record],
    *,
    base: Any,
    config: TrainConfig | dict[str, Any] | None,
    out: str | os.PathLike[str],
    overwrite: bool = False,
    device: str | None = None,
) -> Path:
    """Fine-tune LoRA adapters of ``base`` on ``records`` with DP-SGD and write them to ``out``
    atomically (adapter or merged model, tokenizer, ``train_info.json`` with ``dp``). The
    arguments are :func:`scpdr.training.finetune`'s; ``config.dp_epsilon`` must be set."""
    require_opacus()
    import torch
    import transformers
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from scpdr.training.placement import training_device

    cfg = make_config(config)
    if not cfg.dp:
        raise ConfigError("finetune_dp needs dp_epsilon set (TrainConfig.dp_epsilon)")
    records = list(records)
    if not records:
        raise ConfigError("finetune needs at least one record")
    dev = training_device(device)
    out = Path(out)
    base_key = os.fspath(base) if not isinstance(base, tuple) else "in-memory"
    data_hash = records_hash(records)
    fp = hashlib.sha256(f"{cfg.fingerprint()}|{data_hash}|{base_key}".encode()).hexdigest()
    info_path = out / TRAIN_INFO
    if info_path.is_file():
        if read_json(info_path).get("fingerprint") == fp:
            logger.info("%s already trained with these settings; skipping", out)
            return out
        if not overwrite:
            raise ConfigError(
                f"{out} holds a model trained with other data or settings; delete {out} or "
                "choose another --out directory"
            )
    elif out.exists() and not overwrite:
        raise ConfigError(f"{out} exists and is not a finished training run; remove it first")
    stage = out.parent / f"{out.name}.tmp-dp-{fp[:16]}"
    shutil.rmtree(stage, ignore_errors=True)  # DP runs keep no checkpoint: start again

    model, tok, base_ref = load_base(base)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    cfg, plan = fit_to_data(
        config, example_lengths(records, tok), name=out.name, precision=DP_PRECISION
    )
    rows = build_sequences(
        records,
        tok,
        seq_len=cfg.seq_len,
        packing=False,
        seed=cfg.seed,
        shuffle=cfg.shuffle_examples,
    )  # one record per sequence: the unit of privacy
    n = len(rows)
    dp = dp_plan(cfg, n_records=n, steps=plan.total_steps)
    logger.info("%s: %s", out.name, dp.summary().strip())
    model.config.use_cache = False
    merge_lora = cfg.merge_lora
    if base_ref != "embedded" and not Path(base_ref).is_dir() and not merge_lora:
        merge_lora = True  # an in-memory base cannot back an adapter
    transformers.set_seed(cfg.seed)
    model = wrap_lora(model, cfg).to(dev)
    model.train()
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    params = [p for p in gsm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(cfg.learning_rate), weight_decay=cfg.weight_decay)
    noise = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    dp_opt = DPOptimizer(
        opt,
        noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.max_grad_norm,
        expected_batch_size=max(1, round(dp.sample_rate * n)),
        loss_reduction="mean",  # the noisy sum of clipped gradients / the expected batch
        generator=noise,
    )
    sched = transformers.get_scheduler(
        cfg.lr_scheduler,
        optimizer=opt,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=dp.steps,
    )
    collate = CausalCollator(  # each Poisson batch padded to its longest record, rounded up
        goldfish_k=cfg.goldfish_k if cfg.goldfish else None,
        goldfish_h=cfg.goldfish_h,
        pad_token_id=tok.eos_token_id,
        pad_to_multiple_of=plan.pad_to_multiple_of,  # resolved by the plan (DP never packs)
    )
    sampler = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, Any]] = []
    t0 = time.time()
    for step in range(dp.steps):
        chosen = torch.nonzero(torch.rand(n, generator=sampler) < dp.sample_rate).flatten()
        if len(chosen):
            batch = {k: v.to(dev) for k, v in collate([rows[i] for i in chosen]).items()}
            logits = gsm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            losses = _example_losses(logits.logits, batch["labels"])  # (B,)
            losses.sum().backward()
            loss = float(losses.mean())
        else:  # an empty Poisson batch: the step is noise alone
            for p in params:
                p.grad_sample = torch.zeros((0, *p.shape), device=p.device, dtype=p.dtype)
            loss = float("nan")
        dp_opt.step()
        sched.step()
        dp_opt.zero_grad(set_to_none=True)
        if step % cfg.logging_steps == 0 or step == dp.steps - 1:
            history.append({"step": step + 1, "loss": loss, "batch": len(chosen)})
            logger.info(
                "%s: DP step %d/%d, batch %d, loss %.4f",
                out.name,
                step + 1,
                dp.steps,
                len(chosen),
                loss,
            )
    elapsed = time.time() - t0
    final = gsm.to_standard_module() if hasattr(gsm, "to_standard_module") else gsm._module
    final.peft_config["default"].base_model_name_or_path = base_ref
    if merge_lora:
        untie_lm_head(final.get_base_model())
        final = final.merge_and_unload()
        final.save_pretrained(str(stage))
    else:
        final.save_pretrained(str(stage), save_embedding_layers=False)
    tok.save_pretrained(str(stage))
    info = {
        "fingerprint": fp,
        "config": cfg.model_dump(mode="json"),
        "plan": plan.to_dict(),
        "dp": dp.to_dict(),
        "base": base_ref,
        "seeds": {"seed": cfg.seed, "data_seed": cfg.seed},
        "data": {"records": len(records), "records_sha256": data_hash, "sequences": n},
        "global_step": dp.steps,
        "train_loss": next((h["loss"] for h in reversed(history) if h["loss"] == h["loss"]), None),
        "log_history": history,
        "train_seconds": elapsed,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "opacus": require_opacus().__version__,
            "python": platform.python_version(),
        },
        "adapter": not merge_lora,
        "placement": {"device": dev, "processes": 1},
    }
    atomic_write_json(stage / TRAIN_INFO, info)
    if out.exists():
        shutil.rmtree(out)
    os.replace(stage, out)
    return out
