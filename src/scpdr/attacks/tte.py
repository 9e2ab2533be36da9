"""Token-by-token extraction (TTE; §5.3 "Token-by-token extraction", Definition 4.2 "Black-box TDE
Game", Fig. "Memorization effect").

For every prefix ``x_{<=t}`` of a training example — sent as a fresh request, so a stateful
method's path is empty (:func:`scpdr.attacks.scorer.score_requests`) — the adversary takes the
greedy next token ``ŷ_t = argmax r(·|x_{<=t})`` and keeps it (predicts) or abstains by
thresholding its probability ``r(ŷ_t|x_{<=t})`` — selective classification (Geifman & El-Yaniv
2017). One teacher-forced ``score(..., top_logprobs=1)`` pass gives every prefix of an example at
once. Reported:

- the accuracy–coverage curve (accuracy of the kept predictions as the threshold drops),
- its **AUC** (mean accuracy over coverages ``1/N, 2/N, ..., 1``),
- **ACC**: the accuracy at full coverage (the adversary always accepts),

each with a 95% interval from resampling whole examples (:meth:`TTEResult.estimates`).

Ties in confidence are resolved in expectation over a random order, so the curve does not depend
on the sort. Optionally the evaluation is restricted to tokens another model ``q`` fails to
predict (its greedy token is wrong): tokens ``q`` predicts are trivial for everyone and hide the
differences between methods (the paper's memorization-level figure).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, batched_greedy, encode, scorer_name
from scpdr.attacks.stats import Estimate, ci_extra, cluster_bootstrap_ci, pooled_mean_ci
from scpdr.errors import ConfigError

__all__ = [
    "TTEResult",
    "accuracy_coverage_curve",
    "selective_auc",
    "token_by_token_extraction",
]

log = logging.getLogger(__name__)


def accuracy_coverage_curve(
    confidence: np.ndarray, correct: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(coverage[N], accuracy[N])``: keeping the ``k`` most confident predictions gives coverage
    ``k/N`` and the (tie-averaged) accuracy of those ``k``. ``confidence`` and ``correct`` are
    ``[N]`` arrays (higher confidence = kept first)."""
    conf = np.asarray(confidence, dtype=np.float64).ravel()
    corr = np.asarray(correct, dtype=np.float64).ravel()
    if conf.shape != corr.shape:
        raise ValueError(f"confidence {conf.shape} and correct {corr.shape} differ in shape")
    n = conf.size
    if n == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(-conf, kind="stable")
    conf, corr = conf[order], corr[order]
    # tie groups: consecutive equal confidences
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = conf[1:] != conf[:-1]
    gid = np.cumsum(new_group) - 1
    g_size = np.bincount(gid)
    g_corr = np.bincount(gid, weights=corr)
    g_start = np.concatenate([[0], np.cumsum(g_size)[:-1]])
    before_corr = np.concatenate([[0.0], np.cumsum(g_corr)[:-1]])
    j = np.arange(n) - g_start[gid] + 1  # 1-based position inside its tie group
    expected_correct = before_corr[gid] + j * g_corr[gid] / g_size[gid]
    k = np.arange(1, n + 1)
    return k / n, expected_correct / k


