"""Interrupted runs and resuming them, explicitly (after the Trainer's ``resume_from_checkpoint``:
a run continues from a checkpoint only when asked).

One constituent (:func:`~scpdr.training.finetune.finetune`) trains in ``<out>.tmp-<fingerprint>``,
which holds ``run.json`` (what it trains: the fingerprint, the resolved config, the records' hash,
the base, the optimizer) and its checkpoints; :func:`choose_checkpoint` decides from them whether
to resume, start from step 0, or refuse. A bundle (``scpdr train --out B``,
:func:`~scpdr.training.bundle.train_bundle`) is interrupted when ``B/partitions/`` was saved but
``B/scpdr.json`` was not written; :func:`check_bundle_resume` refuses to resume what is not there
and to start over what is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from scpdr.errors import ConfigError
from scpdr.io import read_json
from scpdr.training.config import NOT_IN_FINGERPRINT
from scpdr.training.placement import same_update

__all__ = [
    "RUN_INFO",
    "check_bundle_resume",
    "choose_checkpoint",
    "interrupted_bundle",
    "interrupted_runs",
    "latest_checkpoint",
]

logger = logging.getLogger(__name__)

#: What an unfinished run trains (fingerprint, config, data, base), in its staging directory.
RUN_INFO = "run.json"


def latest_checkpoint(d: Path) -> Path | None:
    """The ``checkpoint-<step>`` of ``d`` with the highest step and a ``trainer_state.json``."""
    ckpts = [p for p in d.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    ckpts = [p for p in ckpts if (p / "trainer_state.json").is_file()]
    return max(ckpts, key=_step) if ckpts else None


def interrupted_runs(out: str | os.PathLike[str]) -> list[tuple[Path, Path | None]]:
    """The unfinished runs of ``out``: ``(staging dir, its last checkpoint or None)`` for every
    ``<out>.tmp-*`` directory, oldest first."""
    out = Path(out)
    dirs = sorted(
        (d for d in out.parent.glob(f"{out.name}.tmp-*") if d.is_dir()),
        key=lambda d: d.stat().st_mtime,
    )
    return [(d, latest_checkpoint(d)) for d in dirs]


def _step(ckpt: Path) -> int:
    return int(ckpt.name.rsplit("-", 1)[-1])


def _differences(tmp: Path, run: dict[str, Any]) -> str:
    """How the run recorded in ``tmp/run.json`` differs from ``run`` (settings, data, base)."""
    path = tmp / RUN_INFO
    if not path.is_file():
        return "its settings, data or base model (it keeps no run.json to say which)"
    old = read_json(path)
    diffs = []
    # both as TrainConfig reads them (a former `bf16: false` is `precision: fp32`); the precision
    # compared is the one each trained in (below), not the asked-for one
    a, b = _normalised(old.get("config", {})), _normalised(run["config"])
    for key in sorted((set(a) | set(b)) - set(NOT_IN_FINGERPRINT) - {"precision"}):
        if a.get(key) != b.get(key):
            diffs.append(f"{key} (interrupted run: {a.get(key)!r}, now: {b.get(key)!r})")
    if old.get("records_sha256") != run["records_sha256"]:
        diffs.append(
            f"the training records ({old.get('records')} records then, {run['records']} now)"
        )
    if old.get("base") != run["base"]:
        diffs.append(f"the base model ({old.get('base')!r} then, {run['base']!r} now)")
    if not same_update(old.get("optim"), run["optim"]):
        diffs.append(f"the optimizer ({old.get('optim')!r} then, {run['optim']!r} now)")
    then, now = old.get("precision") or _ran(a), run.get("precision") or _ran(b)
    if then != now:
        diffs.append(f"the precision ({then!r} then, {now!r} now; --precision {then} continues it)")
    return "; ".join(diffs) or "nothing its run.json records"


def _normalised(config: Any) -> dict[str, Any]:
    """A recorded config as :class:`TrainConfig` reads it (resolved), or as it is where it does
    not validate."""
    from scpdr.training.config import TrainConfig

    if not isinstance(config, dict):
        return {}
    try:
        return TrainConfig.from_dict(dict(config)).resolved().model_dump(mode="json")
    except ConfigError:
        return dict(config)


def _ran(config: dict[str, Any]) -> str:
    """The precision a config trains in where the run recorded none: what it asks for (a run
    from before ``precision`` existed had ``bf16``: read as fp32 or bf16), ``auto`` as fp32."""
    asked = config.get("precision", "fp32")
    return asked if asked in ("fp32", "bf16") else "fp32"


def choose_checkpoint(
    out: Path, tmp: Path, run: dict[str, Any], resume: bool | None
) -> Path | None:
    """The checkpoint ``finetune`` resumes from (``None``: train from step 0), or a
    :class:`~scpdr.errors.ConfigError` saying why neither can be done.

    ``tmp`` is this run's staging directory and ``run`` what it trains (``run.json``);
    ``resume`` as :func:`~scpdr.training.finetune.finetune` documents it."""
    mine = latest_checkpoint(tmp) if tmp.is_dir() else None
    others = [(d, c) for d, c in interrupted_runs(out) if d != tmp and c is not None]
    if mine is None and others and resume is not None:
        d, c = others[-1]
        how = (
            "rerun with its settings (its run.json works as --config)"
            if resume
            else "pass --resume (in Python: resume=True) with its settings to continue it"
        )
        raise ConfigError(
            f"{out} has an interrupted run (last checkpoint at step {_step(c)}, in {d}) with "
            f"other settings; it differs in {_differences(d, run)}. To continue it, {how}; to "
            f"train with these settings, delete {d}"
        )
    if resume is False and mine is not None:
        raise ConfigError(
            f"{out} has an interrupted run with these settings (last checkpoint at step "
            f"{_step(mine)}, in {tmp}); pass --resume (in Python: resume=True) to continue it, "
            "or delete that directory to start over"
        )
    if resume is True and mine is None:
        if not tmp.is_dir():
            raise ConfigError(
                f"nothing to resume for {out}: no interrupted run ({out.name}.tmp-*) in "
                f"{out.parent}; train without --resume (resume=True) to start one"
            )
        logger.info("%s was interrupted before its first checkpoint: training from step 0", out)
    if mine is not None:
        logger.info(
            "resuming %s from %s (step %d): an interrupted run with the same settings and data",
            out,
            mine.name,
            _step(mine),
        )
    for d, c in others:  # resume is None here: another run's leftovers are kept, not used
        logger.warning(
            "%s holds an interrupted run of %s with other settings or data (step %d); it is "
            "not resumed: delete it to free its space",
            d,
            out.name,
            _step(c),
        )
    return mine


def interrupted_bundle(out: str | os.PathLike[str]) -> str | None:
    """What an interrupted ``scpdr train --out OUT`` left in ``out`` (one line per constituent:
    finished, at its last checkpoint, or not started), or ``None`` when ``out`` holds no
    interrupted run (nothing there, or a finished bundle)."""
    out = Path(out)
    if not (out / "partitions" / "manifest.json").is_file() or (out / "scpdr.json").is_file():
        return None
    k = int(read_json(out / "partitions" / "manifest.json").get("k", 0) or 0)
    states = []
    for i in range(k):
        c = out / f"constituent-{i}"
        ckpts = [ck for _, ck in interrupted_runs(c) if ck is not None]
        if (c / "train_info.json").is_file():
            states.append(f"{c.name} finished")
        elif ckpts:
            states.append(f"{c.name} at step {max(_step(ck) for ck in ckpts)}")
        else:
            states.append(f"{c.name} not checkpointed")
    return ", ".join(states) or "partitions saved, no constituent started"


def check_bundle_resume(out: str | os.PathLike[str], resume: bool | None) -> None:
    """Refuse ``resume=True`` when ``out`` holds no interrupted run, and ``resume=False`` when
    it does (naming ``--resume``); ``None`` accepts both (a rerun continues where it stopped)."""
    state = interrupted_bundle(out)
    if resume is True and state is None:
        if (Path(out) / "scpdr.json").is_file():
            raise ConfigError(
                f"nothing to resume: {out} is a finished bundle (scpdr.json); serve it, or "
                "choose another --out to train again"
            )
        raise ConfigError(
            f"nothing to resume in {out}: no interrupted `scpdr train --out {out}` there (no "
            "partitions/ without scpdr.json); run the command without --resume to start"
        )
    if resume is False and state is not None:
        raise ConfigError(
            f"{out} holds an interrupted `scpdr train` run ({state}); pass --resume to continue "
            f"it from its last checkpoints with the same data and options, or delete {out} (or "
            "choose another --out) to start over"
        )
    if state is not None:
        logger.info("resuming the interrupted run in %s (%s)", out, state)
