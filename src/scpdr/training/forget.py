"""Forget records of a bundle: train again only the constituents whose partition held them, copy
the others byte for byte (``scpdr forget``; docs/training.md, "Forgetting records").

With K disjoint partitions a record was seen by one constituent only (the partition audit,
paper Def. 2.1: each protected example is absent from at least one constituent's data), so
honouring a deletion request means training that one constituent again on its partition without
the record — 1/K of the work, the idea of SISA (Bourtoule et al., "Machine Unlearning", IEEE
S&P 2021). :func:`forget_records` does it for a bundle written by ``scpdr train``:

1. resolves the request (:func:`scpdr.data.deletion.select_deletion`: ids, whole data subjects,
   or every record holding a declared secret that matches a regular expression) and removes the
   records, every other record staying in the partition it had
   (:func:`~scpdr.data.deletion.without_records`);
2. audits the new partitions again (:func:`scpdr.data.pipeline.audit_for_bundle`);
3. trains each changed constituent again with exactly the settings it was trained with (its
   ``train_info.json``: the :class:`~scpdr.training.config.TrainConfig` after sizing, seed
   included) and the bundle's base; hard-links (or copies) every other constituent and the base;
4. writes the manifest with a deletion log entry (:class:`scpdr.models.bundle.Deletion`: when,
   how many records, which partitions; the ids as ``sha256(salt + id)`` with the bundle's salt,
   never a text) and keeps the removed records in ``OUT/forgotten/`` (owner-only, like the
   partitions; ``scpdr export`` never copies it) for ``scpdr eval OUT --forgotten``.

``OUT`` is built in ``.OUT.forget-tmp`` beside it and renamed when complete; an interrupted run
continues where it stopped when the same command runs again (training resumes from its last
checkpoint, :mod:`scpdr.training.resume`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets as _secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scpdr.data.deletion import (
    DeletionSelection,
    remaining_near_duplicates,
    select_deletion,
    without_records,
)
from scpdr.data.manifest import (
    CONTAMINATED_VALIDATION,
    VALIDATION_NAME,
    PartitionSet,
    load_partitions,
    partition_file,
    save_partitions,
)
from scpdr.data.records import Record, load_records, records_hash, save_records
from scpdr.errors import BundleError, ConfigError
from scpdr.io import atomic_write_json, read_json, sha256_file
from scpdr.training.config import TrainConfig
from scpdr.training.loading import TRAIN_INFO
from scpdr.training.plan import recorded_batching

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

    from scpdr.models.bundle import BundleManifest

logger = logging.getLogger(__name__)

__all__ = [
    "FORGOTTEN_DIR",
    "ForgetResult",
    "deletion_hash",
    "forget_records",
    "load_forgotten",
    "source_bundle",
    "was_forgotten",
]

#: Where a bundle made by :func:`forget_records` keeps the records it no longer holds
#: (``partition-<i>.jsonl``, ``validation.jsonl``): what ``scpdr eval --forgotten`` attacks.
FORGOTTEN_DIR = "forgotten"
#: What an unfinished forget builds (in its staging directory): the source and the request.
_STATE = "forget.json"


def deletion_hash(salt: str, record_id: str) -> str:
    """``sha256(salt + id)`` (hex; ``salt`` in hex): how a deletion log names a record."""
    return hashlib.sha256(bytes.fromhex(salt) + record_id.encode("utf-8")).hexdigest()


def was_forgotten(manifest: BundleManifest, record_id: str) -> bool:
    """Whether the bundle's deletion log lists ``record_id`` (by its salted hash)."""
    return any(
        d.salt is not None and deletion_hash(d.salt, record_id) in d.id_hashes
        for d in manifest.deletions
    )


