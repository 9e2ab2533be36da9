"""Loading a bundle for :meth:`scpdr.runtime.ProtectedLM.from_bundle`: the models a method needs,
and the runner that runs them.

Only the models the method needs are loaded ("none": constituent 0; the base model only for the
SCP rules' 'b' variant; the constant vector for 'c', paper §5.1). When every model is a LoRA
adapter over one base (or that base itself), the shared-base runner of ``scpdr.lora`` runs
them in one stacked forward; otherwise (or with ``SCPDR_LORA_FAST=0``) the general
:class:`~scpdr.runtime.runner.PerModelRunner` loads each model on its own. The choice and its
reason are returned as a :class:`~scpdr.runtime.outputs.FastPath`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scpdr import methods
from scpdr.errors import BundleError
from scpdr.runtime.outputs import FastPath

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = ["BundleParts", "check_rule", "load_bundle_parts"]


def check_rule(method: str) -> None:
    """``method`` must be an aggregation rule (:data:`scpdr.methods.RULES`; ValueError)."""
    if method not in methods.RULES:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(methods.RULES)}")


@dataclass
class BundleParts:
    """Everything ``ProtectedLM(...)`` takes, loaded from a bundle."""

    constituents: list[Any]
    tokenizer: PreTrainedTokenizerBase
    base_model: Any | None
    base_vector: torch.Tensor | None
    method: str
    m: int
    names: list[str]
    runner: Any | None
    fast_path: FastPath

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``ProtectedLM(constituents, tokenizer, **kwargs)``."""
        return {
            "base_model": self.base_model,
            "base_vector": self.base_vector,
            "method": self.method,
            "m": self.m,
            "names": self.names,
            "runner": self.runner,
            "fast_path": self.fast_path,
        }


def load_bundle_parts(
    path: str | os.PathLike[str],
    *,
    method: str | None = None,
    m: int | None = None,
    base: str = "model",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> BundleParts:
    """Read a bundle and load what ``method`` needs (see
    :meth:`scpdr.runtime.ProtectedLM.from_bundle` for the arguments and errors)."""
    from scpdr import models as M
    from scpdr.device import model_dtype, resolve_device
    from scpdr.lora import fast_path_from_bundle, pack_full_model

    if base not in ("model", "constant"):
        raise ValueError(f"base must be 'model' or 'constant', got {base!r}")
    manifest = M.read_bundle(path)
    method = method or manifest.method
    m = manifest.m if m is None else m
    check_rule(method)
    tok = M.load_tokenizer(manifest.resolve(path, manifest.tokenizer))
    if M.vocab_hash(tok) != manifest.vocab_hash:
        raise BundleError(
            f"bundle {path}: the tokenizer of {manifest.tokenizer!r} has vocab hash "
            f"{M.vocab_hash(tok)}, the manifest records {manifest.vocab_hash}; the models "
            "changed after bundling: rebuild the bundle with `scpdr bundle`"
        )
    refs = manifest.constituents[:1] if method == "none" else manifest.constituents
    # cuda when available unless told; bf16 models there (the aggregation stays float32)
    dev = torch.device(resolve_device(None if device is None else str(device)))
    dtype = dtype if dtype is not None else model_dtype(dev)
    # None: not LoRA adapters over one base (the reason is logged and kept)
    stacked, reason = fast_path_from_bundle(
        path, manifest, method=method, base=base, dtype=dtype, device=dev
    )

    def load_full(ref: str) -> Any:  # general path: a GGUF model decodes from its Q4_1 blocks
        resolved = manifest.resolve(path, ref)
        model = M.load_model(resolved, dtype=dtype).to(dev)
        pack_full_model(resolved, model)
        return model

    if stacked is not None:
        constituents = list(stacked.models[: len(refs)])
    else:
        constituents = [load_full(r) for r in refs]
    base_model = base_vector = None
    if method in methods.SMOOTHED_RULES:
        if base == "constant":
            base_vector = M.load_constant_base(path, manifest)
            if base_vector is None:
                raise ValueError(
                    f"bundle {path} stores no constant base vector, so base='constant' is "
                    "unavailable; use base='model' or rebuild the bundle with held-out "
                    "prompts (`scpdr bundle --held-out FILE`)"
                )
        else:
            if manifest.base is None:
                raise ValueError(
                    f"bundle {path} has no base model; use base='constant' or rebuild it "
                    "with `scpdr bundle --base REF`"
                )
            if stacked is not None:
                base_model = stacked.models[-1]
            else:
                base_model = load_full(manifest.base)
    return BundleParts(
        constituents=constituents,
        tokenizer=tok,
        base_model=base_model,
        base_vector=base_vector,
        method=method,
        m=m,
        names=list(refs),
        runner=stacked,
        fast_path=FastPath(stacked is not None, reason),
    )
