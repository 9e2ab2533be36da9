"""The bundle: its manifest (``scpdr.json``), the constant base vector of the 'c' variant, and
writing/reading them (layer 2 of ``shared/DESIGN.md``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scpdr import methods
from scpdr.errors import BundleError
from scpdr.io import atomic_write, atomic_write_json
from scpdr.models.embedded import EMBEDDED
from scpdr.models.loading import Ref, load_tokenizer
from scpdr.models.vocab import check_compatible

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLE_FORMAT_VERSION",
    "BUNDLE_MANIFEST",
    "CONSTANT_BASE_FILE",
    "CONSTANT_BASE_KEY",
    "BundleManifest",
    "Deletion",
    "constant_base_vector",
    "load_constant_base",
    "read_bundle",
    "resolve_ref",
    "write_bundle",
]

BUNDLE_FORMAT_VERSION = 1
BUNDLE_MANIFEST = "scpdr.json"
CONSTANT_BASE_FILE = "constant_base.safetensors"
CONSTANT_BASE_KEY = "constant_base"


def constant_base_vector(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    batch_size: int = 8,
    max_length: int = 256,
) -> torch.Tensor:
    """The constant base logits of SCP-Δr-c (paper §5.1, App. D.4): the mean of ``model``'s
    logits over every (non-pad) position of ``prompts`` (the paper uses 100 held-out examples).

    Returns a float32 ``Tensor[V]``.
    """
    import torch

    if not prompts:
        raise ValueError("constant_base_vector needs at least one held-out prompt")
    if len(prompts) < 100:
        logger.warning(
            "constant base vector from %d prompts; the paper averages over 100", len(prompts)
        )
    pad_side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    total: torch.Tensor | None = None
    count = 0
    try:
        with torch.inference_mode():
            for i in range(0, len(prompts), batch_size):
                enc = tokenizer(
                    list(prompts[i : i + batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                )
                mask = enc["attention_mask"]
                logits = model(input_ids=enc["input_ids"], attention_mask=mask).logits.float()
                s = (logits * mask.unsqueeze(-1)).sum(dim=(0, 1))  # (V,)
                total = s if total is None else total + s
                count += int(mask.sum())
    finally:
        tokenizer.padding_side = pad_side
    assert total is not None
    return total / max(count, 1)


class Deletion(BaseModel):
    """One entry of a bundle's deletion log (``scpdr forget``, :mod:`scpdr.training.forget`):
    when, how many records, which partitions changed; the ids only as salted hashes
    (``sha256(salt + id)``, :func:`scpdr.training.forget.deletion_hash`), never a text."""

    model_config = ConfigDict(extra="forbid")

    when: str = Field(..., description="UTC time of the deletion (ISO 8601)")
    selection: str = Field(
        ..., description="how the records were named: ids, group, secret-matching"
    )
    records: int = Field(..., ge=0, description="training records removed")
    validation_records: int = Field(0, ge=0, description="validation records removed")
    partitions: list[int] = Field(..., description="partitions that lost records (retrained)")
    copied: list[int] = Field(default_factory=list, description="constituents copied unchanged")
    id_hashes: list[str] = Field(default_factory=list, description="sha256(salt + id), sorted")
    salt: str | None = Field(None, description="the bundle's salt of id_hashes (hex)")
    source: str | None = Field(None, description="the bundle the records were removed from")
    source_sha256: str | None = Field(None, description="sha256 of the source's scpdr.json")

    def public(self) -> Deletion:
        """The entry without the id hashes, the salt and the source path (what an export keeps:
        that and when records were forgotten, not whose)."""
        return self.model_copy(update={"id_hashes": [], "salt": None, "source": None})


class BundleManifest(BaseModel):
    """``scpdr.json`` of a bundle: what the protected model is made of (refs relative to the
    bundle dir when inside it)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(BUNDLE_FORMAT_VERSION, description="bundle format version")
    base: str | None = Field(None, description="base model ref ('embedded', dir, adapter, .gguf)")
    constituents: list[str] = Field(..., description="constituent model refs, one per partition")
    tokenizer: str = Field(..., description="ref whose tokenizer the bundle uses")
    method: str = Field("scp-delta-r", description="default aggregation method")
    m: int = Field(10, ge=1, description="default smoothing parameter m (Alg. 1)")
    partition_manifest_hash: str | None = Field(None, description="hash of the partition manifest")
    audit: dict[str, Any] | None = Field(None, description="partition audit summary, when known")
    vocab_hash: str = Field(..., description="scpdr.models.vocab_hash of the shared tokenizer")
    vocab_size: int = Field(..., ge=1, description="number of tokens")
    constant_base: str | None = Field(
        None, description="safetensors file (relative) holding the constant base vector ('c')"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="free-form metadata")
    deletions: list[Deletion] = Field(
        default_factory=list, description="deletion log (`scpdr forget`), oldest first"
    )

    @field_validator("constituents")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a bundle needs at least one constituent")
        return v

    def resolve(self, bundle_dir: Ref, ref: str) -> str:
        """A ref of this manifest as a loadable ref (relative paths resolved against the dir)."""
        return resolve_ref(bundle_dir, ref)


