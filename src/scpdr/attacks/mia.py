"""The membership-inference suite auditors run, one function per attack, all on the same members
and non-members (issue "A privacy audit that holds up"; mimir, Duan et al. 2024).

Every attack turns what the TDE game (Def. 4.1) lets an adversary observe — the target's
next-token distribution of each prefix, sent as a fresh prompt — into one membership score per
example, **higher = predicted member**:

========  ===========================================================================  ===========
attack    score of an example with scored tokens y_1..y_L                              reference
========  ===========================================================================  ===========
loss      mean_t log r(y_t | y_<t)  (Yeom et al. 2018)                                  none
zlib      sum_t log r(y_t | y_<t) / zlib bytes of the text (Carlini et al. 2021)       none
min-k     mean of the k% lowest log r(y_t | y_<t)  (Shi et al. 2024)                   none
min-k++   mean of the k% lowest (log r(y_t) − μ_t) / σ_t, μ_t and σ_t² the mean and    none
          variance of log r(z) for z ~ r(· | y_<t)  (Zhang et al. 2024)
ref       sum_t [log r(y_t | y_<t) − log b(y_t | y_<t)], b = the bundle's base model   base model
lira      sum_t [log r_1(y_t | y_<t) − log r_0(y_t | y_<t)], r_0 = the method over p0  (offline
          trained without the members (§4.2, Thm 4.5: the worst-case reference)        LiRA)
rmia      Pr_z[LR(y) / LR(z) ≥ γ], LR = r / ((1+a)/2 · ref + (1−a)/2) on per-token     LiRA's
          geometric means, z the non-members (never y itself); Zarifzadeh et al.      (p0), else
          2024, :mod:`scpdr.attacks.rmia`                                              the base
========  ===========================================================================  ===========

``ref`` and ``lira`` are log-likelihood ratios of the scored continuation (the chain rule sums
per-token ratios), the statistic the paper's bounds t_x / v_x constrain (Thm 4.4, 4.5).

What is scored of an example is :func:`scpdr.attacks.examples.example_ids`' rule (a prompted
example: its response given its prompt; a text: every token after the first), every prefix a
fresh request (:func:`scpdr.attacks.scorer.score_requests`).

:func:`membership_inference` runs the suite on one target; :func:`scores_from_stats` computes the
reference-free scores from per-token statistics; :func:`mia_rows` turns member/non-member scores
into result rows (ROC AUC, TPR at 1% and 0.1% FPR, each with a bootstrap 95% CI,
``n_members``/``n_nonmembers``) via :func:`scpdr.attacks.stats.roc_metrics` (scikit-learn).

An AUC below 0.5 is leakage too (an attacker who knows the direction flips the test): the report
ranks protection by ``|AUC − 0.5|`` (:func:`auc_distance`); the scores keep their theoretical
orientation (higher = member) so the rows are the raw test's.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scpdr.attacks.examples import cached_token_logprobs, example_ids
from scpdr.attacks.results import ResultRow
from scpdr.attacks.rmia import DEFAULT_A, DEFAULT_GAMMA, log_ratio, rmia_scores
from scpdr.attacks.scorer import batched_position_stats, scorer_name
from scpdr.attacks.stats import FPR_LEVELS, N_BOOT, RocMetrics, roc_metrics

__all__ = [
    "DEFAULT_K",
    "MIA_ATTACKS",
    "MIA_LABELS",
    "MIA_METRICS",
    "REFERENCE_FREE",
    "ExampleStats",
    "MIAResult",
    "MIAScores",
    "auc_distance",
    "loss_score",
    "membership_inference",
    "metric_name",
    "mia_rows",
    "min_k_plus_plus_score",
    "min_k_score",
    "ratio_score",
    "scores_from_stats",
    "zlib_score",
]

#: The suite, in report order.
MIA_ATTACKS: tuple[str, ...] = ("loss", "zlib", "min-k", "min-k++", "ref", "lira", "rmia")
#: Display names of the attacks (report tables and plots).
MIA_LABELS: dict[str, str] = {
    "loss": "LOSS",
    "zlib": "zlib",
    "min-k": "Min-K%",
    "min-k++": "Min-K%++",
    "ref": "Ref (base)",
    "lira": "LiRA (p0)",
    "rmia": "RMIA",
}
#: Attacks that need no reference model.
REFERENCE_FREE: tuple[str, ...] = ("loss", "zlib", "min-k", "min-k++")
#: The fraction of lowest-scoring tokens Min-K% and Min-K%++ average (both papers' default).
DEFAULT_K = 0.2


def metric_name(level: float) -> str:
    """``"tpr@0.01fpr"`` for 0.01: the result-row metric of TPR at FPR ``level``."""
    return f"tpr@{level:g}fpr"


#: Result-row metrics of every MIA attack.
MIA_METRICS: tuple[str, ...] = ("auc", *(metric_name(lv) for lv in FPR_LEVELS))


def _lp(token_logprobs: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_logprobs, dtype=np.float64).ravel()
    if arr.size == 0:
        raise ValueError("an example with no scored tokens has no membership score")
    return arr


def _lowest_mean(values: np.ndarray, k: float) -> float:
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k must be in (0, 1] (a fraction of the tokens), got {k}")
    n = max(1, int(values.size * k))
    return float(np.mean(np.partition(values, n - 1)[:n]))


def loss_score(token_logprobs: Sequence[float] | np.ndarray) -> float:
    """LOSS: the mean token log-likelihood (the negative of the loss)."""
    return float(np.mean(_lp(token_logprobs)))


def zlib_score(token_logprobs: Sequence[float] | np.ndarray, text: str) -> float:
    """zlib: the sequence log-likelihood over the zlib-compressed length of its text in bytes
    (Carlini et al. 2021's ratio; mimir's ``loss / zlib_entropy`` up to sign and length)."""
    size = len(zlib.compress(text.encode("utf-8")))
    return float(np.sum(_lp(token_logprobs))) / max(size, 1)


def min_k_score(token_logprobs: Sequence[float] | np.ndarray, *, k: float = DEFAULT_K) -> float:
    """Min-K% Prob: the mean of the ``k`` fraction of lowest token log-probs (at least one)."""
    return _lowest_mean(_lp(token_logprobs), k)


def min_k_plus_plus_score(
    token_logprobs: Sequence[float] | np.ndarray,
    mu: Sequence[float] | np.ndarray,
    sigma: Sequence[float] | np.ndarray,
    *,
    k: float = DEFAULT_K,
) -> float:
    """Min-K%++: each token's log-prob standardized by the mean ``mu`` and standard deviation
    ``sigma`` of the log-prob of a token drawn from the same next-token distribution, then the
    mean of the ``k`` fraction of lowest (Zhang et al. 2024, Eq. 4). A position whose
    distribution is a point mass (``sigma`` = 0) contributes 0."""
    lp = _lp(token_logprobs)
    mu_a = np.asarray(mu, dtype=np.float64).ravel()
    sd = np.asarray(sigma, dtype=np.float64).ravel()
    if mu_a.shape != lp.shape or sd.shape != lp.shape:
        raise ValueError(
            f"mu and sigma need one value per scored token ({lp.size}), got {mu_a.size} and "
            f"{sd.size}"
        )
    z = np.divide(lp - mu_a, sd, out=np.zeros_like(lp), where=sd > 0)
    return _lowest_mean(z, k)


def ratio_score(
    target_logprobs: Sequence[float] | np.ndarray,
    reference_logprobs: Sequence[float] | np.ndarray,
) -> float:
    """``ref`` / ``lira``: the log-likelihood ratio of the scored tokens, target vs reference
    (summed over tokens: the chain rule)."""
    t, r = _lp(target_logprobs), _lp(reference_logprobs)
    if t.shape != r.shape:
        raise ValueError(f"target and reference scored {t.size} and {r.size} tokens")
    return float(np.sum(t - r))


@dataclass(frozen=True)
class ExampleStats:
    """What the target reveals about one example's scored tokens (float64 arrays, one entry per
    token): the log-prob of each actual token, and the mean/std of the log-prob of a token drawn
    from the same next-token distribution (for Min-K%++); ``text`` is what zlib compresses."""

    logprobs: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray
    text: str


def scores_from_stats(stats: ExampleStats, *, k: float = DEFAULT_K) -> dict[str, float]:
    """The reference-free scores (:data:`REFERENCE_FREE`) of one example."""
    return {
        "loss": loss_score(stats.logprobs),
        "zlib": zlib_score(stats.logprobs, stats.text),
        "min-k": min_k_score(stats.logprobs, k=k),
        "min-k++": min_k_plus_plus_score(stats.logprobs, stats.mu, stats.sigma, k=k),
    }


@dataclass
class MIAScores:
    """Every attack's scores of the members and the non-members of one method (raw scores are
    kept, so any metric can be recomputed: ML Privacy Meter's habit)."""

    method: str
    members: dict[str, list[float]] = field(default_factory=dict)
    nonmembers: dict[str, list[float]] = field(default_factory=dict)

    def add(self, attack: str, *, member: bool, score: float) -> None:
        side = self.members if member else self.nonmembers
        side.setdefault(attack, []).append(float(score))

    def metrics(self, attack: str, *, n_boot: int = N_BOOT, seed: int = 0) -> RocMetrics:
        return roc_metrics(
            self.members.get(attack, []),
            self.nonmembers.get(attack, []),
            n_boot=n_boot,
            seed=seed,
        )

    def attacks(self) -> list[str]:
        return [a for a in MIA_ATTACKS if self.members.get(a) and self.nonmembers.get(a)]


