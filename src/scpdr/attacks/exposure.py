"""Canary exposure (Carlini et al. 2019, "The Secret Sharer"), as the paper uses it (§5.3 "The
canary method", App. D.5 and its table "Canary attack results").

A canary is a fixed prefix followed by a secret of ``n_words`` random words drawn from a word
list; the candidate space ``R`` is every such secret. With ``L(r) = -log Pr[r | prefix]`` (the
log-perplexity of the secret part only, teacher-forced given the prefix), the exposure of a canary
``s`` is

    exposure(s) = log2 |R| - log2 rank(s),   rank(s) = #{r in R : L(r) <= L(s)}

(ties count against the attacker, so a model that cannot tell candidates apart gives exposure 0).
An exposure ``w`` means the canary is among the ``2^-w`` most likely candidates.

- **Exact** when ``|R| <= enumerate_limit``: every candidate is scored.
- **Extrapolated** otherwise (Carlini et al. 2019): a skew-normal is fitted (``scipy``) to the
  log-perplexities of ``n_reference`` (default 10,000) sampled candidates and
  ``exposure(s) = -log2 CDF(L(s))``, clipped to ``[0, log2 |R|]``.

Summaries are per repetition count (how often the canary was inserted): the mean and the 95th
percentile, next to the random-canary baseline (``repetitions == 0``: same format, never inserted)
and the paper's "within two standard deviations of the baseline" flag.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from scpdr.attacks.results import ResultRow, bootstrap_std
from scpdr.attacks.scorer import Scorer, batched_token_logprobs, encode, scorer_name
from scpdr.attacks.stats import bootstrap_ci, ci_extra
from scpdr.errors import ConfigError

__all__ = [
    "Canary",
    "CanarySpace",
    "ExposureResult",
    "canary_exposure",
    "exposure_rows",
    "extrapolated_exposure",
    "random_canaries",
    "rank_exposure",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CanarySpace:
    """The secret's randomness: ``n_words`` independent draws from ``words``, rendered as
    ``lead + sep.join(words)`` right after the prefix (so ``|R| = len(words) ** n_words``)."""

    words: tuple[str, ...]
    n_words: int = 3
    sep: str = " "
    lead: str = " "

    def __post_init__(self) -> None:
        if len(self.words) < 2:
            raise ConfigError("CanarySpace.words needs at least 2 words")
        if len(set(self.words)) != len(self.words):
            raise ConfigError("CanarySpace.words has duplicates: each candidate must be unique")
        if self.n_words < 1:
            raise ConfigError(f"CanarySpace.n_words must be >= 1, got {self.n_words}")

    @property
    def size(self) -> int:
        return len(self.words) ** self.n_words

    @property
    def log2_size(self) -> float:
        return self.n_words * math.log2(len(self.words))

    def render(self, secret: Sequence[str]) -> str:
        return self.lead + self.sep.join(secret)

    def index(self, secret: Sequence[str]) -> tuple[int, ...]:
        pos = {w: i for i, w in enumerate(self.words)}
        try:
            return tuple(pos[w] for w in secret)
        except KeyError as exc:
            raise ConfigError(
                f"canary word {exc.args[0]!r} is not in the candidate word list; the exposure "
                "space must contain every canary (pass the word list the canaries were drawn from)"
            ) from None

    def sample(self, n: int, *, rng: np.random.Generator) -> np.ndarray:
        """``int[n, n_words]`` word indices, uniform over ``R``."""
        return rng.integers(0, len(self.words), size=(n, self.n_words))

    def all_indices(self) -> np.ndarray:
        """``int[|R|, n_words]``: every candidate, in lexicographic order."""
        grids = np.meshgrid(*([np.arange(len(self.words))] * self.n_words), indexing="ij")
        return np.stack([g.ravel() for g in grids], axis=1)


@dataclass(frozen=True)
class Canary:
    """One canary: ``prefix`` (fixed context), ``secret`` (its random words) and how many times
    it was inserted into the training data (0: a never-inserted baseline canary)."""

    prefix: str
    secret: tuple[str, ...]
    repetitions: int = 0


def random_canaries(
    space: CanarySpace, prefix: str | Sequence[str], n: int, *, seed: int = 0
) -> list[Canary]:
    """``n`` never-inserted canaries of the same format (the random-canary baseline). A list of
    prefixes is cycled through."""
    prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
    idx = space.sample(n, rng=np.random.default_rng(seed))
    return [
        Canary(prefixes[i % len(prefixes)], tuple(space.words[j] for j in row), 0)
        for i, row in enumerate(idx)
    ]


def rank_exposure(
    canary_logppl: np.ndarray | float, all_logppl: np.ndarray, *, tie_tol: float = 1e-4
) -> np.ndarray:
    """Exact exposure ``log2|R| - log2 rank`` with ``rank = #{r : L(r) <= L(s) + tie_tol}``;
    ``all_logppl`` is ``L`` over the whole space (the canary included)."""
    ref = np.sort(np.asarray(all_logppl, dtype=np.float64))
    s = np.atleast_1d(np.asarray(canary_logppl, dtype=np.float64))
    rank = np.maximum(np.searchsorted(ref, s + tie_tol, side="right"), 1)
    return np.log2(ref.size) - np.log2(rank)


def extrapolated_exposure(
    canary_logppl: np.ndarray | float,
    reference_logppl: np.ndarray,
    *,
    log2_space: float,
    tie_tol: float = 1e-4,
) -> np.ndarray:
    """Exposure by the skew-normal extrapolation: ``-log2 CDF(L(s))`` with the skew-normal fitted
    to a sample of candidate log-perplexities; clipped to ``[0, log2_space]``. A sample with no
    spread (a model that cannot tell candidates apart) falls back to the empirical CDF."""
    from scipy import stats

    ref = np.asarray(reference_logppl, dtype=np.float64)
    s = np.atleast_1d(np.asarray(canary_logppl, dtype=np.float64))
    mu, sd = float(ref.mean()), float(ref.std())
    if sd < tie_tol:
        frac = np.maximum((ref[None, :] <= s[:, None] + tie_tol).mean(axis=1), 1.0 / ref.size)
        return np.clip(-np.log2(frac), 0.0, log2_space)
    z = (ref - mu) / sd  # fit in standard units: the optimizer is better behaved
    a, loc, scale = stats.skewnorm.fit(z)
    logcdf = stats.skewnorm.logcdf((s - mu) / sd, a, loc, scale)
    return np.clip(-logcdf / math.log(2.0), 0.0, log2_space)


@dataclass
class ExposureResult:
    """Per-canary exposures (``float[N]``), log-perplexities and repetition counts, and how
    they were computed (``"exact"`` or ``"extrapolated"``)."""

    canaries: list[Canary]
    exposure: np.ndarray
    logppl: np.ndarray
    mode: str
    log2_space: float
    n_reference: int
    method: str = "scorer"
    reference_logppl: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def repetitions(self) -> np.ndarray:
        return np.array([c.repetitions for c in self.canaries], dtype=np.int64)

    def rows(self, *, method: str | None = None, corpus: str | None = None) -> list[ResultRow]:
        return exposure_rows(
            self.exposure,
            self.repetitions,
            method=method or self.method,
            corpus=corpus,
            extra={"mode": self.mode, "log2_space": self.log2_space},
        )


def _score_logppl(
    scorer: Scorer, prefix_ids: list[int], secret_ids: Sequence[list[int]], *, batch_size: int
) -> np.ndarray:
    """``L = -sum log Pr[secret tokens | prefix, earlier secret tokens]`` for each secret: the
    prefix is the prompt and the secret its continuation, as ``generate`` would produce it
    (CP-Fuse's path starts at the prefix's end; the TDE game's protocol, Def. 4.2)."""
    seqs = [prefix_ids + s for s in secret_ids]
    prompts = [len(prefix_ids)] * len(seqs)
    tls = batched_token_logprobs(scorer, seqs, batch_size=batch_size, prompt_lengths=prompts)
    start = len(prefix_ids) - 1  # position t of token_logprobs predicts token t + 1
    return np.array([-float(tl[start:].sum()) for tl in tls], dtype=np.float64)


def canary_exposure(
    scorer: Scorer,
    canaries: Sequence[Canary],
    space: CanarySpace,
    *,
    n_reference: int = 10_000,
    enumerate_limit: int = 1 << 14,
    batch_size: int = 32,
    seed: int = 0,
    tie_tol: float = 1e-4,
) -> ExposureResult:
    """Exposure of every canary under ``scorer`` (exact when ``space.size <= enumerate_limit``,
    else the skew-normal extrapolation from ``n_reference`` sampled candidates). Candidates
    sharing a prefix share one reference sample. Only the secret part is scored, teacher-forced
    given the fixed prefix, in batches of ``batch_size``."""
    if not canaries:
        raise ConfigError("canary_exposure needs at least one canary")
    exact = space.size <= enumerate_limit
    if not exact and n_reference < 100:
        raise ConfigError(
            f"n_reference={n_reference} is too small to fit a skew-normal (use >= 100)"
        )
    tok = scorer.tokenizer
    word_ids: dict[tuple[int, ...], list[int]] = {}

    def secret_ids(rows: np.ndarray) -> list[list[int]]:
        out = []
        for row in rows:
            key = tuple(int(x) for x in row)
            if key not in word_ids:
                word_ids[key] = encode(
                    tok, space.render([space.words[i] for i in key]), add_special_tokens=False
                )
            out.append(word_ids[key])
        return out

    by_prefix: dict[str, list[int]] = {}
    for i, c in enumerate(canaries):
        by_prefix.setdefault(c.prefix, []).append(i)
    exposure = np.empty(len(canaries))
    logppl = np.empty(len(canaries))
    refs: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(seed)
    for prefix, members in by_prefix.items():
        prefix_ids = encode(tok, prefix)
        if not prefix_ids:
            raise ConfigError("a canary prefix tokenizes to nothing; the secret needs a context")
        canary_idx = np.array([space.index(canaries[i].secret) for i in members])
        if exact:
            everything = space.all_indices()
            all_l = _score_logppl(scorer, prefix_ids, secret_ids(everything), batch_size=batch_size)
            flat = np.ravel_multi_index(canary_idx.T, (len(space.words),) * space.n_words)
            s_l = all_l[flat]
            exposure[members] = rank_exposure(s_l, all_l, tie_tol=tie_tol)
            refs[prefix] = all_l
        else:
            sample = space.sample(n_reference, rng=rng)
            both = np.concatenate([canary_idx, sample])
            both_l = _score_logppl(scorer, prefix_ids, secret_ids(both), batch_size=batch_size)
            s_l, ref_l = both_l[: len(members)], both_l[len(members) :]
            exposure[members] = extrapolated_exposure(
                s_l, ref_l, log2_space=space.log2_size, tie_tol=tie_tol
            )
            refs[prefix] = ref_l
        logppl[members] = s_l
        log.debug("exposure: %d canaries with prefix %r scored", len(members), prefix[:30])
    return ExposureResult(
        canaries=list(canaries),
        exposure=exposure,
        logppl=logppl,
        mode="exact" if exact else "extrapolated",
        log2_space=space.log2_size,
        n_reference=space.size if exact else n_reference,
        method=scorer_name(scorer),
        reference_logppl=refs,
    )


def _p95(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.percentile(x, 95, axis=axis)


def exposure_rows(
    exposure: Iterable[float],
    repetitions: Iterable[int],
    *,
    method: str,
    corpus: str | None = None,
    extra: dict | None = None,
    n_boot: int = 1000,
) -> list[ResultRow]:
    """Rows ``exposure_mean`` and ``exposure_p95`` per repetition count (``repetitions`` in the
    row), and ``baseline_exposure_mean`` / ``baseline_exposure_p95`` for the never-inserted
    canaries (``repetitions == 0``; flagged ``baseline: true``, no ``repetitions`` key).

    ``ci_low``/``ci_high``: the 95% percentile-bootstrap interval over canaries.
    ``stderr`` is the bootstrap standard error of the statistic; ``std`` is the spread across
    canaries for the mean and ``stderr * sqrt(n)`` for the percentile (so that ``std / sqrt(n)``
    is the standard error for every row, as the report's STE row reads it). Inserted groups
    carry ``within_2std_of_baseline``: ``value <= baseline + 2 * stderr(baseline)`` — not
    significantly above chance (the underlining in the paper's canary table, App. D.5).
    """
    exp = np.asarray(list(exposure), dtype=np.float64)
    rep = np.asarray(list(repetitions), dtype=np.int64)
    if exp.shape != rep.shape:
        raise ValueError("exposure and repetitions must have the same length")
    extra = dict(extra or {})
    stats_of = {"exposure_mean": np.mean, "exposure_p95": _p95}
    baseline: dict[str, tuple[float, float]] = {}
    rows = []

    def row(metric: str, vals: np.ndarray, row_extra: dict) -> ResultRow:
        fn = stats_of[metric.removeprefix("baseline_")]
        value = float(fn(vals))
        se = bootstrap_std(vals, fn, n_boot=n_boot)
        if metric.endswith("exposure_mean"):
            std = float(vals.std(ddof=1)) if vals.size > 1 else 0.0
        else:
            std = se * math.sqrt(vals.size)
        row_extra = {**row_extra, "stderr": se, **ci_extra(bootstrap_ci(vals, fn, n_boot=n_boot))}
        base = baseline.get(metric)
        if base is not None:
            row_extra["baseline_value"] = base[0]
            row_extra["within_2std_of_baseline"] = bool(value <= base[0] + 2.0 * base[1])
        return ResultRow(method, "canary", metric, value, int(vals.size), std, corpus, row_extra)

    if (rep == 0).any():
        b = exp[rep == 0]
        for metric in stats_of:
            r = row(f"baseline_{metric}", b, {**extra, "baseline": True})
            baseline[metric] = (r.value, float(r.extra["stderr"]))
            rows.append(r)
    for rr in sorted(set(rep.tolist()) - {0}):
        vals = exp[rep == rr]
        for metric in stats_of:
            rows.append(row(metric, vals, {**extra, "repetitions": rr}))
    return rows
