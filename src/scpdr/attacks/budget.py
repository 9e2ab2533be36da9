"""Attacks under an extraction budget (``docs/accountant.md``, "Budgets and attacks").

**Each example is one response held to B**: the attacker sends the example once and sees only the
positions the budget serves — those before the first one whose charge
(:func:`scpdr.bounds.token_cost`) would take the response's running sum past B
(:func:`scpdr.bounds.within_budget`, the runtime's rule). The charges along a response do not
depend on B, so each attack runs once per method (unbudgeted, recording every position's charge:
a *trace*) and every budget of the sweep is read off the traces by truncation:

- **PII extraction** (AEL, FER): each record's greedy answer to its prompt (``generate``, one
  response), the ID's leading characters among the served tokens;
- **membership inference** (``ref`` against the base model, ``lira`` against the method's
  reference, :mod:`scpdr.attacks.mia`): each example one echo of its text (every position a fresh
  request, the token's log-prob revealed); the score is the log-likelihood ratio over the served
  positions, the reference's side over the same positions (an empty prefix scores 0);
- **utility**: next-token accuracy over every validation position, a withheld position counting as
  not predicted (the echo reveals the token and the greedy one); **tokens per answer**: how many
  tokens a greedy answer to a validation prompt gets before the budget (or eos, or the length)
  stops it.

Rows: attack ``"budget"``, metric ``pii_ael``, ``pii_fer``, ``accuracy``, ``tokens_per_answer``,
``<ref|lira>_<auc|tpr@…>``, each with ``extra["budget"]`` (None: no budget) and a 95% bootstrap
interval (``ci_low``/``ci_high``, :mod:`scpdr.attacks.stats`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from scpdr import bounds
from scpdr.attacks.examples import example_ids
from scpdr.attacks.mia import MIAScores, mia_rows, ratio_score
from scpdr.attacks.pii import DEFAULT_PII_TEMPLATE, PIIRecord
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import batched_token_logprobs, encode, pad_batch, pad_token_id
from scpdr.attacks.stats import bootstrap_ci
from scpdr.errors import ConfigError

__all__ = [
    "BUDGET_ATTACK",
    "DEFAULT_BUDGETS",
    "BudgetOptions",
    "BudgetTraces",
    "EchoTrace",
    "answer_traces",
    "budget_rows",
    "budget_sweep",
    "echo_traces",
    "pii_traces",
    "served_counts",
]

#: The attack name of the rows.
BUDGET_ATTACK = "budget"
#: The issue's grid, in nats (None: no budget).
DEFAULT_BUDGETS: tuple[float | None, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, None)


@dataclass
class BudgetOptions:
    """Sizes of the sweep (``None`` = all examples). ``max_tokens`` truncates each echoed
    example; answers are greedy continuations of a validation text's first
    ``answer_prompt_tokens`` tokens, at most ``answer_tokens`` long."""

    budgets: tuple[float | None, ...] = DEFAULT_BUDGETS
    pii_n: int | None = None
    mia_n: int | None = None
    utility_n: int | None = 64
    answer_n: int | None = 32
    answer_prompt_tokens: int = 16
    answer_tokens: int = 32
    max_tokens: int | None = 128
    pii_template: str = DEFAULT_PII_TEMPLATE
    pii_extra_steps: int = 2
    batch_size: int = 16
    seed: int = 0
    #: serving modes (:data:`scpdr.attacks.budget_modes.MODES`); fallback and anchor need a
    #: variant-'b' method (its base model) and are skipped for any other
    modes: tuple[str, ...] = ("stop",)
    #: the anchored mode's radii c, nats per token
    anchors: tuple[float, ...] = ()
    #: every membership test of the suite for the stop rule alone too (``scpdr eval --budgets``);
    #: without it the stop rule alone keeps the sweep's ref / lira rows
    all_tests: bool = False


def served_counts(costs: Sequence[Sequence[float]], budget: float | None) -> np.ndarray:
    """How many leading positions of each response a budget serves (``int[N]``), by
    :func:`scpdr.bounds.within_budget` on each row."""
    if not costs:
        return np.zeros(0, dtype=np.int64)
    width = max(1, max(len(c) for c in costs))
    pad = torch.full((len(costs), width), math.inf, dtype=torch.float64)
    for i, c in enumerate(costs):
        pad[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.float64)
    served = bounds.within_budget(pad, budget).sum(-1).numpy().astype(np.int64)
    return np.minimum(served, [len(c) for c in costs])  # the padding is no position


# ------------------------------------------------------------------------------------ traces


@dataclass
class EchoTrace:
    """One echoed example: per predicted position (``float[T-1]``) the log-prob of the actual
    token, its charge, and whether the greedy token was the actual one."""

    logprobs: np.ndarray
    cost: np.ndarray
    correct: np.ndarray


def _batches(seqs: Sequence[Sequence[int]], size: int) -> Iterator[list[int]]:
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for s in range(0, len(order), max(1, size)):
        yield order[s : s + size]


def echo_traces(
    lm: Any, seqs: Sequence[Sequence[int]], *, reveal: int = 0, batch_size: int = 16
) -> list[EchoTrace]:
    """Each sequence as one echo request (every position a fresh request, its token revealed and
    ``reveal`` alternatives: 1 = the greedy token) scored by ``lm`` (a ``ProtectedLM``)."""
    out: list[EchoTrace | None] = [None] * len(seqs)
    pid = pad_token_id(lm.tokenizer)
    for idx in _batches(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], pad_id=pid, side="right")
        res = lm.score(
            ids,
            mask,
            prompt_lengths=mask.sum(-1).clamp_min(1),
            cost=True,
            greedy=True,
            top_logprobs=reveal,
        )
        lp, cost = res.token_logprobs.float().cpu(), res.cost.double().cpu()
        hit = (res.greedy == ids[:, 1:].to(res.greedy.device)).cpu()
        for row, i in enumerate(idx):
            n = max(len(seqs[i]) - 1, 0)
            out[i] = EchoTrace(lp[row, :n].numpy(), cost[row, :n].numpy(), hit[row, :n].numpy())
    return [t for t in out if t is not None]


def answer_traces(
    lm: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int = 16
) -> list[list[float]]:
    """The charges of each prompt's greedy answer (one response each; ends at eos or length)."""
    out: list[list[float]] = []
    for s in range(0, len(prompts), max(1, batch_size)):
        gens = lm.generate(
            [list(p) for p in prompts[s : s + batch_size]],
            max_new_tokens=max_new_tokens,
            temperature=0.0,
        )
        out += [list(g.cost) for g in gens]
    return out