def mia_rows(
    scores: MIAScores,
    *,
    corpus: str | None = None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    extra: Mapping[str, object] | None = None,
    attack_extra: Mapping[str, Mapping[str, object]] | None = None,
) -> list[ResultRow]:
    """Result rows of every attack ``scores`` holds: metrics :data:`MIA_METRICS`, each with
    ``ci_low``/``ci_high``, ``n_members``, ``n_nonmembers`` (``n`` = both together), plus
    ``extra`` and ``attack_extra[attack]`` (e.g. which reference RMIA used)."""
    rows = []
    for attack in scores.attacks():
        met = scores.metrics(attack, n_boot=n_boot, seed=seed)
        ests = {"auc": met.auc, **{metric_name(lv): e for lv, e in met.tpr.items()}}
        for metric, est in ests.items():
            rows.append(
                ResultRow(
                    scores.method,
                    attack,
                    metric,
                    est.value,
                    n=est.n,
                    corpus=corpus,
                    extra={
                        "ci_low": est.ci_low,
                        "ci_high": est.ci_high,
                        "n_members": met.n_members,
                        "n_nonmembers": met.n_nonmembers,
                        **(extra or {}),
                        **((attack_extra or {}).get(attack) or {}),
                    },
                )
            )
    return rows


def auc_distance(auc: float) -> float:
    """``|AUC − 0.5|``: how far a membership test is from chance in either direction (a test
    below 0.5 flipped is as good as its mirror above)."""
    return abs(float(auc) - 0.5)