def resolve_ref(bundle_dir: Ref, ref: str) -> str:
    """``ref`` resolved against ``bundle_dir`` when it is a relative path; else unchanged."""
    if ref == EMBEDDED or Path(ref).is_absolute():
        return ref
    return str((Path(os.fspath(bundle_dir)) / ref).resolve())


def _store_ref(bundle_dir: Path, ref: Ref) -> str:
    s = os.fspath(ref)
    if s == EMBEDDED:
        return s
    p = Path(s).resolve()
    try:
        return p.relative_to(bundle_dir.resolve()).as_posix()
    except ValueError:
        return str(p)


def write_bundle(
    path: Ref,
    *,
    base: Ref | None,
    constituents: Sequence[Ref],
    method: str = "scp-delta-r",
    m: int = 10,
    partition_manifest_hash: str | None = None,
    audit: Mapping[str, Any] | None = None,
    constant_base: torch.Tensor | None = None,
    extra: Mapping[str, Any] | None = None,
    deletions: Sequence[Deletion] = (),
) -> Path:
    """Write a bundle manifest (``scpdr.json``) into directory ``path`` and return ``path``.

    The models are referenced, not copied (refs inside ``path`` are stored relative to it).
    Tokenizers of base and constituents are loaded and checked with :func:`check_compatible`.
    ``constant_base`` (``Tensor[V]``, see :func:`constant_base_vector`) is saved next to the
    manifest for the 'c' variant. ``deletions``: the deletion log (``scpdr forget``). Every
    file is written atomically, the manifest last.
    """
    import torch
    from safetensors.torch import save_file

    bundle_dir = Path(os.fspath(path))
    if not constituents:
        raise ValueError("write_bundle needs at least one constituent ref")
    if method not in methods.RULES:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(methods.RULES)}")
    named: dict[str, Ref] = {}
    if base is not None:
        named["base"] = base
    for i, c in enumerate(constituents):
        named[f"constituent {i} ({os.fspath(c)})"] = c
    toks = {
        f"{k} ({os.fspath(v)})" if k == "base" else k: load_tokenizer(v) for k, v in named.items()
    }
    vh = check_compatible(toks)
    first_tok = next(iter(toks.values()))
    vocab_size = len(first_tok)
    from scpdr import naf

    naf.check_m(m, vocab_size, "write_bundle")  # a ConfigError (ValueError): before any write
    tok_ref = base if base is not None else constituents[0]
    bundle_dir.mkdir(parents=True, exist_ok=True)  # only once the inputs are known to be good

    const_name = None
    if constant_base is not None:
        vec = constant_base.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if vec.numel() != vocab_size:
            raise ValueError(
                f"constant_base has {vec.numel()} entries but the vocabulary has {vocab_size}"
            )
        atomic_write(
            bundle_dir / CONSTANT_BASE_FILE,
            lambda p: save_file({CONSTANT_BASE_KEY: vec.clone()}, str(p)),
        )
        const_name = CONSTANT_BASE_FILE

    manifest = BundleManifest(
        base=_store_ref(bundle_dir, base) if base is not None else None,
        constituents=[_store_ref(bundle_dir, c) for c in constituents],
        tokenizer=_store_ref(bundle_dir, tok_ref),
        method=method,
        m=m,
        partition_manifest_hash=partition_manifest_hash,
        audit=dict(audit) if audit is not None else None,
        vocab_hash=vh,
        vocab_size=vocab_size,
        constant_base=const_name,
        extra=dict(extra or {}),
        deletions=list(deletions),
    )
    atomic_write_json(bundle_dir / BUNDLE_MANIFEST, manifest.model_dump(mode="json"))
    return bundle_dir


