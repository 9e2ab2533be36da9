"""Expected SpaRPS analysis (Def. 3.4; Fig. 2a "Expected SpaRPS analysis").

Given next-token log-probs of several independently seeded fine-tunes on ``S_p`` and on ``S_q``
at the same prompts ``X``, the smallest ``B`` for which ``(S_p, S_q)`` is ``(m, B, C)``-Expected
SpaRPS is computed for every ``m`` and ``C`` (by :func:`scpdr.bounds.expected_sparps`). The
paper plots ``B`` against ``log2 m`` for ``C`` in {0.9, 0.95, 0.99} and finds that even
``m = 1024`` leaves ``B ≈ 2.1`` at ``C = 0.9`` — SpaRPS does not hold without smoothing.

:func:`collect_next_token_logprobs` gathers the ``[S, X, V]`` tensors from scorers (one per seed);
the experiment runner feeds it the fine-tunes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from scpdr.attacks.scorer import Scorer, encode, pad_batch, pad_token_id
from scpdr.errors import ConfigError

__all__ = [
    "DEFAULT_CS",
    "DEFAULT_MS",
    "collect_next_token_logprobs",
    "expected_sparps_curve",
    "plot_expected_sparps",
]

DEFAULT_CS: tuple[float, ...] = (0.9, 0.95, 0.99)
DEFAULT_MS: tuple[int, ...] = tuple(2**i for i in range(11))  # 1 .. 1024


def _centred_mean(samples: Tensor) -> Tensor:
    """``E[log r·]`` over seeds: ``(S, X, V) -> (1, X, V)`` (each row re-centred to mean 0, which
    turns log-probs into log RPDs, Def. 2.5)."""
    x = samples.float()
    return (x - x.mean(dim=-1, keepdim=True)).mean(dim=0, keepdim=True)


def expected_sparps_curve(
    logp_p: Tensor,
    logp_q: Tensor,
    *,
    ms: Sequence[int] = DEFAULT_MS,
    cs: Sequence[float] = DEFAULT_CS,
) -> dict[float, list[float]]:
    """``{C: [B(m) for m in ms]}`` (Def. 3.4).

    Args:
        logp_p: ``(S, X, V)`` log-probs (or log RPDs) of S fine-tunes on ``S_p`` at prompts X.
        logp_q: ``(S', X, V)`` the same for ``S_q``.
        ms: the m values (each ``< V``); cs: the C values in (0, 1].
    """
    from scpdr.bounds import expected_sparps

    if logp_p.ndim != 3 or logp_q.ndim != 3 or logp_p.shape[1:] != logp_q.shape[1:]:
        raise ConfigError(
            f"expected (S, X, V) tensors with equal (X, V), got {tuple(logp_p.shape)} and "
            f"{tuple(logp_q.shape)}"
        )
    # averaging over seeds once is exact: expected_sparps re-centres and averages the same way
    ea, eb = _centred_mean(logp_p), _centred_mean(logp_q)
    return {float(c): [expected_sparps(ea, eb, m=int(m), C=float(c)) for m in ms] for c in cs}


def collect_next_token_logprobs(
    scorers: Sequence[Scorer],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
) -> Tensor:
    """``Tensor[S, X, V]``: each scorer's next-token log-probs after each prompt (float32, CPU)."""
    if not scorers:
        raise ConfigError("need at least one scorer (one per seed)")
    tok = scorers[0].tokenizer
    seqs = [encode(tok, p) if isinstance(p, str) else list(p) for p in prompts]
    out = []
    for sc in scorers:
        rows = []
        for start in range(0, len(seqs), batch_size):
            ids, mask = pad_batch(
                seqs[start : start + batch_size], pad_id=pad_token_id(tok), side="left"
            )
            rows.append(sc.next_token_logprobs(ids, mask).detach().float().cpu())
        out.append(torch.cat(rows))
    return torch.stack(out)


def plot_expected_sparps(
    curve: Mapping[float, Sequence[float]], ms: Sequence[int], path: str | os.PathLike[str]
) -> Path:
    """B vs log2(m), one line per C (Fig. 2a)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from scpdr.io import atomic_write

    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ms_arr = np.asarray(ms, dtype=float)
    keep = ms_arr > 0  # log2(m) needs m >= 1
    for c, bs in sorted(curve.items()):
        ax.plot(np.log2(ms_arr[keep]), np.asarray(bs)[keep], "-o", ms=3, label=f"C = {c:g}")
    ax.set(xlabel="log2(m)", ylabel="B", title="Expected SpaRPS")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=130))
    plt.close(fig)
    return out
