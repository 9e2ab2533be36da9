"""Utility on held-out data (§5.2 "Utility Evaluation"; Table "Full results", Utility columns):
next-token accuracy (the greedy token equals the true one) and mean negative log-likelihood,
pooled over every predicted token of the validation examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, batched_greedy, encode, scorer_name

__all__ = ["UtilityResult", "utility"]


@dataclass
class UtilityResult:
    """Per predicted token (``[N]``): greedy-correct and the NLL of the true token (nats)."""

    correct: np.ndarray
    nll: np.ndarray
    n_examples: int
    method: str = "scorer"

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean()) if self.correct.size else float("nan")

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean()) if self.nll.size else float("nan")

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        method = method or self.method
        n = int(self.correct.size)
        extra = {"examples": self.n_examples}

        def sd(x: np.ndarray) -> float:
            return float(np.std(x, ddof=1)) if x.size > 1 else 0.0

        def se(x: np.ndarray) -> float:
            return sd(x) / np.sqrt(x.size) if x.size > 1 else 0.0

        c = self.correct.astype(np.float64)
        return [
            ResultRow(
                method,
                "utility",
                "accuracy",
                self.accuracy,
                n,
                sd(c),
                corpus,
                {**extra, "stderr": se(c)},
            ),
            ResultRow(
                method,
                "utility",
                "nll",
                self.mean_nll,
                n,
                sd(self.nll),
                corpus,
                {**extra, "stderr": se(self.nll)},
            ),
        ]


def utility(
    scorer: Scorer,
    examples: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_tokens: int | None = None,
    batch_size: int = 16,
) -> UtilityResult:
    """Next-token accuracy and NLL of ``scorer`` over every position of ``examples``."""
    seqs = [encode(scorer.tokenizer, e) if isinstance(e, str) else list(e) for e in examples]
    if max_tokens is not None:
        seqs = [s[:max_tokens] for s in seqs]
    res = batched_greedy(scorer, seqs, batch_size=batch_size)
    correct, nll = [], []
    for s, (g_ids, _, tl) in zip(seqs, res, strict=True):
        correct.append(g_ids.numpy() == np.asarray(s[1:], dtype=np.int64))
        nll.append(-tl.double().numpy())
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return UtilityResult(cat(correct, bool), cat(nll, np.float64), len(seqs), scorer_name(scorer))
