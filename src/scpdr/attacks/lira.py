"""LiRA membership inference (§4.2 "Likelihood ratio attack", Theorems 4.4/4.5, App. C.1).

The paper's bounds (``t_x``, ``v_x``) bound the likelihood ratio ``r1(y|x) / r0(y|x)`` of the
target ``r1`` against a reference ``r0`` trained without the targets, given a prefix ``x`` the
adversary holds and a candidate continuation ``y``; thresholding that ratio is the optimal
membership test under the assumptions of App. C.1 (Sablayrolles et al. 2019). The paper states
it but runs no LiRA experiment (§5.1: its empirical attacks are reference-free); this module is
that attack, made concrete:

- one reference scorer, trained without the members (offline; for a NAF method the worst case of
  Theorem 4.5 is the same method over ``(p0, q)``), and no per-example Gaussian fit — the paper's
  statistic is the ratio itself (Carlini et al.'s Gaussian LiRA needs many shadow models);
- per example the statistic is ``log r1(y|x) - log r0(y|x) = sum_t [log r1(y_t|x, y_<t) -
  log r0(y_t|x, y_<t)]`` over the tokens of ``y`` (the chain rule: the log of the ratio of the
  continuation's likelihoods; ``statistic="mean"`` divides by its length instead, which is not a
  likelihood ratio and ranks examples of different lengths differently);
- ``y`` is what the adversary does not already hold: for a ``(prompt, response)`` example (a
  ``Record`` with a prompt, or a pair of strings) only the response tokens are scored,
  conditioned on the prompt — for Names2IDs the ID digits given ``"Name: <name>, ID:"``, the PII
  game of §5.1; a plain text (or a token list) is scored from its second token on (every token
  given the ones before it, as in TTE). Members and non-members go through the same rule.

Higher statistic = predicted member. Reported: ROC AUC and TPR at 1% and 0.1% FPR (the largest
TPR whose FPR is at most the level; with fewer than ``1/level`` non-members only FPR = 0
qualifies, so ``n_nonmembers`` is reported too), and :func:`plot_roc` draws the log-scale ROC
(matplotlib, Agg backend).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scpdr.attacks.pii import _common_prefix
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, batched_token_logprobs, encode, scorer_name
from scpdr.errors import ConfigError

__all__ = [
    "LiRAResult",
    "lira",
    "plot_roc",
    "roc_auc",
    "roc_curve",
    "tpr_at_fpr",
]

FPR_LEVELS = (0.01, 0.001)


def roc_curve(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(fpr, tpr)`` from ``(0, 0)`` to ``(1, 1)`` over every distinct threshold (higher score =
    predicted member; ``labels`` 1 = member). Tied scores move together (a diagonal step)."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).astype(bool).ravel()
    if s.shape != y.shape:
        raise ValueError("scores and labels must have the same length")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ConfigError("a ROC curve needs both members and non-members")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last_of_tie = np.r_[s[1:] != s[:-1], True]
    tp = np.cumsum(y)[last_of_tie]
    fp = np.cumsum(~y)[last_of_tie]
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (trapezoids; ties count 1/2: the Mann–Whitney statistic)."""
    fpr, tpr = roc_curve(scores, labels)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, level: float) -> float:
    """The largest TPR among ROC points with ``FPR <= level``."""
    ok = np.asarray(fpr) <= level + 1e-12
    return float(np.max(np.asarray(tpr)[ok])) if ok.any() else 0.0


@dataclass
class LiRAResult:
    """Per example: the log-likelihood-ratio statistic (``float[N]``) and membership
    (``bool[N]``)."""

    scores: np.ndarray
    members: np.ndarray
    method: str = "scorer"
    reference: str = "reference"

    def roc(self) -> tuple[np.ndarray, np.ndarray]:
        return roc_curve(self.scores, self.members)

    @property
    def auc(self) -> float:
        return roc_auc(self.scores, self.members)

    def tpr_at(self, level: float) -> float:
        return tpr_at_fpr(*self.roc(), level)

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        method = method or self.method
        n = int(self.scores.size)
        extra = {
            "n_members": int(self.members.sum()),
            "n_nonmembers": int((~self.members).sum()),
            "reference": self.reference,
        }
        out = [ResultRow(method, "lira", "auc", self.auc, n, None, corpus, extra)]
        for level in FPR_LEVELS:
            out.append(
                ResultRow(
                    method, "lira", f"tpr@{level:g}fpr", self.tpr_at(level), n, None, corpus, extra
                )
            )
        return out


def _prompt_response(x: Any) -> tuple[str, str] | None:
    """``(prompt, full text)`` of a prompted example, ``None`` for a plain text / token list."""
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(v, str) for v in x):
        prompt, response = x
        return (prompt, prompt + response) if prompt else None
    prompt = getattr(x, "prompt", None)
    if not isinstance(prompt, str) or not prompt:
        return None
    text = getattr(x, "text", None)
    if isinstance(text, str) and text.startswith(prompt):
        return prompt, text  # what the constituent was trained on
    return prompt, prompt + str(getattr(x, "response", None) or "")


