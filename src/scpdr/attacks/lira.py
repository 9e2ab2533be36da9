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
- ``y`` is what the adversary does not already hold (:func:`scpdr.attacks.examples.example_ids`):
  for a ``(prompt, response)`` example (a ``Record`` with a prompt, or a pair of strings) only the
  response tokens are scored, conditioned on the prompt — for Names2IDs the ID digits given
  ``"Name: <name>, ID:"``, the PII game of §5.1; a plain text (or a token list) is scored from its
  second token on (every token given the ones before it, as in TTE). Members and non-members go
  through the same rule.

Higher statistic = predicted member. Reported: ROC AUC and TPR at 1% and 0.1% FPR (the largest
TPR whose FPR is at most the level; with fewer than ``1/level`` non-members only FPR = 0
qualifies, so ``n_nonmembers`` is reported too), from scikit-learn with stratified bootstrap 95%
intervals (:func:`scpdr.attacks.stats.roc_metrics`), and :func:`plot_roc` draws the log-scale ROC
(matplotlib, Agg backend). The MIA suite (:func:`scpdr.attacks.mia.membership_inference`) runs the
same ratio beside the reference-free attacks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scpdr.attacks.examples import cached_token_logprobs, example_ids
from scpdr.attacks.mia import metric_name
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, scorer_name
from scpdr.attacks.stats import FPR_LEVELS, RocMetrics, ci_extra, roc_metrics
from scpdr.errors import ConfigError

__all__ = ["LiRAResult", "lira", "plot_roc"]


@dataclass
class LiRAResult:
    """Per example: the log-likelihood-ratio statistic (``float[N]``) and membership
    (``bool[N]``); ROC metrics from :func:`scpdr.attacks.stats.roc_metrics` (scikit-learn, with
    stratified bootstrap intervals)."""

    scores: np.ndarray
    members: np.ndarray
    method: str = "scorer"
    reference: str = "reference"
    _metrics: RocMetrics | None = field(default=None, repr=False, compare=False)

    def metrics(self) -> RocMetrics:
        if self._metrics is None:
            self._metrics = roc_metrics(self.scores[self.members], self.scores[~self.members])
        return self._metrics

    def roc(self) -> tuple[np.ndarray, np.ndarray]:
        """``(fpr, tpr)`` from ``(0, 0)`` to ``(1, 1)`` (scikit-learn's ``roc_curve``)."""
        met = self.metrics()
        return met.fpr_curve, met.tpr_curve

    @property
    def auc(self) -> float:
        return self.metrics().auc.value

    def tpr_at(self, level: float) -> float:
        met = self.metrics()
        if level in met.tpr:
            return met.tpr[level].value
        return (
            roc_metrics(
                self.scores[self.members], self.scores[~self.members], fpr_levels=(level,), n_boot=1
            )
            .tpr[level]
            .value
        )

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        method = method or self.method
        met = self.metrics()
        n = int(self.scores.size)
        extra = {
            "n_members": met.n_members,
            "n_nonmembers": met.n_nonmembers,
            "reference": self.reference,
        }
        ests = {"auc": met.auc, **{metric_name(lv): met.tpr[lv] for lv in FPR_LEVELS}}
        return [
            ResultRow(method, "lira", metric, e.value, n, None, corpus, {**extra, **ci_extra(e)})
            for metric, e in ests.items()
        ]


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
    the prompt: the paper's ``r1(y|x) / r0(y|x)`` with ``x`` the prefix the adversary holds);
    every prefix is a fresh request. ``statistic``: ``"sum"`` (default: the log-likelihood ratio
    of the scored tokens) or ``"mean"`` (per scored token). ``max_tokens`` truncates each full
    example (prompt included). ``cache``: a dict kept across calls that share a reference scorer
    object (e.g. ``q`` for every method), so its scores are computed once."""
    if statistic not in ("mean", "sum"):
        raise ConfigError(f"statistic must be 'mean' or 'sum', got {statistic!r}")
    if not members or not nonmembers:
        raise ConfigError("LiRA needs at least one member and one non-member example")
    tok = target.tokenizer
    examples = [*members, *nonmembers]
    labels_txt = [f"LiRA member {i}" for i in range(len(members))]
    labels_txt += [f"LiRA non-member {i}" for i in range(len(nonmembers))]
    pairs = [
        example_ids(tok, x, max_tokens=max_tokens, label=lab)
        for x, lab in zip(examples, labels_txt, strict=True)
    ]
    seqs = [p[0] for p in pairs]
    t = cached_token_logprobs(target, seqs, batch_size=batch_size, cache=None)
    r = cached_token_logprobs(reference, seqs, batch_size=batch_size, cache=cache)
    scores = np.empty(len(seqs))
    for i, (a, b, (_, start)) in enumerate(zip(t, r, pairs, strict=True)):
        # position j of a teacher-forced score is the log-prob of token j + 1
        d = (a - b).double().numpy()[start - 1 :]
        scores[i] = d.sum() if statistic == "sum" else d.mean()
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