@dataclass
class MIAResult:
    """The suite's scores on one target (:class:`MIAScores`), the population they came from
    (``"canaries"`` / ``"records"``) and how many examples LiRA could use."""

    scores: MIAScores
    population: str = "records"
    attack_extra: dict[str, dict[str, Any]] = field(default_factory=dict)

    def rows(
        self, *, method: str | None = None, corpus: str | None = None, seed: int = 0
    ) -> list[ResultRow]:
        sc = self.scores
        if method is not None and method != sc.method:
            sc = MIAScores(method, sc.members, sc.nonmembers)
        return mia_rows(
            sc,
            corpus=corpus,
            seed=seed,
            extra={"population": self.population},
            attack_extra=self.attack_extra,
        )

    def curves(self) -> dict[str, dict[str, Any]]:
        """``{attack: {"fpr", "tpr", "auc"}}``: the ROC of every attack (for the plots)."""
        out = {}
        for attack in self.scores.attacks():
            met = self.scores.metrics(attack, n_boot=1)
            out[attack] = {
                "fpr": met.fpr_curve.tolist(),
                "tpr": met.tpr_curve.tolist(),
                "auc": met.auc.value,
            }
        return out


def _subset(members: Sequence[Any], chosen: Sequence[Any] | None) -> list[int]:
    """Indices of ``members`` that are in ``chosen`` (all when ``chosen`` is None)."""
    if chosen is None:
        return list(range(len(members)))
    chosen = list(chosen)
    return [i for i, m in enumerate(members) if any(m is c or m == c for c in chosen)]