@dataclass(frozen=True)
class ForgetResult:
    """What :func:`forget_records` did: the new bundle, the records removed (training and
    validation), the constituents trained again and copied, the records left behind that copy a
    removed one (``(removed id, kept id, partition)``), the audit, and the wall time per step
    (``select``, ``copy``, ``audit``, ``train``, ``write``, ``total``, seconds)."""

    path: Path
    selection: str
    records: int
    validation_records: int
    retrained: list[int]
    copied: list[int]
    near_duplicates: list[tuple[str, str, int]]
    audit: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"forgot {self.records} training record(s)"
            + (
                f" and {self.validation_records} validation record(s)"
                if self.validation_records
                else ""
            )
            + f" ({self.selection}); wrote {self.path}",
            "  retrained: "
            + (", ".join(f"constituent-{i}" for i in self.retrained) or "none")
            + "; copied unchanged: "
            + (", ".join(f"constituent-{i}" for i in self.copied) or "none"),
            f"  partition audit {'PASSED' if self.audit.get('passed') else 'FAILED (overridden)'}",
            f"  took {self.seconds.get('total', 0.0):.1f} s (training "
            f"{self.seconds.get('train', 0.0):.1f} s, copying {self.seconds.get('copy', 0.0):.1f} s)",
        ]
        for gone, kept, p in self.near_duplicates[:10]:
            lines.append(
                f"  WARNING: {kept!r} (partition {p}, kept) copies forgotten {gone!r}: the "
                "retrained constituent still learns that text; forget it too (--ids)"
            )
        return "\n".join(lines)


def _inside(path: Path, root: Path) -> Path | None:
    """``path`` relative to ``root`` when it lies inside it, else None."""
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return None


def _link_tree(src: Path, dst: Path) -> None:
    """``dst``: the files of ``src`` hard-linked (same bytes, no extra disk; copied where the
    file system cannot link). Built as ``dst.partial`` and renamed, so a rerun redoes a cut one."""
    if dst.is_dir():
        return
    part = dst.with_name(dst.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, part, copy_function=link)
    os.replace(part, dst)


def _retarget_adapter(model_dir: Path, source: Path, new_root: Path, final_root: Path) -> None:
    """Point a PEFT adapter whose base lies inside ``source`` or ``new_root`` (the bundle being
    built) at its copy, relative to the adapter (``../base``): the source may be deleted after the
    deletion, and ``new_root`` is renamed. Written atomically (a hard link is replaced, the
    source's file is left alone)."""
    cfg_path = model_dir / "adapter_config.json"
    if not cfg_path.is_file():
        return
    cfg = read_json(cfg_path)
    base = Path(str(cfg.get("base_model_name_or_path") or ""))
    if not base.is_absolute():
        return
    rel = _inside(base, source) or _inside(base, new_root) or _inside(base, final_root)
    if rel is None:
        return
    cfg["base_model_name_or_path"] = os.path.relpath(new_root / rel, model_dir)
    atomic_write_json(cfg_path, cfg)


def _recorded_config(
    bundle: Path, manifest: BundleManifest, pset: PartitionSet, i: int
) -> TrainConfig:
    """The settings constituent ``i`` was trained with (its ``train_info.json``), after checking
    that it was trained on partition ``i``."""
    from scpdr.models.bundle import resolve_ref

    cdir = Path(resolve_ref(bundle, manifest.constituents[i]))
    info_path = cdir / TRAIN_INFO
    if not info_path.is_file():
        raise ConfigError(
            f"{cdir} has no {TRAIN_INFO}: it was not trained by `scpdr train`, so `scpdr "
            "forget` cannot train it again with the same settings; train a new bundle on the "
            "remaining data instead"
        )
    info = read_json(info_path)
    if not isinstance(info.get("config"), dict):
        raise ConfigError(f"{info_path} records no training config; train a new bundle instead")
    cfg = TrainConfig.from_dict(info["config"], what=f"training config of {info_path}")
    cfg = _as_trained(cfg, info)
    seed = (info.get("seeds") or {}).get("seed", cfg.seed)
    if seed != cfg.seed:
        raise BundleError(f"{info_path} records seed {seed} but its config seed {cfg.seed}")
    trained_on = (info.get("data") or {}).get("records_sha256")
    if trained_on is not None and trained_on != records_hash(pset.parts[i]):
        raise BundleError(
            f"constituent {i} ({cdir}) was trained on other records than partition {i} of "
            f"{bundle}; the bundle's partitions do not say what it saw, so forgetting cannot be "
            "done by training it again"
        )
    return cfg


