"""All constituents and the bundle: :func:`train_bundle` audits the partitions, trains one
constituent per partition (:func:`~scpdr.training.finetune.finetune`) and writes the bundle."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.data.manifest import PartitionSet, load_partitions, save_partitions
from scpdr.data.pipeline import PreparedPartitions, audit_for_bundle
from scpdr.errors import ConfigError
from scpdr.training.config import TrainConfig, make_config
from scpdr.training.finetune import finetune
from scpdr.training.placement import is_main_process, main_process_first, wait_for_everyone
from scpdr.training.resume import check_bundle_resume, interrupted_runs

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["MIN_CONSTITUENTS", "check_constituents", "train_bundle"]

#: The fewest constituents of a bundle: every protection method compares K >= 2 models trained
#: on disjoint partitions (a single model is "none", no protection).
MIN_CONSTITUENTS = 2


def check_constituents(k: int, *, fix: str = "use --partitions 2 or more") -> None:
    """Refuse ``k`` < :data:`MIN_CONSTITUENTS` partitions (before anything is read or trained):
    the bundle could not be served protected. ``fix`` says how to get more."""
    if k < MIN_CONSTITUENTS:
        raise ConfigError(
            f"{k} partition(s) would train {k} constituent(s), but the protection methods "
            f"(cp-delta, cp-delta-r, scp-delta-r, ...) need K >= {MIN_CONSTITUENTS} constituents "
            f"trained on disjoint partitions, and `scpdr serve` refuses a bundle with fewer; {fix}"
        )


def train_bundle(
    data: PartitionSet | PreparedPartitions,
    *,
    base: Any,
    config: TrainConfig | dict[str, Any] | None,
    out: str | os.PathLike[str],
    allow_failed_audit: bool = False,
    method: str = "scp-delta-r",
    m: int = 10,
    constant_base_prompts: Sequence[str] | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    device: str | None = None,
    resume: bool | None = None,
) -> Path:
    """Audit the partitions, train one constituent per partition, and write a bundle in ``out``.

    Layout: ``out/partitions/`` (:func:`scpdr.data.manifest.save_partitions`),
    ``out/constituent-<i>/`` (:func:`finetune`), ``out/scpdr.json``
    (:func:`scpdr.models.write_bundle` with the manifest hash and the audit; a constant base
    vector for SCP-Δr-c from ``constant_base_prompts``, default the first 100 validation texts).

    ``data`` is a :class:`PartitionSet` (audited here: a failing audit raises
    :class:`~scpdr.errors.PartitionAuditError` unless ``allow_failed_audit``, which is recorded in
    the bundle's ``audit`` field) or what :func:`scpdr.data.prepare_partitions` returned (its
    audit is used); it must have at least :data:`MIN_CONSTITUENTS` partitions. ``base`` is
    ``"embedded"`` or a model directory. ``device``: where to train (:func:`finetune`).

    ``resume`` (:mod:`scpdr.training.resume`): ``True`` continues an interrupted run in ``out``
    (finished constituents are kept, the one that was training continues from its last
    checkpoint, the rest start) and is an error when ``out`` holds none, or holds one with other
    partitions or settings; ``False`` refuses an interrupted run in ``out`` (``scpdr train``
    without ``--resume``); ``None`` (default) continues one and logs that it does.

    Under ``accelerate launch`` every process calls this with the same data; the constituents are
    trained by all of them together, and only the main process writes the partitions and the
    bundle (:mod:`scpdr.training.placement`).
    """
    from scpdr.models import constant_base_vector, load_model, load_tokenizer, write_bundle

    cfg = make_config(config)
    if isinstance(data, PreparedPartitions):
        pset, audit = data.pset, data.audit_record()
    else:
        pset, audit = data, None
    check_constituents(pset.k, fix="partition the data into 2 or more parts (k >= 2)")
    out = Path(out)
    check_bundle_resume(out, resume)
    wait_for_everyone()  # every process has checked before the main one writes
    pdir = out / "partitions"
    with main_process_first():  # the main process saves the partitions, the others read them
        if (pdir / "manifest.json").is_file():
            saved = load_partitions(pdir)
            if saved.manifest.sha256() != pset.manifest.sha256():
                again = " to resume that run" if resume else ""
                raise ConfigError(
                    f"{out} already holds other partitions ({pdir}: other data, --partitions, "
                    "--seed, field, grouping or canary options than these); rerun with the "
                    f"options that made them{again}, or choose another --out directory"
                )
        if audit is None:
            audit = audit_for_bundle(pset, allow_failed_audit=allow_failed_audit)
        if not (pdir / "manifest.json").is_file() and is_main_process():
            save_partitions(pdir, pset)

    refs = []
    for i, part in enumerate(pset.parts):
        if not part:
            raise ConfigError(f"partition {i} is empty; use fewer partitions or more data")
        logger.info("training constituent %d/%d on %d records", i + 1, pset.k, len(part))
        c_out = out / f"constituent-{i}"
        # resuming the bundle: a constituent that never started starts (nothing to resume)
        c_resume = None if resume and not interrupted_runs(c_out) else resume
        refs.append(
            # the config as given: finetune sizes what it leaves unset to the partition
            finetune(
                part,
                base=base,
                config=config,
                out=c_out,
                callbacks=callbacks,
                device=device,
                resume=c_resume,
            )
        )

    if not is_main_process():  # the main process writes the bundle
        wait_for_everyone()
        return out
    prompts = list(constant_base_prompts or [r.text for r in pset.clean_validation()[:100]])
    vec = None
    if prompts:
        base_model = load_model(base)
        vec = constant_base_vector(base_model, load_tokenizer(base), prompts)
        del base_model
    from scpdr.training.dp import bundle_dp_record

    dp = bundle_dp_record(refs) if cfg.dp else None  # each constituent's ε, δ, σ, q, steps
    path = write_bundle(
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
            **({"dp": dp} if dp is not None else {}),
        },
    )
    wait_for_everyone()
    return path