def membership_inference(
    target: Any,
    members: Sequence[Any],
    nonmembers: Sequence[Any],
    *,
    base: Any = None,
    reference: Any = None,
    lira_members: Sequence[Any] | None = None,
    population: str = "records",
    method: str | None = None,
    k: float = DEFAULT_K,
    rmia_population: Sequence[Any] | None = None,
    rmia_a: float = DEFAULT_A,
    rmia_gamma: float = DEFAULT_GAMMA,
    max_tokens: int | None = None,
    batch_size: int = 16,
    cache: dict | None = None,
) -> MIAResult:
    """Every attack of :data:`MIA_ATTACKS` on ``target`` (a :class:`~scpdr.attacks.scorer.Scorer`)
    with the same members and non-members (texts, token lists, ``(prompt, response)`` pairs or
    records; :func:`~scpdr.attacks.examples.example_ids` says what is scored).

    ``base``: the reference of ``ref`` (the bundle's base model; skipped when None).
    ``reference``: LiRA's offline reference, trained without the members (for a NAF method the
    same method over ``p0``: Thm 4.5's worst case; skipped when None); ``lira_members``: the
    members that reference never saw (default: all). ``cache``: a dict kept across calls, so the
    base's and reference's scores of the same examples are computed once.

    ``rmia`` (:mod:`scpdr.attacks.rmia`) runs against LiRA's reference when there is one (on the
    same members), else against ``base``; its population ``z`` is ``rmia_population`` (non-member
    examples) or, by default, the non-members themselves, each example never compared with
    itself (same token ids). ``rmia_a``, ``rmia_gamma``: the offline coefficient and threshold.
    """
    if not members or not nonmembers:
        raise ValueError(
            f"membership inference needs members and non-members, got {len(members)} and "
            f"{len(nonmembers)}"
        )
    tok = target.tokenizer
    labels = [f"member {i}" for i in range(len(members))]
    labels += [f"non-member {i}" for i in range(len(nonmembers))]
    pairs = [
        example_ids(tok, x, max_tokens=max_tokens, label=lab)
        for x, lab in zip([*members, *nonmembers], labels, strict=True)
    ]
    seqs = [p[0] for p in pairs]
    starts = [p[1] - 1 for p in pairs]  # position t of a score is about token t + 1
    stats = batched_position_stats(target, seqs, batch_size=batch_size)
    n_mem = len(members)
    out = MIAScores(method or scorer_name(target))
    for i, (st, seq, s0) in enumerate(zip(stats, seqs, starts, strict=True)):
        ex = ExampleStats(
            st.token_logprobs[s0:], st.mu[s0:], st.sigma[s0:], tok.decode(seq[s0 + 1 :])
        )
        for attack, score in scores_from_stats(ex, k=k).items():
            out.add(attack, member=i < n_mem, score=score)
    ratio_refs = [("ref", base, None), ("lira", reference, lira_members)]
    ref_lps: dict[str, dict[int, np.ndarray]] = {}  # attack -> example -> reference log-probs
    for attack, ref, chosen in ratio_refs:
        if ref is None:
            continue
        keep = set(_subset(members, chosen)) | set(range(n_mem, len(seqs)))
        idx = [i for i in range(len(seqs)) if i in keep]
        ref_lp = cached_token_logprobs(
            ref, [seqs[i] for i in idx], batch_size=batch_size, cache=cache
        )
        ref_lps[attack] = {}
        for i, r in zip(idx, ref_lp, strict=True):
            t = stats[i].token_logprobs[starts[i] :]
            ref_lps[attack][i] = r.double().numpy()[starts[i] :]
            out.add(attack, member=i < n_mem, score=ratio_score(t, ref_lps[attack][i]))
    result = MIAResult(out, population)
    via = "lira" if "lira" in ref_lps else "ref" if "ref" in ref_lps else None
    # the default population is the other non-members: one alone has none to be compared with
    if via is not None and (rmia_population is not None or len(nonmembers) > 1):
        rmia_ref = reference if via == "lira" else base
        target_lp = {
            i: st.token_logprobs[s0:] for i, (st, s0) in enumerate(zip(stats, starts, strict=True))
        }
        _add_rmia(
            out,
            target_lp,
            ref_lps[via],
            seqs,
            n_mem,
            target=target,
            reference=rmia_ref,
            population=rmia_population,
            a=rmia_a,
            gamma=rmia_gamma,
            max_tokens=max_tokens,
            batch_size=batch_size,
            cache=cache,
        )
        result.attack_extra["rmia"] = {
            "reference": "p0" if via == "lira" else "base",
            "rmia_a": float(rmia_a),
            "rmia_gamma": float(rmia_gamma),
        }
    return result