def _as_trained(cfg: TrainConfig, info: dict[str, Any]) -> TrainConfig:
    """``cfg`` with what ``train_info.json`` says the run resolved pinned: the precision it
    trained in (``auto`` decides again on another machine, or after a re-measurement) and,
    with ``group_by_length`` unset, the grouping it used (``plan.grouped``; a run from before
    grouping existed trained in random order: ``False``), and with ``pad_to_multiple_of``
    unset, its batches' padding multiple (``plan.pad_to_multiple_of``; before it existed: 1)."""
    update: dict[str, Any] = {}
    ran = info.get("precision")
    ran = ran.get("precision") if isinstance(ran, dict) else ran
    if cfg.precision == "auto" and ran in ("fp32", "bf16"):
        update["precision"] = ran
    plan = info.get("plan")
    update.update(recorded_batching(cfg, plan if isinstance(plan, dict) else {}))
    return cfg.model_copy(update=update) if update else cfg


def _train_base(bundle: Path, manifest: BundleManifest, new_root: Path) -> str:
    """The base model to train from: the bundle's (its copy inside ``new_root`` when it lies in
    the bundle)."""
    from scpdr.models.bundle import resolve_ref

    if manifest.base is None:
        raise BundleError(
            f"bundle {bundle} names no base model, so its constituents cannot be trained again; "
            "train a new bundle on the remaining data"
        )
    ref = resolve_ref(bundle, manifest.base)
    rel = None if ref == "embedded" else _inside(Path(ref), bundle)
    return ref if rel is None else str(new_root / rel)


def _source_state(
    bundle: Path, selection: DeletionSelection, manifest_sha256: str
) -> dict[str, Any]:
    removed = hashlib.sha256("\n".join(sorted(selection.ids)).encode("utf-8")).hexdigest()
    return {
        "source": str(bundle.resolve()),
        "source_sha256": manifest_sha256,
        "removed_sha256": removed,
    }


def _begin(tmp: Path, state: dict[str, Any], out: Path) -> None:
    """Create the staging directory, or continue the one an interrupted run of the same request
    left; refuse one of another request."""
    if tmp.is_dir():
        old = read_json(tmp / _STATE) if (tmp / _STATE).is_file() else None
        if old != state:
            raise ConfigError(
                f"{tmp} holds an interrupted `scpdr forget --out {out}` of other records or "
                f"another bundle; rerun that command to finish it, or delete {tmp} to start this one"
            )
        logger.info("continuing the interrupted forget in %s", tmp)
        return
    tmp.mkdir(parents=True)
    atomic_write_json(tmp / _STATE, state)


def _save_forgotten(root: Path, selection: DeletionSelection) -> None:
    d = root / FORGOTTEN_DIR
    d.mkdir(exist_ok=True)
    d.chmod(0o700)
    for p in selection.partitions:
        save_records(d / partition_file(p), selection.by_partition[p])
    if selection.validation:
        save_records(d / VALIDATION_NAME, selection.validation)


def load_forgotten(bundle: str | os.PathLike[str]) -> tuple[dict[int, list[Record]], list[Record]]:
    """The records a bundle made by :func:`forget_records` no longer holds: ``({partition:
    records}, validation records)``. Raises :class:`BundleError` when it keeps none."""
    d = Path(bundle) / FORGOTTEN_DIR
    if not d.is_dir():
        raise BundleError(
            f"{bundle} keeps no forgotten records ({FORGOTTEN_DIR}/): it was not made by `scpdr "
            "forget`, or they were deleted after the check"
        )
    parts = {}
    for f in sorted(d.glob("partition-*.jsonl")):
        parts[int(f.stem.split("-")[-1])] = load_records(f)
    val = load_records(d / VALIDATION_NAME) if (d / VALIDATION_NAME).is_file() else []
    return dict(sorted(parts.items())), val


