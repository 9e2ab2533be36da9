"""Secret extraction on the user's own data: do *your* declared secrets come out?

For every declared secret of a training record (:attr:`Record.secrets
<scpdr.data.records.Record.secrets>`, :mod:`scpdr.data.secrets`) the adversary sends the record's
text up to the secret as a fresh prompt (the TDE game, paper Def. 4.1: a query that starts a new
conversation), decodes greedily, and compares the continuation with the secret:

- **extracted**: the fraction of the secret's characters reproduced, counted from its start up
  to the first wrong character (the PII attack's AEL, §5.3, as a fraction of the secret's
  length, so secrets of any length average);
- **fer**: whether the whole secret came out (full extraction rate).

Whitespace between the prefix and the secret is left to the model (a prompt ending in a space
tokenizes unlike the training text), and the continuation's leading whitespace is ignored.
Result rows carry bootstrap 95% CIs (:func:`scpdr.attacks.stats.bootstrap_ci`); run on the
validation records' secrets (never trained on) they are the No CP-val baseline.

**The per-record chance level** (:func:`counterfactual_extraction`): the same query, decoded the
same way, sent to the constituent(s) trained without the record's partition (evaluation only,
never served; with K > 2 the most any of them reproduces). A secret that such a model produces
too is *guessable* (derived from the name before it, a common format, public knowledge); one
that a method produces whole and the counterfactual does not came out because it was memorized.
With a counterfactual attached (:attr:`SecretsResult.counterfactual`) the rows add ``guessable``,
``memorized`` and the paired tests ``fer_vs_counterfactual`` (McNemar's exact test) and
``extracted_vs_counterfactual`` (paired bootstrap) on the same secrets
(:mod:`scpdr.attacks.paired`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scpdr.attacks.paired import mcnemar_exact, paired_bootstrap
from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, encode, scorer_name
from scpdr.attacks.stats import bootstrap_ci

__all__ = [
    "COUNTERFACTUAL_METRICS",
    "SECRETS_ATTACK",
    "SecretTarget",
    "SecretsResult",
    "counterfactual_extraction",
    "secret_extraction",
    "secret_targets",
]

log = logging.getLogger(__name__)

#: The attack's name in result rows.
SECRETS_ATTACK = "secrets"
#: The rows a counterfactual adds: the share of secrets it produces whole (``guessable``), the
#: share a method produces whole and it does not (``memorized``), and the paired tests of the
#: method against it (whole secrets: McNemar exact; extracted fraction: paired bootstrap).
COUNTERFACTUAL_METRICS: tuple[str, ...] = (
    "guessable",
    "memorized",
    "fer_vs_counterfactual",
    "extracted_vs_counterfactual",
)


@dataclass(frozen=True)
class SecretTarget:
    """One secret of one record: ``prompt`` is the record's text before the secret (trailing
    whitespace moved to ``lead``); ``index`` its position among the record's secrets."""

    record: str
    index: int
    prompt: str
    lead: str
    secret: str
    text: str
    partition: int | None = None


def secret_targets(records: Sequence[Any], *, partition: int | None = None) -> list[SecretTarget]:
    """The secret targets of ``records`` (first occurrence of each declared secret). A secret at
    the very start of its record has no prefix to query with and is skipped (logged)."""
    out, skipped = [], 0
    for r in records:
        for j, s in enumerate(getattr(r, "secrets", ()) or ()):
            pos = r.text.find(s)
            prompt = r.text[:pos].rstrip()
            if pos < 0 or not prompt:
                skipped += 1
                continue
            lead = r.text[len(prompt) : pos]
            out.append(SecretTarget(r.id, j, prompt, lead, s, r.text, partition))
    if skipped:
        log.info("secrets: %d secrets start their record (no prefix to query), skipped", skipped)
    return out