@dataclass
class PIITrace:
    """One record's greedy answer: its tokens and their charges."""

    record: PIIRecord
    tokens: list[int]
    cost: list[float]


def pii_traces(
    lm: Any,
    records: Sequence[PIIRecord],
    *,
    template: str = DEFAULT_PII_TEMPLATE,
    lead: str = " ",
    extra_steps: int = 2,
    batch_size: int = 16,
    **serving: Any,
) -> list[PIITrace]:
    """Each record's greedy answer to its prompt, as long as the PII attack's
    (:func:`scpdr.attacks.pii.pii_extraction`: the ID's tokens plus ``extra_steps``);
    ``serving``: the serving mode's ``generate`` arguments (``budget``, ``on_budget``,
    ``anchor``; none: the unbudgeted trace the stop rule is read off)."""
    tok = lm.tokenizer
    prompts = [encode(tok, template.format(name=r.name)) for r in records]
    steps = [
        max(len(encode(tok, template.format(name=r.name) + lead + r.id)) - len(p), 1) + extra_steps
        for r, p in zip(records, prompts, strict=True)
    ]
    out: list[PIITrace] = []
    for s in range(0, len(records), max(1, batch_size)):
        sl = slice(s, s + batch_size)
        gens = lm.generate(prompts[sl], max_new_tokens=steps[sl], temperature=0.0, **serving)
        out += [
            PIITrace(r, list(g.token_ids), list(g.cost))
            for r, g in zip(records[sl], gens, strict=True)
        ]
    return out


def extracted_chars(tok: Any, trace: PIITrace, n: int) -> int:
    """Leading ID characters among the first ``n`` tokens (decoded as the PII attack does)."""
    text = tok.decode(trace.tokens[:n]).lstrip()
    target = trace.record.id
    return next(
        (i for i, (a, b) in enumerate(zip(text, target, strict=False)) if a != b),
        min(len(text), len(target)),
    )


