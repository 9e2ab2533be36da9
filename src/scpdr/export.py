"""A serving-only copy of a bundle: what a server needs, nothing of the private data.

:func:`export_bundle` copies the base model (or keeps the reference ``"embedded"``), the
constituents and the constant base vector of SCP-Δr-c, and writes a new ``scpdr.json`` (method,
m, the audit's verdict) and ``export.json``: the sha256 of every file, so the serving host can
check what it got (:func:`verify_export`). It leaves out the partitions (training texts and
declared secrets), the validation records, the canaries, the training logs (``train_info.json``),
checkpoints, the bundle's ``extra`` (which names where the data was), the records ``scpdr forget``
removed (``forgotten/``) and the deletion log's record hashes and source path. It checks the copied
non-weight files for every training text and declared secret before it finishes, and refuses if
one is there (docs/deployment.md: the constituents themselves remain as sensitive as the data).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from scpdr.errors import BundleError, ConfigError
from scpdr.io import sha256_file

__all__ = ["EXPORT_MANIFEST", "export_bundle", "verify_export"]

#: The file listing every exported file with its sha256.
EXPORT_MANIFEST = "export.json"
#: Files of a model directory a server never reads (training records of the run, logs).
_SKIP_FILES = frozenset({"train_info.json", "trainer_state.json", "training_args.bin"})
#: Weight files (checked by hash, not searched for text: their bytes are floats).
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: The base model's vocabulary files (searched neither: short secrets can be tokens).
_VOCAB = frozenset({"tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"})
#: Texts and secrets shorter than this are not searched for (they occur by chance).
_MIN_SEARCHED = 6


def _copy_model(src: Path, dst: Path) -> None:
    """Copy a model directory's serving files (no checkpoints, logs or training state)."""
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in _SKIP_FILES and not p.name.startswith("."):
            shutil.copy2(p, dst / p.name)


def _private_texts(bundle: Path, manifest: Any) -> list[str]:
    """Every training/validation text and declared secret of the bundle's partitions (empty
    when the bundle does not say where they are)."""
    rel = manifest.extra.get("partitions")
    if not rel or not (bundle / rel / "manifest.json").is_file():
        return []
    from scpdr.data import load_partitions

    pset = load_partitions(bundle / rel)
    recs = [*pset.records(), *pset.validation]
    texts = [r.text for r in recs] + [s for r in recs for s in r.secrets]
    if pset.canaries is not None:
        texts += [c.text for c in pset.canaries.canaries]
    texts += _forgotten_texts(bundle)
    return [t for t in dict.fromkeys(texts) if len(t) >= _MIN_SEARCHED]


def _forgotten_texts(bundle: Path) -> list[str]:
    """The texts and declared secrets of the records ``scpdr forget`` removed (kept in
    ``forgotten/`` for ``scpdr eval --forgotten``; never copied, and searched for like the rest)."""
    from scpdr.training.forget import FORGOTTEN_DIR, load_forgotten

    if not (bundle / FORGOTTEN_DIR).is_dir():
        return []
    parts, validation = load_forgotten(bundle)
    recs = [r for part in parts.values() for r in part] + validation
    return [r.text for r in recs] + [s for r in recs for s in r.secrets]


def _leaks(root: Path, texts: list[str]) -> list[str]:
    """Relative paths of non-weight files under ``root`` containing any of ``texts``."""
    needles = [t.encode("utf-8") for t in texts]
    bad = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.endswith(_WEIGHTS) and p.name not in _VOCAB:
            blob = p.read_bytes()
            if any(n in blob for n in needles):
                bad.append(p.relative_to(root).as_posix())
    return bad


def _retarget_adapter(dst: Path, base_ref: str | None) -> None:
    """Point an exported PEFT adapter at the exported base (``../base``) or ``embedded``."""
    cfg_path = dst / "adapter_config.json"
    if not cfg_path.is_file() or base_ref is None:
        return
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["base_model_name_or_path"] = "embedded" if base_ref == "embedded" else f"../{base_ref}"
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def export_bundle(
    bundle: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    method: str | None = None,
    m: int | None = None,
) -> Path:
    """Write the serving-only bundle of ``bundle`` to ``out`` (which must not exist) and return
    ``out``; ``method``/``m`` override the bundle's defaults. Files are owner read-write,
    group read-only; directories owner-only writable."""
    from scpdr.models import read_bundle, resolve_ref

    bundle, out = Path(bundle), Path(out)
    manifest = read_bundle(bundle)
    if out.exists():
        raise ConfigError(f"--out {out} already exists; choose a new directory or remove it")
    if m is not None and m >= manifest.vocab_size:
        raise ConfigError(f"--m {m} must be smaller than the vocabulary size")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        refs: dict[str, str] = {}  # source ref -> exported ref
        base_ref = None
        if manifest.base is not None:
            src = resolve_ref(bundle, manifest.base)
            base_ref = "embedded" if src == "embedded" else "base"
            if base_ref == "base":
                _copy_model(Path(src), tmp / "base")
            refs[manifest.base] = base_ref
        constituents = []
        for i, ref in enumerate(manifest.constituents):
            name = f"constituent-{i}"
            _copy_model(Path(resolve_ref(bundle, ref)), tmp / name)
            _retarget_adapter(tmp / name, base_ref)
            refs[ref] = name
            constituents.append(name)
        tok = refs.get(manifest.tokenizer)
        if tok is None:
            _copy_model(Path(resolve_ref(bundle, manifest.tokenizer)), tmp / "tokenizer")
            tok = "tokenizer"
        if manifest.constant_base is not None:
            shutil.copy2(bundle / manifest.constant_base, tmp / manifest.constant_base)
        audit = manifest.audit or {}
        new = manifest.model_copy(
            update={
                "base": base_ref,
                "constituents": constituents,
                "tokenizer": tok,
                "method": method or manifest.method,
                "m": manifest.m if m is None else m,
                "audit": {
                    k: audit[k] for k in ("passed", "overridden", "k", "num_records") if k in audit
                },
                "extra": {"exported": True},
                # that and when records were forgotten, not whose (no id hashes, salt, source)
                "deletions": [d.public() for d in manifest.deletions],
            }
        )
        (tmp / "scpdr.json").write_text(
            json.dumps(new.model_dump(mode="json"), indent=2), encoding="utf-8"
        )
        leaks = _leaks(tmp, _private_texts(bundle, manifest))
        if leaks:  # never name the text: it is private
            raise BundleError(
                f"export refused: {', '.join(leaks)} would carry training text or a declared "
                "secret; remove it from the model directories and export again"
            )
        files = {
            p.relative_to(tmp).as_posix(): sha256_file(p)
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        (tmp / EXPORT_MANIFEST).write_text(
            json.dumps(
                {
                    "method": new.method,
                    "m": new.m,
                    "base": base_ref,
                    "constituents": constituents,
                    "partition_manifest_hash": manifest.partition_manifest_hash,
                    "files": files,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        for p in tmp.rglob("*"):
            p.chmod(0o750 if p.is_dir() else 0o640)
        tmp.chmod(0o750)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def verify_export(path: str | os.PathLike[str]) -> list[str]:
    """The files of an exported bundle whose sha256 differs from ``export.json`` or that are
    missing, and files not listed there; empty when the bundle is intact."""
    path = Path(path)
    listed = json.loads((path / EXPORT_MANIFEST).read_text(encoding="utf-8"))["files"]
    bad = [f for f, h in listed.items() if not (path / f).is_file() or sha256_file(path / f) != h]
    present = {
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.is_file() and p.name != EXPORT_MANIFEST
    }
    return bad + sorted(present - set(listed))