@dataclass
class SecretsResult:
    """Per target: ``extracted`` (fraction of characters, ``float[N]``), ``whole`` (``bool[N]``)
    and the generated ``texts``; ``ref`` maps record ids to the ``ref`` MIA score of the record
    (filled by the evaluation pipeline when the bundle has a base model); ``counterfactual`` the
    same targets under the constituent(s) that never saw them (:func:`counterfactual_extraction`),
    when measured."""

    targets: list[SecretTarget]
    extracted: np.ndarray
    whole: np.ndarray
    texts: list[str]
    method: str = "scorer"
    ref: dict[str, float] = field(default_factory=dict)
    counterfactual: SecretsResult | None = None

    def memorized(self) -> np.ndarray:
        """``bool[N]``: secrets that came out whole here and not from the counterfactual (all
        whole ones when no counterfactual was measured)."""
        if self.counterfactual is None:
            return self.whole.astype(bool)
        return self.whole.astype(bool) & ~self.counterfactual.whole.astype(bool)

    def rows(
        self, *, method: str | None = None, corpus: str | None = None, seed: int = 0
    ) -> list[ResultRow]:
        """Rows ``extracted`` (mean fraction) and ``fer`` (fraction whole), each with its
        bootstrap ``ci_low``/``ci_high`` and ``n`` = the number of secrets; with a
        counterfactual also :data:`COUNTERFACTUAL_METRICS`."""
        method = method or self.method
        records = len({t.record for t in self.targets})
        out = []
        for metric, vals in (("extracted", self.extracted), ("fer", self.whole.astype(float))):
            est = bootstrap_ci(vals, seed=seed)
            std = float(np.std(vals, ddof=1)) if vals.size > 1 else 0.0
            extra = {"ci_low": est.ci_low, "ci_high": est.ci_high, "records": records}
            out.append(
                ResultRow(method, SECRETS_ATTACK, metric, est.value, est.n, std, corpus, extra)
            )
        if self.counterfactual is not None:
            out += self._paired_rows(method, corpus, seed, records)
        return out

    def _paired_rows(
        self, method: str, corpus: str | None, seed: int, records: int
    ) -> list[ResultRow]:
        cf = self.counterfactual
        assert cf is not None
        if len(cf.targets) != len(self.targets):
            raise ValueError(
                f"the counterfactual measured {len(cf.targets)} secrets, the method "
                f"{len(self.targets)}: run both on the same targets"
            )
        out = []

        def whose(mask: np.ndarray) -> int:
            return len({t.record for t, x in zip(self.targets, mask, strict=True) if x})

        shares = (("guessable", cf.whole.astype(bool)), ("memorized", self.memorized()))
        for metric, mask in shares:
            est = bootstrap_ci(mask.astype(float), seed=seed)
            extra = {
                "ci_low": est.ci_low,
                "ci_high": est.ci_high,
                "records": records,
                "count": int(mask.sum()),
                "records_with": whose(mask),
            }
            out.append(
                ResultRow(method, SECRETS_ATTACK, metric, est.value, est.n, 0.0, corpus, extra)
            )
        tests = (
            ("fer_vs_counterfactual", mcnemar_exact(self.whole, cf.whole)),
            (
                "extracted_vs_counterfactual",
                paired_bootstrap(self.extracted, cf.extracted, seed=seed),
            ),
        )
        for metric, t in tests:
            extra = {**t.extra(), "records": records}
            out.append(
                ResultRow(method, SECRETS_ATTACK, metric, t.difference, t.n, 0.0, corpus, extra)
            )
        return out

    def per_record(self) -> dict[str, dict[str, Any]]:
        """``{record id: {partition, extracted, whole, secrets, secrets_whole}}``: a record is
        as exposed as its most exposed secret (``extracted`` its largest fraction, ``whole`` any
        secret whole); with a counterfactual also ``counterfactual_extracted``,
        ``counterfactual_whole`` (the same under the counterfactual) and ``memorized`` (secrets
        whole here and not from the counterfactual)."""
        out: dict[str, dict[str, Any]] = {}
        for t, x, w in zip(self.targets, self.extracted, self.whole, strict=True):
            d = out.setdefault(
                t.record,
                {"partition": t.partition, "extracted": 0.0, "whole": False, "secrets": 0},
            )
            d["extracted"] = max(d["extracted"], float(x))
            d["whole"] = d["whole"] or bool(w)
            d["secrets"] += 1
            d["secrets_whole"] = d.get("secrets_whole", 0) + int(bool(w))
        cf = self.counterfactual
        if cf is not None:
            mem = self.memorized()
            for t, x, w, k in zip(self.targets, cf.extracted, cf.whole, mem, strict=True):
                d = out[t.record]
                d["counterfactual_extracted"] = max(
                    d.get("counterfactual_extracted", 0.0), float(x)
                )
                d["counterfactual_whole"] = d.get("counterfactual_whole", False) or bool(w)
                d["memorized"] = d.get("memorized", 0) + int(bool(k))
        return out