def _add_rmia(
    out: MIAScores,
    target_lp: Mapping[int, np.ndarray],
    ref_lp: Mapping[int, np.ndarray],
    seqs: Sequence[Sequence[int]],
    n_mem: int,
    *,
    target: Any,
    reference: Any,
    population: Sequence[Any] | None,
    a: float,
    gamma: float,
    max_tokens: int | None,
    batch_size: int,
    cache: dict | None,
) -> None:
    """RMIA's scores of the examples ``ref_lp`` covers (members the reference never saw, and the
    non-members), against ``population`` or the non-members (never an example itself)."""
    idx = sorted(ref_lp)
    lr_x = log_ratio(
        [float(np.mean(target_lp[i])) for i in idx], [float(np.mean(ref_lp[i])) for i in idx], a=a
    )
    if population is None:
        z_idx = [i for i in idx if i >= n_mem]
        lr_z, z_seqs = lr_x[[idx.index(i) for i in z_idx]], [seqs[i] for i in z_idx]
    else:
        pairs = [
            example_ids(target.tokenizer, x, max_tokens=max_tokens, label=f"population {j}")
            for j, x in enumerate(population)
        ]
        z_seqs = [p[0] for p in pairs]
        t_lp = cached_token_logprobs(target, z_seqs, batch_size=batch_size, cache=None)
        r_lp = cached_token_logprobs(reference, z_seqs, batch_size=batch_size, cache=cache)
        lr_z = log_ratio(
            [float(t.double()[s - 1 :].mean()) for t, (_, s) in zip(t_lp, pairs, strict=True)],
            [float(r.double()[s - 1 :].mean()) for r, (_, s) in zip(r_lp, pairs, strict=True)],
            a=a,
        )
    keys_z = [tuple(s) for s in z_seqs]
    same = np.array([[tuple(seqs[i]) == kz for kz in keys_z] for i in idx], dtype=bool)
    scores = rmia_scores(lr_x, lr_z, gamma=gamma, same=same.reshape(len(idx), len(keys_z)))
    for i, s in zip(idx, scores, strict=True):
        out.add("rmia", member=i < n_mem, score=float(s))