def source_bundle(bundle: str | os.PathLike[str], manifest: BundleManifest | None = None) -> Path:
    """The bundle the last deletion of ``bundle`` removed records from (its log's ``source``)."""
    from scpdr.models import read_bundle

    manifest = manifest or read_bundle(bundle)
    if not manifest.deletions or manifest.deletions[-1].source is None:
        raise BundleError(
            f"{bundle} has no deletion log naming its source bundle; pass --before BUNDLE"
        )
    src = Path(manifest.deletions[-1].source)
    if not (src / "scpdr.json").is_file():
        raise BundleError(
            f"the bundle {bundle} was made from ({src}) is gone; pass --before BUNDLE if it "
            "moved (once the check is done, deleting it is right: it still holds the records)"
        )
    return src


def _constant_base(
    src: Path, manifest: BundleManifest, pset: PartitionSet, edited: PartitionSet, base: str
) -> Any:
    """The constant base vector of SCP-Δr-c: the source's, or computed again (as ``scpdr train``
    does: the base's mean logits over the first 100 clean validation texts) when a removed
    validation record was one of those texts."""
    from scpdr.models import constant_base_vector, load_constant_base, load_model, load_tokenizer

    vec = load_constant_base(src, manifest)
    used = {r.id for r in pset.clean_validation()[:100]}
    kept = {r.id for r in edited.clean_validation()}
    if vec is None or not (used - kept):
        return vec
    prompts = [r.text for r in edited.clean_validation()[:100]]
    if not prompts:
        logger.warning("no validation text left for the constant base vector; SCP-Δr-c dropped")
        return None
    logger.info("a forgotten validation text was one of the constant base's prompts: recomputing")
    return constant_base_vector(load_model(base), load_tokenizer(base), prompts)