@dataclass
class BudgetTraces:
    """Everything one method's sweep needs, each budget read off by truncation."""

    method: str
    pii: list[PIITrace] = field(default_factory=list)
    utility: list[EchoTrace] = field(default_factory=list)
    answers: list[list[float]] = field(default_factory=list)
    mia_target: list[EchoTrace] = field(default_factory=list)
    mia_members: int = 0
    mia_refs: dict[str, list[np.ndarray]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ rows


def _row(method: str, metric: str, values: np.ndarray, budget: float | None, **kw: Any) -> Any:
    est = bootstrap_ci(values, seed=kw.pop("seed", 0))
    return ResultRow(
        method,
        BUDGET_ATTACK,
        metric,
        est.value,
        est.n,
        float(np.std(values, ddof=1)) if values.size > 1 else 0.0,
        kw.pop("corpus", None),
        {"budget": budget, "ci_low": est.ci_low, "ci_high": est.ci_high, **kw},
    )


def budget_rows(
    traces: BudgetTraces,
    budgets: Sequence[float | None],
    *,
    tokenizer: Any = None,
    corpus: str | None = None,
    seed: int = 0,
) -> list[ResultRow]:
    """The sweep's rows: every metric of ``traces`` at every budget."""
    m, out = traces.method, []
    for b in budgets:
        kw: dict[str, Any] = {"corpus": corpus, "seed": seed}
        if traces.pii:
            n = served_counts([t.cost for t in traces.pii], b)
            ext = np.array(
                [extracted_chars(tokenizer, t, k) for t, k in zip(traces.pii, n, strict=True)],
                float,
            )
            full = np.array(
                [e == len(t.record.id) for e, t in zip(ext, traces.pii, strict=True)], float
            )
            out += [_row(m, "pii_ael", ext, b, **kw), _row(m, "pii_fer", full, b, **kw)]
        if traces.utility:
            n = served_counts([t.cost for t in traces.utility], b)
            per_pos = np.concatenate(  # every position: 1 = served and predicted right
                [
                    np.where(np.arange(len(t.correct)) < k, t.correct, False)
                    for t, k in zip(traces.utility, n, strict=True)
                ]
            ).astype(float)
            out.append(_row(m, "accuracy", per_pos, b, **kw, examples=len(traces.utility)))
        if traces.answers:
            n = served_counts(traces.answers, b).astype(float)
            out.append(_row(m, "tokens_per_answer", n, b, **kw))
        if traces.mia_target and traces.mia_refs:
            out += _mia_rows(traces, b, corpus=corpus, seed=seed)
    return out


def _mia_rows(
    traces: BudgetTraces, budget: float | None, *, corpus: str | None, seed: int
) -> list[ResultRow]:
    n = served_counts([t.cost for t in traces.mia_target], budget)
    scores = MIAScores(traces.method)
    for attack, ref in traces.mia_refs.items():
        for i, (t, r, k) in enumerate(zip(traces.mia_target, ref, n, strict=True)):
            score = ratio_score(t.logprobs[:k], r[:k]) if k else 0.0  # nothing served: no evidence
            scores.add(attack, member=i < traces.mia_members, score=score)
    served = float(np.mean(n)) if n.size else 0.0
    rows = mia_rows(scores, corpus=corpus, seed=seed, extra={"budget": budget, "served": served})
    return [
        ResultRow(
            r.method,
            BUDGET_ATTACK,
            f"{r.attack}_{r.metric}",
            r.value,
            r.n,
            r.std,
            r.corpus,
            r.extra,
        )
        for r in rows
    ]


# ------------------------------------------------------------------------------------ the sweep


def _ids(tok: Any, examples: Sequence[Any], max_tokens: int | None) -> list[list[int]]:
    """Each example's whole token sequence (a prompted example: prompt and response; every
    position is echoed and charged, :func:`echo_traces`); sequences under 2 tokens are dropped."""
    out = []
    for i, x in enumerate(examples):
        try:
            ids = example_ids(tok, x, max_tokens=max_tokens, label=f"example {i}")[0]
        except ConfigError:
            continue
        out.append(ids)
    return [s for s in out if len(s) >= 2]


def budget_sweep(
    lm: Any,
    *,
    method: str,
    pii: Sequence[PIIRecord] = (),
    validation: Sequence[Any] = (),
    members: Sequence[Any] = (),
    nonmembers: Sequence[Any] = (),
    references: dict[str, Any] | None = None,
    options: BudgetOptions | None = None,
    corpus: str | None = None,
) -> list[ResultRow]:
    """The budget sweep of one method (``lm``: its ``ProtectedLM``) on already drawn examples.

    ``references``: the membership attacks' reference scorers by attack name (``{"ref": the base
    model, "lira": the method's reference}``; the suite needs both members and non-members).
    """
    opts = options or BudgetOptions()
    tok, bs = lm.tokenizer, opts.batch_size
    # the serving modes' path scores utility and membership from its own traces: here only the
    # PII traces (the stop rule's) and the references' log-probs are needed for it
    modal = tuple(opts.modes) != ("stop",) or bool(opts.anchors) or opts.all_tests
    tr = BudgetTraces(method)
    if pii and (not modal or "stop" in opts.modes):
        tr.pii = pii_traces(
            lm, pii, template=opts.pii_template, extra_steps=opts.pii_extra_steps, batch_size=bs
        )
    val = _ids(tok, validation, opts.max_tokens)
    if val and not modal:
        tr.utility = echo_traces(lm, val, reveal=1, batch_size=bs)
        prompts = [s[: opts.answer_prompt_tokens] for s in val[: opts.answer_n]]
        tr.answers = answer_traces(lm, prompts, max_new_tokens=opts.answer_tokens, batch_size=bs)
    mem, non = _ids(tok, members, opts.max_tokens), _ids(tok, nonmembers, opts.max_tokens)
    refs = {a: r for a, r in (references or {}).items() if r is not None}
    if mem and non and refs:
        seqs = mem + non
        if not modal:
            tr.mia_target = echo_traces(lm, seqs, reveal=0, batch_size=bs)
            tr.mia_members = len(mem)
        for attack, ref in refs.items():
            lps = batched_token_logprobs(ref, seqs, batch_size=bs)
            tr.mia_refs[attack] = [t.double().numpy() for t in lps]
    rows = budget_rows(tr, opts.budgets, tokenizer=tok, corpus=corpus, seed=opts.seed)
    if not modal:
        return rows  # the stop rule with ref/lira only: the sweep before serving modes
    from scpdr.attacks.budget_modes import sweep_modes

    # the stop rule's PII rows (the only rows of budget_rows here: the traces above hold no more)
    keep = [r for r in rows if r.metric in ("pii_ael", "pii_fer")]
    for r in keep:
        r.extra["mode"] = "stop"
    prompts = [s[: opts.answer_prompt_tokens] for s in val[: opts.answer_n]]
    keep += sweep_modes(
        lm, method=method, options=opts, validation=val, prompts=prompts, members=mem,
        nonmembers=non, refs=tr.mia_refs, corpus=corpus,
    )  # fmt: skip
    return keep + _mode_pii_rows(lm, method, pii, opts, corpus=corpus)


def _mode_pii_rows(
    lm: Any, method: str, records: Sequence[PIIRecord], opts: BudgetOptions, *, corpus: str | None
) -> list[ResultRow]:
    """PII AEL / FER under every fallback and anchored setting of ``opts`` (variant 'b' only):
    each record's extraction generated under the setting, scored on every token it served."""
    from scpdr.attacks.budget_modes import serving_kwargs, setting_row, settings

    if not records or getattr(lm, "variant", None) != "b":
        return []
    out: list[ResultRow] = []
    for st in settings(opts.modes, opts.budgets, opts.anchors):
        if st.mode == "stop":
            continue
        traces = pii_traces(
            lm, records, template=opts.pii_template, extra_steps=opts.pii_extra_steps,
            batch_size=opts.batch_size, **serving_kwargs(st),
        )  # fmt: skip
        ext = np.array([extracted_chars(lm.tokenizer, t, len(t.tokens)) for t in traces], float)
        full = np.array([e == len(t.record.id) for e, t in zip(ext, traces, strict=True)], float)
        kw: dict[str, Any] = {"corpus": corpus, "seed": opts.seed}
        out += [
            setting_row(method, "pii_ael", ext, st, **kw),
            setting_row(method, "pii_fer", full, st, **kw),
        ]
    return out
