"""Validation of the rules' inputs (shapes, dtypes, base, m) and the constants every rule shares.

Every check raises a typed error whose message says what to pass instead (STYLE.md 9).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from scpdr.errors import ConfigError, VocabularyMismatchError

__all__ = ["DEFAULT_M", "LOG_FLOOR", "as_float32", "check_base", "check_logps", "check_m"]

#: Log of the probability floor: every distribution gives each token at least e^-20 (§2.1).
LOG_FLOOR = -20.0
#: Default smoothing level m (the paper's default, App. "Choice of smoothing parameter m").
DEFAULT_M = 10


def as_float32(x: Tensor, name: str) -> Tensor:
    """``x`` as float32 (no copy when it already is; the caller must not modify the result)."""
    return check_floating(x, name).float()


def check_floating(x: Tensor, name: str) -> Tensor:
    """``x`` itself, once it is a floating-point tensor with a vocabulary dimension (>= 2) last."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must hold floating-point logits or log-probabilities, got dtype {x.dtype}; "
            "convert with .float()"
        )
    if x.ndim < 1 or x.shape[-1] < 2:
        raise ValueError(
            f"{name} must have a vocabulary dimension of size >= 2 last, got shape {tuple(x.shape)}"
        )
    return x


def check_logps(logps: Tensor | Sequence[Tensor], method: str, *, min_k: int) -> Tensor:
    """Validate ``logps`` ``(K, *batch, V)`` (or a list of K ``(*batch, V)``) and return it as
    float32."""
    if not isinstance(logps, Tensor):
        if isinstance(logps, Sequence) and logps and all(isinstance(t, Tensor) for t in logps):
            shapes = {tuple(t.shape) for t in logps}
            if len(shapes) != 1:
                raise ValueError(
                    f"{method}: the constituents' log-prob tensors differ in shape: "
                    f"{sorted(shapes)}; every constituent must give (*batch, V) on one vocabulary"
                )
            logps = torch.stack(list(logps))
        else:
            raise TypeError(
                f"{method}: logps must be a Tensor[K, *batch, V] (or a list of K Tensor[*batch, V])"
            )
    if logps.ndim < 2:
        raise ValueError(
            f"{method}: logps must have shape (K, *batch, V) with a leading constituent "
            f"dimension, got shape {tuple(logps.shape)}; for a single model use logps[None]"
        )
    k = logps.shape[0]
    if k < min_k:
        raise ValueError(
            f"{method} aggregates K >= {min_k} constituents, got K = {k} "
            f"(logps shape {tuple(logps.shape)}); pass one model per partition along dim 0, "
            "or use method 'none' for a single model"
        )
    return as_float32(logps, f"{method}: logps")


def check_base(base: Tensor | None, logps: Tensor, method: str) -> Tensor:
    """Validate ``base`` against ``logps`` ``(K, *batch, V)``; return it as float32.

    The result keeps its own shape (``(*batch, V)`` or anything that broadcasts to it, e.g.
    ``(V,)``); it is not expanded, so per-row work on a constant base is done once.
    """
    if base is None:
        raise ValueError(
            f"{method} smooths against a base model: pass base=Tensor[*batch, V] (the base "
            "model's logits) or base=Tensor[V] (a constant logit vector, the 'c' variant)"
        )
    base = as_float32(base, f"{method}: base")
    target = tuple(logps.shape[1:])
    if base.shape[-1] != target[-1]:
        raise VocabularyMismatchError(
            f"{method}: base has vocabulary size {base.shape[-1]} but the constituents have "
            f"{target[-1]}; base and constituents must share one tokenizer"
        )
    if base.ndim == 1 or tuple(base.shape) == target:  # the common cases, checked cheaply
        return base
    try:
        shape = torch.broadcast_shapes(tuple(base.shape), target)
    except RuntimeError:
        shape = None
    if shape != target:
        raise ValueError(
            f"{method}: base shape {tuple(base.shape)} does not broadcast to the constituents' "
            f"(*batch, V) = {target}; pass base with shape {target} or ({target[-1]},)"
        )
    return base


def check_m(m: int, vocab: int, method: str) -> int:
    """``m`` if it is an int with ``1 <= m < vocab`` (S_m keeps m tokens, §4.1), else
    ConfigError."""
    if isinstance(m, bool) or not isinstance(m, int):
        raise ConfigError(f"{method}: m must be an int (tokens kept unsmoothed), got {m!r}")
    if not 1 <= m < vocab:
        raise ConfigError(
            f"{method}: m must satisfy 1 <= m < V = {vocab} (tokens kept unsmoothed), got m = {m}; "
            f"the paper's default is m = {DEFAULT_M}"
        )
    return m