def read_bundle(path: Ref) -> BundleManifest:
    """Read and validate ``path/scpdr.json``; every referenced file must exist.

    Raises :class:`~scpdr.errors.BundleError` saying what is missing and how to fix it.
    """
    bundle_dir = Path(os.fspath(path))
    mf = bundle_dir / BUNDLE_MANIFEST
    if not bundle_dir.is_dir():
        raise BundleError(
            f"bundle directory {bundle_dir} does not exist; build one with `scpdr bundle`"
        )
    if not mf.is_file():
        raise BundleError(
            f"{bundle_dir} is not a bundle: {BUNDLE_MANIFEST} is missing; create it with "
            "`scpdr bundle` (or scpdr.models.write_bundle)"
        )
    try:
        data = json.loads(mf.read_text(encoding="utf-8"))
        manifest = BundleManifest.model_validate(data)
    except (json.JSONDecodeError, ValueError) as exc:
        raise BundleError(
            f"{mf} is invalid ({exc}); rebuild the bundle with `scpdr bundle`"
        ) from exc
    if manifest.format_version > BUNDLE_FORMAT_VERSION:
        raise BundleError(
            f"{mf} has format version {manifest.format_version}, newer than this scpdr "
            f"({BUNDLE_FORMAT_VERSION}); upgrade scpdr"
        )
    refs = ([manifest.base] if manifest.base else []) + manifest.constituents + [manifest.tokenizer]
    for ref in refs:
        r = resolve_ref(bundle_dir, ref)
        if r == EMBEDDED:
            continue
        if not Path(r).exists():
            raise BundleError(
                f"bundle {bundle_dir}: model {ref!r} (resolved to {r}) is missing; restore it or "
                "rebuild the bundle with `scpdr bundle`"
            )
    if manifest.constant_base is not None and not (bundle_dir / manifest.constant_base).is_file():
        raise BundleError(
            f"bundle {bundle_dir}: constant base file {manifest.constant_base} is missing; rebuild "
            "the bundle with held-out prompts (`scpdr bundle --held-out FILE`)"
        )
    return manifest


def load_constant_base(path: Ref, manifest: BundleManifest | None = None) -> torch.Tensor | None:
    """The bundle's constant base vector (``Tensor[V]`` float32), or None when it has none."""
    from safetensors.torch import load_file

    bundle_dir = Path(os.fspath(path))
    manifest = manifest or read_bundle(bundle_dir)
    if manifest.constant_base is None:
        return None
    tensors = load_file(str(bundle_dir / manifest.constant_base))
    if CONSTANT_BASE_KEY not in tensors:
        raise BundleError(
            f"{bundle_dir / manifest.constant_base} has no tensor {CONSTANT_BASE_KEY!r}; rebuild "
            "the bundle"
        )
    vec = tensors[CONSTANT_BASE_KEY].float()
    if vec.shape != (manifest.vocab_size,):
        raise BundleError(
            f"constant base vector has shape {tuple(vec.shape)}, expected ({manifest.vocab_size},); "
            "rebuild the bundle"
        )
    return vec