def _reproduced(generated: str, target: SecretTarget) -> int:
    """Leading characters of the secret that ``generated`` reproduces (the continuation's
    leading whitespace ignored when whitespace preceded the secret in the record)."""
    text = generated.lstrip() if target.lead else generated
    n = 0
    for a, b in zip(text, target.secret, strict=False):
        if a != b:
            break
        n += 1
    return n


def secret_extraction(
    scorer: Scorer,
    targets: Sequence[SecretTarget],
    *,
    batch_size: int = 16,
    extra_tokens: int = 2,
) -> SecretsResult:
    """Query every target's prompt once and decode greedily: as many new tokens as the secret
    (with its lead) takes plus ``extra_tokens``; see the module docstring for the metrics."""
    tok = scorer.tokenizer
    targets = list(targets)
    budgets = [
        len(encode(tok, t.lead + t.secret, add_special_tokens=False)) + extra_tokens
        for t in targets
    ]
    prompts = [encode(tok, t.prompt) for t in targets]
    texts = [""] * len(targets)
    order = sorted(range(len(targets)), key=lambda i: (budgets[i], len(prompts[i])))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        gens = scorer.generate(
            [prompts[i] for i in idx],
            max_new_tokens=max(budgets[i] for i in idx),
            temperature=0.0,
        )
        for i, g in zip(idx, gens, strict=True):
            texts[i] = g.text
        log.debug("secrets: %d of %d queried", min(start + batch_size, len(order)), len(order))
    chars = np.array([_reproduced(s, t) for s, t in zip(texts, targets, strict=True)])
    lengths = np.array([len(t.secret) for t in targets])
    extracted = chars / np.maximum(lengths, 1) if targets else np.zeros(0)
    whole = chars == lengths if targets else np.zeros(0, dtype=bool)
    return SecretsResult(
        targets, extracted.astype(float), whole.astype(bool), texts, scorer_name(scorer)
    )


def counterfactual_extraction(
    unseen: Callable[[int | None], Sequence[Scorer]] | Sequence[Scorer],
    targets: Sequence[SecretTarget],
    *,
    batch_size: int = 16,
    extra_tokens: int = 2,
) -> SecretsResult:
    """The per-record chance level: :func:`secret_extraction` of every target (same prompt, same
    greedy decoding) from the models that never saw its record — ``unseen(partition)`` for the
    target's partition (a bundle: the constituents of the other partitions), or the same
    scorers for every target. With several such models a target gets the most any of them
    reproduces (``extracted`` the largest fraction, ``whole`` any whole). Raises ``ValueError``
    when a target's partition has no such model (a one-constituent bundle)."""
    targets = list(targets)
    n = len(targets)
    extracted, whole, texts = np.zeros(n), np.zeros(n, dtype=bool), [""] * n
    groups: dict[int | None, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t.partition, []).append(i)
    for part, idx in groups.items():
        scorers = list(unseen(part) if callable(unseen) else unseen)
        if not scorers:
            raise ValueError(
                f"no model was trained without partition {part}: the counterfactual needs a "
                "bundle of at least two constituents"
            )
        sub = [targets[i] for i in idx]
        for sc in scorers:
            res = secret_extraction(sc, sub, batch_size=batch_size, extra_tokens=extra_tokens)
            for j, i in enumerate(idx):
                if res.extracted[j] > extracted[i] or (res.whole[j] and not whole[i]):
                    texts[i] = res.texts[j]
                extracted[i] = max(extracted[i], float(res.extracted[j]))
                whole[i] = whole[i] or bool(res.whole[j])
    return SecretsResult(targets, extracted, whole, texts, "counterfactual")