def _example_ids(tok: Any, x: Any, *, max_tokens: int | None, label: str) -> tuple[list[int], int]:
    """(token IDs, index of the first scored token) of one example."""
    if isinstance(x, str):
        ids, start = encode(tok, x), 1
    elif (pr := _prompt_response(x)) is not None:
        prompt, full = pr
        ids, p_ids = encode(tok, full), encode(tok, prompt)
        # skip the tokens the prompt and the full text share (a merge at the seam is scored)
        start = max(_common_prefix(ids, p_ids), 1)
    elif isinstance(x, Sequence) and all(isinstance(v, (int, np.integer)) for v in x):
        ids, start = [int(v) for v in x], 1
    else:
        text = getattr(x, "text", None)
        if not isinstance(text, str):
            raise ConfigError(
                f"LiRA {label} is a {type(x).__name__}: pass a text, a token list, a "
                "(prompt, response) pair or a record with prompt/response or text"
            )
        ids, start = encode(tok, text), 1
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) <= start:
        raise ConfigError(
            f"LiRA {label} has no token to score ({len(ids)} tokens; scored tokens start at "
            f"index {start}{'' if max_tokens is None else f', max_tokens={max_tokens}'}): give it a "
            "non-empty response / at least 2 tokens, or raise max_tokens"
        )
    return ids, start


def _seq_stats(
    target: Scorer,
    reference: Scorer,
    seqs: list[list[int]],
    starts: list[int],
    *,
    statistic: str,
    batch_size: int,
    cache: dict | None,
) -> np.ndarray:
    t = batched_token_logprobs(target, seqs, batch_size=batch_size)
    # The cache entry keeps the reference object itself alive, so its id() cannot be reused by
    # a later reference while the entry exists (an id-keyed entry alone would be stale then).
    key = ("lira-reference", id(reference), tuple(map(tuple, seqs)))
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        r = hit[1]
    else:
        r = batched_token_logprobs(reference, seqs, batch_size=batch_size)
        if cache is not None:
            cache[key] = (reference, r)
    out = np.empty(len(seqs))
    for i, (a, b, start) in enumerate(zip(t, r, starts, strict=True)):
        # position j of a teacher-forced score is the log-prob of token j + 1
        d = (a - b).double().numpy()[start - 1 :]
        out[i] = d.sum() if statistic == "sum" else d.mean()
    return out


def lira(
    target: Scorer,
    reference: Scorer,
    members: Sequence[Any],
    nonmembers: Sequence[Any],
    *,
    statistic: str = "sum",
    max_tokens: int | None = None,
    batch_size: int = 16,
    cache: dict | None = None,
) -> LiRAResult:
    """Offline LiRA of ``target`` against ``reference`` (trained without the members; for a NAF
    method the worst case is ``CP(p0, q)`` with ``p0`` trained without them, Theorem 4.5).

    Examples: texts (every token after the first is scored), token lists (likewise), or
    ``(prompt, response)`` pairs / records with a ``prompt`` (only the response is scored, given
    the prompt: the paper's ``r1(y|x) / r0(y|x)`` with ``x`` the prefix the adversary holds).
    ``statistic``: ``"sum"`` (default: the log-likelihood ratio of the scored tokens) or
    ``"mean"`` (per scored token). ``max_tokens`` truncates each full example (prompt included).
    ``cache``: a dict kept across calls that share a reference scorer object (e.g. ``q`` for
    every method), so its scores are computed once."""
    if statistic not in ("mean", "sum"):
        raise ConfigError(f"statistic must be 'mean' or 'sum', got {statistic!r}")
    if not members or not nonmembers:
        raise ConfigError("LiRA needs at least one member and one non-member example")
    tok = target.tokenizer
    examples = [*members, *nonmembers]
    labels_txt = [f"member {i}" for i in range(len(members))]
    labels_txt += [f"non-member {i}" for i in range(len(nonmembers))]
    pairs = [
        _example_ids(tok, x, max_tokens=max_tokens, label=lab)
        for x, lab in zip(examples, labels_txt, strict=True)
    ]
    seqs = [p[0] for p in pairs]
    starts = [p[1] for p in pairs]
    scores = _seq_stats(
        target,
        reference,
        seqs,
        starts,
        statistic=statistic,
        batch_size=batch_size,
        cache=cache,
    )
    labels = np.r_[np.ones(len(members), dtype=bool), np.zeros(len(nonmembers), dtype=bool)]
    return LiRAResult(scores, labels, scorer_name(target), scorer_name(reference, "reference"))


def plot_roc(results: Mapping[str, LiRAResult], path: str | os.PathLike[str]) -> Path:
    """Log-log ROC curves, one per method, with the chance diagonal; written atomically."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from scpdr.io import atomic_write

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    floor = 1e-4
    for name, res in results.items():
        fpr, tpr = res.roc()
        ax.step(
            np.maximum(fpr, floor),
            np.maximum(tpr, floor),
            where="post",
            label=f"{name} (AUC {res.auc:.3f})",
        )
    grid = np.logspace(-4, 0, 50)
    ax.plot(grid, grid, "k:", lw=1, label="chance")
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(floor, 1),
        ylim=(floor, 1.05),
        xlabel="false positive rate",
        ylabel="true positive rate",
        title="LiRA ROC",
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    suffix = Path(path).suffix.lstrip(".") or "png"
    out = atomic_write(path, lambda p: fig.savefig(p, format=suffix, dpi=150))
    plt.close(fig)
    return out
