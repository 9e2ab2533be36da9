"""The goldfish loss (Hans et al. 2024, hashed variant), the training-time baseline beside NAF.

Every ``k``-th token, chosen by a hash of the ``h`` tokens before it, is dropped from the loss
(:func:`goldfish_mask`); the same context always drops the same token, so a passage repeated in
the training data never has its dropped tokens trained. :class:`~scpdr.training.sequences.
CausalCollator` applies the mask to the labels only. Evaluated as its own result row (see
:mod:`scpdr.methods`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["GOLDFISH_H", "GOLDFISH_K", "goldfish_mask"]

#: Default drop rate: one token in ``k`` (Hans et al. 2024 use k = 4).
GOLDFISH_K = 4
#: Default hash context width in tokens (Hans et al. 2024 use h = 13).
GOLDFISH_H = 13

_KEY = b"scpdr-goldfish"


def goldfish_mask(input_ids: torch.Tensor, *, k: int, h: int) -> torch.Tensor:
    """Goldfish loss mask (Hans et al. 2024, hashed variant): ``True`` where a token is dropped.

    Position ``t`` of ``input_ids`` (``LongTensor[B, T]``) is dropped iff ``t >= h`` and
    ``H(input_ids[b, t-h:t]) mod k == 0``, where ``H`` is a keyed 64-bit BLAKE2b hash of the ``h``
    preceding token ids (int64, little endian). The first ``h`` positions (no full context) are
    always kept. The same context always drops the same next token, so repeated text loses the
    same tokens every time it is seen. Returns ``BoolTensor[B, T]``; ``input_ids`` is not modified.
    """
    import torch

    if k < 2 or h < 1:
        raise ValueError(f"goldfish needs k >= 2 and h >= 1, got k={k}, h={h}")
    ids = input_ids.detach().to("cpu", torch.int64).numpy()
    B, T = ids.shape
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b in range(B):
        row = ids[b].astype("<i8")
        for t in range(h, T):
            digest = hashlib.blake2b(row[t - h : t].tobytes(), digest_size=8, key=_KEY)
            if int.from_bytes(digest.digest(), "little") % k == 0:
                mask[b, t] = True
    return mask.to(input_ids.device)
