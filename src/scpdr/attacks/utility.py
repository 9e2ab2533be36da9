"""Utility on held-out data (§5.2 "Utility Evaluation"; Table "Full results", Utility columns):
next-token accuracy (the greedy token equals the true one) and mean negative log-likelihood,
pooled over every predicted token of the validation examples (each prefix a fresh request,
:func:`scpdr.attacks.scorer.score_requests`), with 95% intervals over examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, batched_greedy, encode, scorer_name
from scpdr.attacks.stats import ci_extra, pooled_mean_ci

__all__ = ["UtilityResult", "utility"]


@dataclass
class UtilityResult:
    """Per predicted token (``[N]``): greedy-correct, the NLL of the true token (nats) and the
    example it belongs to."""

    correct: np.ndarray
    nll: np.ndarray
    n_examples: int
    method: str = "scorer"
    example: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.example is None:  # one example per token: the token-level interval
            self.example = np.arange(self.correct.size)
            self.n_examples = max(self.n_examples, int(self.correct.size))

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean()) if self.correct.size else float("nan")

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean()) if self.nll.size else float("nan")

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        """``accuracy`` and ``nll`` pooled over tokens, each with a 95% interval from resampling
        whole examples; ``std`` is the spread over tokens (``stderr`` = std / sqrt(tokens))."""
        method = method or self.method
        n = int(self.correct.size)
        counts = np.bincount(self.example, minlength=self.n_examples).astype(np.float64)
        out = []
        c = self.correct.astype(np.float64)
        for metric, vals in (("accuracy", c), ("nll", self.nll)):
            sums = np.bincount(self.example, weights=vals, minlength=self.n_examples)
            est = pooled_mean_ci(sums, counts)
            sd = float(np.std(vals, ddof=1)) if vals.size > 1 else 0.0
            se = sd / np.sqrt(vals.size) if vals.size > 1 else 0.0
            extra = {"examples": self.n_examples, "stderr": se, **ci_extra(est)}
            out.append(ResultRow(method, "utility", metric, est.value, n, sd, corpus, extra))
        return out


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
    correct, nll, example = [], [], []
    for i, (s, (g_ids, _, tl)) in enumerate(zip(seqs, res, strict=True)):
        correct.append(g_ids.numpy() == np.asarray(s[1:], dtype=np.int64))
        nll.append(-tl.double().numpy())
        example.append(np.full(len(s[1:]), i, dtype=np.int64))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return UtilityResult(
        cat(correct, bool),
        cat(nll, np.float64),
        len(seqs),
        scorer_name(scorer),
        cat(example, np.int64),
    )
