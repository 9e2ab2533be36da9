"""The budget sweep's serving mode as an axis (``docs/accountant.md``, "Budgets and attacks").

Besides the stop rule (:mod:`scpdr.attacks.budget`: the response ends at the first position
whose charge would take it past B), two ways of continuing from the base model are measured:

- **fallback** at B (``on_budget="base"``, Proposition 3): read off the same unbudgeted trace
  (``score(ids, cost=True, t_x=True, base=True)``, one per method): :func:`scpdr.bounds.
  private_prefix` says which leading positions are private; the served log-probs are the private
  aggregate's there and the (floored) base's after;
- **anchor** c (``anchor=c``, Proposition 4): one ``score(..., anchor=c, base=True)`` trace per c,
  every position served from the base-anchored mixture.

Every membership test of the suite (:data:`scpdr.attacks.mia.MIA_ATTACKS`: LOSS, zlib, Min-K%,
Min-K%++, Ref, LiRA, RMIA against LiRA's reference or else the base, its population the other
non-members) is scored on what a setting serves (stop: the served prefix, an example with none
scoring 0 on every test — no evidence), with AUC and TPR@1% and their 95% intervals; utility is
next-token accuracy over every validation position (a withheld position counting as not
predicted), tokens per greedy answer (answers generated under the setting) and ``private``: the
fraction of answer tokens served from the private aggregate (1 for the anchor: every token comes
from the anchored aggregate). PII extraction (AEL, FER) under the fallback and the anchor: each
record's greedy extraction generated under the setting, scored on every token it served (the stop
rule's is read off the unbudgeted trace in :mod:`scpdr.attacks.budget`). Rows: attack ``"budget"``, ``extra["mode"]`` ("stop" | "fallback" |
"anchor") with ``extra["budget"]`` or ``extra["anchor"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scpdr import bounds, naf
from scpdr.attacks.mia import (
    REFERENCE_FREE,
    ExampleStats,
    MIAScores,
    mia_rows,
    ratio_score,
    scores_from_stats,
)
from scpdr.attacks.results import ResultRow
from scpdr.attacks.rmia import log_ratio, rmia_scores
from scpdr.attacks.scorer import FULL_CHUNK_ELEMENTS, pad_batch, pad_token_id, token_moments
from scpdr.attacks.stats import bootstrap_ci

__all__ = [
    "MODES",
    "ModeTrace",
    "Setting",
    "mode_echo_traces",
    "mode_rows",
    "served_view",
    "serving_kwargs",
    "setting_row",
    "settings",
]

#: The serving modes of the sweep.
MODES: tuple[str, ...] = ("stop", "fallback", "anchor")


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: ``mode`` with its ``budget`` (stop, fallback; None = none) or
    ``anchor`` (nats per token)."""

    mode: str
    budget: float | None = None
    anchor: float | None = None

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "budget": self.budget}
        if self.mode == "anchor":
            out["anchor"] = self.anchor
        return out