def forget_records(
    bundle: str | os.PathLike[str],
    *,
    ids: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
    secret_matching: str | None = None,
    out: str | os.PathLike[str],
    device: str | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    allow_failed_audit: bool = False,
) -> ForgetResult:
    """Write ``out``: the bundle ``bundle`` without the named records (see the module docstring).

    Exactly one of ``ids``, ``groups`` (data subjects: every record of the group) or
    ``secret_matching`` (a regular expression over the declared secrets) names the records
    (:func:`scpdr.data.deletion.select_deletion`). ``out`` must not exist. Every check (the
    request, the recorded settings, the audit of the new partitions) runs before any training.
    A failing audit raises :class:`~scpdr.errors.PartitionAuditError` unless the source's audit
    was already overridden or ``allow_failed_audit``. ``device``: where to train.
    """
    from scpdr.data.pipeline import audit_for_bundle
    from scpdr.models import read_bundle, resolve_ref, write_bundle
    from scpdr.models.bundle import Deletion
    from scpdr.training.finetune import finetune

    t_start = time.perf_counter()
    src, out = Path(bundle), Path(out)
    manifest = read_bundle(src)
    if out.exists():
        raise ConfigError(f"--out {out} already exists; forget writes a new bundle: choose another")
    rel = manifest.extra.get("partitions")
    if not rel or not (src / rel / "manifest.json").is_file():
        raise BundleError(
            f"bundle {src} does not hold its partitions (extra.partitions), so nothing says "
            "which constituent saw a record; `scpdr forget` works on bundles of `scpdr train`"
        )
    pset = load_partitions(src / rel)
    if manifest.partition_manifest_hash not in (None, pset.manifest.sha256()):
        raise BundleError(
            f"{src / rel} changed since the bundle was written (its hash differs from the "
            "manifest's partition_manifest_hash); restore it before forgetting"
        )
    if len(manifest.constituents) != pset.k:
        raise BundleError(
            f"{src} has {len(manifest.constituents)} constituents for {pset.k} partitions"
        )
    selection = select_deletion(pset, ids=ids, groups=groups, secret_matching=secret_matching)
    edited = without_records(pset, selection)
    retrain = selection.partitions
    configs = {p: _recorded_config(src, manifest, pset, p) for p in retrain}
    near = remaining_near_duplicates(edited, selection)
    for gone, kept, p in near:
        logger.warning(
            "record %r (partition %d) copies the forgotten %r and stays: its constituent still "
            "learns that text; add it to the request",
            kept,
            p,
            gone,
        )
    t_select = time.perf_counter()
    allow = allow_failed_audit or bool((manifest.audit or {}).get("overridden"))
    audit = audit_for_bundle(edited, allow_failed_audit=allow, override="`--allow-failed-audit`")
    if audit.get(CONTAMINATED_VALIDATION):  # forced through: the attacks leave them out
        edited.manifest.dataset[CONTAMINATED_VALIDATION] = audit[CONTAMINATED_VALIDATION]
    t_audit = time.perf_counter()

    tmp = out.parent / f".{out.name}.forget-tmp"
    out.parent.mkdir(parents=True, exist_ok=True)
    source_sha256 = sha256_file(src / "scpdr.json")  # the deletion log's and the resume check's
    _begin(tmp, _source_state(src, selection, source_sha256), out)
    base = _train_base(src, manifest, tmp)
    if base != resolve_ref(src, manifest.base or ""):  # the base lies in the bundle: copy it
        _link_tree(Path(resolve_ref(src, manifest.base or "")), Path(base))
    k = pset.k
    copied = [i for i in range(k) if i not in retrain]
    for i in copied:
        _link_tree(Path(resolve_ref(src, manifest.constituents[i])), tmp / f"constituent-{i}")
        _retarget_adapter(tmp / f"constituent-{i}", src, tmp, out)
    save_partitions(tmp / "partitions", edited, overwrite=True)
    _save_forgotten(tmp, selection)
    t_copy = time.perf_counter()

    for p in retrain:
        logger.info(
            "training constituent %d again on %d records (%d forgotten), with its recorded "
            "settings (seed %d)",
            p,
            len(edited.parts[p]),
            len(selection.by_partition[p]),
            configs[p].seed,
        )
        finetune(
            edited.parts[p],
            base=base,
            config=configs[p],
            out=tmp / f"constituent-{p}",
            callbacks=callbacks,
            device=device,
        )
        _retarget_adapter(tmp / f"constituent-{p}", src, tmp, out)
    t_train = time.perf_counter()

    salt = next((d.salt for d in reversed(manifest.deletions) if d.salt), None)
    salt = salt or _secrets.token_hex(16)
    entry = Deletion(
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        selection=selection.kind,
        records=len(selection.training),
        validation_records=len(selection.validation),
        partitions=retrain,
        copied=copied,
        id_hashes=sorted(deletion_hash(salt, i) for i in selection.ids),
        salt=salt,
        source=str(src.resolve()),
        source_sha256=source_sha256,
    )
    refs = [tmp / f"constituent-{i}" for i in range(k)]
    extra = dict(manifest.extra)
    if extra.get("dp") is not None:  # each constituent's ε, δ: the retrained ones' are new
        from scpdr.training.dp import bundle_dp_record

        extra["dp"] = bundle_dp_record(refs)
    write_bundle(
        tmp,
        base=base if manifest.base is not None else None,
        constituents=refs,
        method=manifest.method,
        m=manifest.m,
        partition_manifest_hash=edited.manifest.sha256(),
        audit=audit,
        constant_base=_constant_base(src, manifest, pset, edited, base),
        extra=extra,
        deletions=[*manifest.deletions, entry],
    )
    (tmp / _STATE).unlink()
    os.replace(tmp, out)
    t_end = time.perf_counter()
    seconds = {
        "select": t_select - t_start,
        "audit": t_audit - t_select,
        "copy": t_copy - t_audit,
        "train": t_train - t_copy,
        "write": t_end - t_train,
        "total": t_end - t_start,
    }
    return ForgetResult(
        path=out,
        selection=selection.kind,
        records=len(selection.training),
        validation_records=len(selection.validation),
        retrained=retrain,
        copied=copied,
        near_duplicates=near,
        audit=audit,
        seconds=seconds,
    )
