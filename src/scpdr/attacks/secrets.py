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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scpdr.attacks.results import ResultRow
from scpdr.attacks.scorer import Scorer, encode, scorer_name
from scpdr.attacks.stats import bootstrap_ci

__all__ = ["SECRETS_ATTACK", "SecretTarget", "SecretsResult", "secret_extraction", "secret_targets"]

log = logging.getLogger(__name__)

#: The attack's name in result rows.
SECRETS_ATTACK = "secrets"


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
    (filled by the evaluation pipeline when the bundle has a base model)."""

    targets: list[SecretTarget]
    extracted: np.ndarray
    whole: np.ndarray
    texts: list[str]
    method: str = "scorer"
    ref: dict[str, float] = field(default_factory=dict)

    def rows(
        self, *, method: str | None = None, corpus: str | None = None, seed: int = 0
    ) -> list[ResultRow]:
        """Rows ``extracted`` (mean fraction) and ``fer`` (fraction whole), each with its
        bootstrap ``ci_low``/``ci_high`` and ``n`` = the number of secrets."""
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
        return out

    def per_record(self) -> dict[str, dict[str, Any]]:
        """``{record id: {partition, extracted, whole, secrets, secrets_whole}}``: a record is
        as exposed as its most exposed secret (``extracted`` its largest fraction, ``whole`` any
        secret whole)."""
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