def settings(
    modes: Sequence[str], budgets: Sequence[float | None], anchors: Sequence[float]
) -> list[Setting]:
    """Every setting of a grid: stop and fallback at each budget, anchor at each c."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown serving modes {bad}: choose from {list(MODES)}")
    out = [Setting(m, b) for m in ("stop", "fallback") if m in modes for b in budgets]
    return out + (
        [Setting("anchor", anchor=float(c)) for c in anchors] if "anchor" in modes else []
    )


@dataclass
class ModeTrace:
    """One echoed example under one trace (``float64[T-1]`` each, entry t about token t + 1):
    the served aggregate's log-prob of the actual token, the mean/std of ``log r(z)``, z ~ r
    (Min-K%++), whether its greedy token is the actual one, its charge and t_x; the same three
    for the floored base (what a fallback position serves)."""

    logprobs: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray
    correct: np.ndarray
    cost: np.ndarray
    t_x: np.ndarray
    base_logprobs: np.ndarray
    base_mu: np.ndarray
    base_sigma: np.ndarray
    base_correct: np.ndarray


def mode_echo_traces(
    lm: Any,
    seqs: Sequence[Sequence[int]],
    *,
    anchor: float | None = None,
    reveal: int = 0,
    batch_size: int = 16,
) -> list[ModeTrace]:
    """Each sequence as one echo (every position a fresh request, its token and ``reveal``
    alternatives shown) by ``lm`` (a ``ProtectedLM``), anchored at ``anchor``. The base's
    columns need a variant-'b' method (its base model); for any other they are NaN."""
    out: list[ModeTrace | None] = [None] * len(seqs)
    pid = pad_token_id(lm.tokenizer)
    has_base = getattr(lm, "variant", None) == "b"
    if anchor is not None and not has_base:
        raise ValueError(f"{getattr(lm, 'name', lm)} has no base model to anchor to (variant 'b')")
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for s in range(0, len(order), max(1, batch_size)):
        idx = order[s : s + batch_size]
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        k = int(lm.num_constituents)  # + the aggregate and the base: distributions per row
        rows = max(1, FULL_CHUNK_ELEMENTS // max(1, ids.shape[1] * lm.vocab_size * (k + 2)))
        for c in range(0, len(idx), rows):
            i_, m_ = ids[c : c + rows], mask[c : c + rows]
            res = lm.score(
                i_, m_, prompt_lengths=m_.sum(-1).clamp_min(1), cost=True, t_x=True,
                greedy=True, full=True, components=has_base, base=has_base, anchor=anchor,
                top_logprobs=reveal,
            )  # fmt: skip
            mu, sd = (t.double().cpu() for t in token_moments(res.logprobs.float()))
            tgt = i_[:, 1:].to(res.greedy.device)
            hit = (res.greedy == tgt).cpu()
            if has_base:
                log_b = naf.normalize(res.components.base.float())
                b_mu, b_sd = (t.double().cpu() for t in token_moments(log_b))
                b_hit = (log_b.argmax(-1).to(tgt.device) == tgt).cpu()
                b_lp = res.base_token_logprobs
                del log_b
            else:  # no base model: the stop rule only
                b_lp = b_mu = b_sd = b_hit = torch.full_like(mu, float("nan"))
            cols = (res.token_logprobs, mu, sd, hit, res.cost, res.t_x, b_lp, b_mu, b_sd, b_hit)
            arrs = [t.double().cpu().numpy() for t in cols]
            del res
            for row, i in enumerate(idx[c : c + rows]):
                n = max(len(seqs[i]) - 1, 0)
                out[i] = ModeTrace(*(a[row, :n].copy() for a in arrs))
    return [t for t in out if t is not None]


def served_view(trace: ModeTrace, setting: Setting) -> tuple[np.ndarray, ...]:
    """What ``setting`` serves of one echoed example (its trace taken under the setting's
    anchor, if any): ``(logprobs, mu, sigma, correct, served)`` over the served positions
    (stop: the served prefix; fallback: every position, the private prefix then the base's),
    ``served`` the mask of served positions among all (a withheld one is not predicted)."""
    n = len(trace.cost)
    cost, tx = torch.as_tensor(trace.cost), torch.as_tensor(trace.t_x)
    if setting.mode == "stop":
        k = int(bounds.within_budget(cost, setting.budget).sum()) if n else 0
        sl = slice(0, k)
        served = np.arange(n) < k
        return trace.logprobs[sl], trace.mu[sl], trace.sigma[sl], trace.correct[sl], served
    if setting.mode == "fallback":
        priv = bounds.private_prefix(cost, tx, setting.budget).numpy() if n else np.ones(0, bool)
        cols = [
            np.where(priv, a, b)
            for a, b in (
                (trace.logprobs, trace.base_logprobs),
                (trace.mu, trace.base_mu),
                (trace.sigma, trace.base_sigma),
                (trace.correct, trace.base_correct),
            )
        ]
        return (*cols, np.ones(n, bool))
    return trace.logprobs, trace.mu, trace.sigma, trace.correct, np.ones(n, bool)


def _mia(
    method: str,
    target: Sequence[ModeTrace],
    texts: Sequence[str],
    n_mem: int,
    refs: dict[str, list[np.ndarray]],
    setting: Setting,
    *,
    corpus: str | None,
    seed: int,
) -> list[ResultRow]:
    """Every test of the suite on what ``setting`` serves of each example."""
    scores = MIAScores(method)
    means: dict[str, list[tuple[float, float]]] = {a: [] for a in refs}
    for i, t in enumerate(target):
        lp, mu, sd, _, served = served_view(t, setting)
        member = i < n_mem
        if lp.size == 0:  # nothing served: no evidence, every test scores 0
            for a in (*REFERENCE_FREE, *refs):
                scores.add(a, member=member, score=0.0)
            for a in refs:
                means[a].append((0.0, 0.0))
            continue
        for a, v in scores_from_stats(ExampleStats(lp, mu, sd, texts[i])).items():
            scores.add(a, member=member, score=v)
        for a, ref in refs.items():
            r = ref[i][: len(served)][served]
            scores.add(a, member=member, score=ratio_score(lp, r))
            means[a].append((float(np.mean(lp)), float(np.mean(r))))
    via = "lira" if "lira" in refs else "ref" if "ref" in refs else None
    extra = {"rmia": {"reference": "p0" if via == "lira" else "base"}} if via else None
    if via is not None and len(target) - n_mem > 1:
        lr = log_ratio([m[0] for m in means[via]], [m[1] for m in means[via]])
        non = np.arange(n_mem, len(target))
        same = np.arange(len(target))[:, None] == non[None, :]
        for i, s in enumerate(rmia_scores(lr, lr[non], same=same)):
            scores.add("rmia", member=i < n_mem, score=float(s))
    rows = mia_rows(scores, corpus=corpus, seed=seed, extra=setting.extra(), attack_extra=extra)
    return [
        ResultRow(
            r.method, "budget", f"{r.attack}_{r.metric}", r.value, r.n, r.std, r.corpus, r.extra
        )
        for r in rows
    ]


def _hits(trace: ModeTrace, setting: Setting) -> np.ndarray:
    """Per position of an echo: served and its greedy token the actual one."""
    _, _, _, correct, served = served_view(trace, setting)
    out = np.zeros(len(served), bool)
    out[: len(correct)] = correct.astype(bool)
    return out & served


def serving_kwargs(setting: Setting) -> dict[str, Any]:
    """The ``generate`` arguments that serve ``setting`` (``budget``, ``anchor``, ``on_budget``)."""
    kw: dict[str, Any] = {"budget": setting.budget, "anchor": setting.anchor}
    if setting.mode != "anchor":
        kw["on_budget"] = "base" if setting.mode == "fallback" else "stop"
    return kw


def setting_row(
    method: str, metric: str, values: np.ndarray, setting: Setting, **kw: Any
) -> ResultRow:
    """One row of a setting: ``values``' mean with its bootstrap interval, ``setting``'s keys."""
    est = bootstrap_ci(values, seed=kw.pop("seed", 0))
    return ResultRow(
        method, "budget", metric, est.value, est.n,
        float(np.std(values, ddof=1)) if values.size > 1 else 0.0, kw.pop("corpus", None),
        {**setting.extra(), "ci_low": est.ci_low, "ci_high": est.ci_high, **kw},
    )  # fmt: skip


def mode_rows(
    method: str,
    setting: Setting,
    *,
    utility: Sequence[ModeTrace] = (),
    answers: Sequence[Any] = (),
    mia_target: Sequence[ModeTrace] = (),
    mia_texts: Sequence[str] = (),
    mia_members: int = 0,
    mia_refs: dict[str, list[np.ndarray]] | None = None,
    corpus: str | None = None,
    seed: int = 0,
) -> list[ResultRow]:
    """One setting's rows: ``accuracy``, ``tokens_per_answer``, ``private_fraction`` (of the
    answers' tokens) and every membership test's ``<test>_<auc|tpr@…>``. ``utility`` /
    ``mia_target``: traces taken under the setting's anchor; ``answers``: the setting's greedy
    answers (``Generation``)."""
    kw: dict[str, Any] = {"corpus": corpus, "seed": seed}
    out: list[ResultRow] = []
    if utility:
        per_pos = np.concatenate([_hits(t, setting) for t in utility]).astype(float)
        out.append(setting_row(method, "accuracy", per_pos, setting, **kw, examples=len(utility)))
    if answers:
        n = np.array([len(g.token_ids) for g in answers], float)
        out.append(setting_row(method, "tokens_per_answer", n, setting, **kw))
        priv = [
            len(g.token_ids) if g.fallback_at is None else g.fallback_at
            for g in answers
            if g.token_ids
        ]
        per_tok = np.concatenate(
            [np.arange(len(g.token_ids)) < p for g, p in
             zip([g for g in answers if g.token_ids], priv, strict=True)] or [np.zeros(0)]
        ).astype(float)  # fmt: skip
        if per_tok.size:
            out.append(setting_row(method, "private_fraction", per_tok, setting, **kw))
    if mia_target and mia_refs is not None:
        out += _mia(method, mia_target, mia_texts, mia_members, mia_refs, setting,
                    corpus=corpus, seed=seed)  # fmt: skip
    return out


def sweep_modes(
    lm: Any,
    *,
    method: str,
    options: Any,
    validation: Sequence[Sequence[int]] = (),
    prompts: Sequence[Sequence[int]] = (),
    members: Sequence[Sequence[int]] = (),
    nonmembers: Sequence[Sequence[int]] = (),
    refs: dict[str, list[np.ndarray]] | None = None,
    corpus: str | None = None,
) -> list[ResultRow]:
    """Every setting of ``options`` (a :class:`scpdr.attacks.budget.BudgetOptions`: ``modes``,
    ``budgets``, ``anchors``) on one method (fallback and anchor: variant 'b' only, the stop rule
    alone for any other): one echo trace per anchor (None: the
    unbudgeted trace stop and fallback are read off), one set of greedy answers per setting.
    ``refs``: each ratio test's reference log-probs of ``members + nonmembers``."""
    grid = settings(options.modes, options.budgets, options.anchors)
    if getattr(lm, "variant", None) != "b":  # fallback and anchor serve from a base model
        grid = [s for s in grid if s.mode == "stop"]
    bs, seed = options.batch_size, options.seed
    seqs = [*members, *nonmembers]
    texts = [lm.tokenizer.decode(list(s[1:])) for s in seqs]
    out: list[ResultRow] = []
    for radius in dict.fromkeys(s.anchor for s in grid):
        util = mode_echo_traces(lm, validation, anchor=radius, reveal=1, batch_size=bs)
        target = (
            mode_echo_traces(lm, seqs, anchor=radius, batch_size=bs)
            if refs and members and nonmembers
            else []
        )
        for st in (s for s in grid if s.anchor == radius):
            kw = serving_kwargs(st)
            answers = []
            for s in range(0, len(prompts), max(1, bs)):
                answers += lm.generate(
                    [list(p) for p in prompts[s : s + bs]],
                    max_new_tokens=options.answer_tokens,
                    temperature=0.0,
                    **kw,
                )
            out += mode_rows(
                method, st, utility=util, answers=answers, mia_target=target, mia_texts=texts,
                mia_members=len(members), mia_refs=refs, corpus=corpus, seed=seed,
            )  # fmt: skip
    return out