def selective_auc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Area under the accuracy–coverage curve: ``mean_k accuracy(k)`` (1 for a perfect and
    always-right selector; equal to the accuracy when confidence carries no information)."""
    _, acc = accuracy_coverage_curve(confidence, correct)
    return float(acc.mean()) if acc.size else float("nan")


@dataclass
class TTEResult:
    """Per predicted token (flattened over examples and positions, ``[N]``): whether the greedy
    token was right, its probability, the example it came from, and whether ``q`` failed there
    (``None`` without ``q``)."""

    correct: np.ndarray
    confidence: np.ndarray
    example: np.ndarray
    q_fails: np.ndarray | None = None
    method: str = "scorer"

    def _select(self, restrict: bool) -> tuple[np.ndarray, np.ndarray]:
        if not restrict:
            return self.confidence, self.correct
        if self.q_fails is None:
            raise ConfigError("restrict=True needs the TTE run with a q scorer (q_scorer=...)")
        return self.confidence[self.q_fails], self.correct[self.q_fails]

    def curve(self, *, restrict: bool = False) -> tuple[np.ndarray, np.ndarray]:
        return accuracy_coverage_curve(*self._select(restrict))

    def auc(self, *, restrict: bool = False) -> float:
        return selective_auc(*self._select(restrict))

    def acc(self, *, restrict: bool = False) -> float:
        _, corr = self._select(restrict)
        return float(np.mean(corr)) if corr.size else float("nan")

    def estimates(self, *, restrict: bool = False, seed: int = 0) -> dict[str, Estimate]:
        """``{"auc", "acc"}`` with 95% intervals from resampling whole examples (the tokens of one
        example are not independent), ``n`` = examples."""
        conf, corr = self._select(restrict)
        example = self.example if not restrict else self.example[self.q_fails]
        ids, inv = np.unique(example, return_inverse=True)
        groups = [np.flatnonzero(inv == g) for g in range(ids.size)]

        def auc_of(idx: np.ndarray) -> float:
            take = np.concatenate([groups[i] for i in idx]) if idx.size else np.zeros(0, int)
            return selective_auc(conf[take], corr[take])

        sums = np.array([corr[g].sum() for g in groups], dtype=np.float64)
        counts = np.array([g.size for g in groups], dtype=np.float64)
        return {
            "auc": cluster_bootstrap_ci(len(groups), auc_of, seed=seed),
            "acc": pooled_mean_ci(sums, counts, seed=seed),
        }

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        method = method or self.method
        n_ex = int(np.unique(self.example).size)
        out = []
        variants = [(False, "")] + ([(True, "_q_fails")] if self.q_fails is not None else [])
        for restrict, suffix in variants:
            _, corr = self._select(restrict)
            n = int(corr.size)
            std_acc = float(np.std(corr, ddof=1)) if n > 1 else 0.0
            extra = {"examples": n_ex, "restricted": "q_fails" if restrict else None}
            est = self.estimates(restrict=restrict)
            for metric, std in (("auc", None), ("acc", std_acc)):
                e = est[metric]
                row_extra = {**extra, **ci_extra(e)}
                out.append(
                    ResultRow(method, "tte", metric + suffix, e.value, n, std, corpus, row_extra)
                )
        return out


def _as_ids(
    scorer: Scorer, examples: Sequence[str] | Sequence[Sequence[int]], max_tokens: int | None
) -> list[list[int]]:
    seqs = [encode(scorer.tokenizer, e) if isinstance(e, str) else list(e) for e in examples]
    if max_tokens is not None:
        seqs = [s[:max_tokens] for s in seqs]
    return seqs


def token_by_token_extraction(
    scorer: Scorer,
    examples: Sequence[str] | Sequence[Sequence[int]],
    *,
    q_scorer: Scorer | None = None,
    min_prefix: int = 1,
    max_tokens: int | None = None,
    batch_size: int = 16,
) -> TTEResult:
    """TTE over every prefix of every example (texts or token-ID lists; at most ``max_tokens``
    tokens each). Position ``t`` predicts token ``t+1`` from ``x_{<=t}``; prefixes shorter than
    ``min_prefix`` tokens are skipped. ``q_scorer`` (the other constituent) enables the
    "q fails" restriction."""
    if min_prefix < 1:
        raise ConfigError(f"min_prefix must be >= 1, got {min_prefix}")
    seqs = _as_ids(scorer, examples, max_tokens)
    res = batched_greedy(scorer, seqs, batch_size=batch_size)
    q_res = batched_greedy(q_scorer, seqs, batch_size=batch_size) if q_scorer is not None else None
    correct, conf, example, q_fails = [], [], [], []
    for i, s in enumerate(seqs):
        g_ids, g_lp, _ = res[i]
        target = np.asarray(s[1:], dtype=np.int64)
        keep = slice(min_prefix - 1, None)
        correct.append((g_ids.numpy() == target)[keep])
        conf.append(np.exp(g_lp.numpy().astype(np.float64))[keep])
        example.append(np.full(target[keep].size, i, dtype=np.int64))
        if q_res is not None:
            q_fails.append((q_res[i][0].numpy() != target)[keep])
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return TTEResult(
        correct=cat(correct, bool),
        confidence=cat(conf, np.float64),
        example=cat(example, np.int64),
        q_fails=cat(q_fails, bool) if q_res is not None else None,
        method=scorer_name(scorer),
    )
