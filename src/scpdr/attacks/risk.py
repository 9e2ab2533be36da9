"""The per-record risk report: which of *your* records are at risk, and what protection does.

One line per secret-bearing training record and method (``risk.jsonl`` beside ``results.json``,
``scpdr eval``): the record's id and partition, how much of its most exposed secret came out
(``extracted``, a fraction of its characters), whether any secret came out whole, how many
secrets it has, and the record's ``ref`` membership score — the MIA suite's log-likelihood ratio
of the record's text under the method vs the bundle's base model
(:func:`scpdr.attacks.mia.ratio_score`; higher = the method knows the record better than the
base model does, the statistic the certificates t_x / v_x bound, paper Thm 4.4/4.5).

Records are sorted most at risk under No CP first (the undefended model: ``extracted``, then
``whole``, then ``ref``), so the first lines show both what the data owner risks and what the
protected method does to the same record.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scpdr import methods as M
from scpdr.attacks.examples import cached_token_logprobs
from scpdr.attacks.mia import ratio_score
from scpdr.attacks.scorer import Scorer, batched_token_logprobs, encode
from scpdr.attacks.secrets import SecretsResult

__all__ = ["NO_CP", "RISK_FILE", "record_ref_scores", "risk_lines", "save_risk"]

#: The risk report's file name (beside ``results.json``).
RISK_FILE = "risk.jsonl"
#: The undefended row (No CP: constituent 0 served alone) the records are sorted by.
NO_CP = next(n for n, s in M.SPECS.items() if s.rule == "none" and s.kind == "aggregate")


def _method_order(names: Sequence[str]) -> list[str]:
    rank = {n: i for i, n in enumerate(M.METHOD_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def record_ref_scores(
    scorer: Scorer,
    base: Scorer,
    texts: Mapping[str, str],
    *,
    batch_size: int = 16,
    max_tokens: int | None = 256,
    cache: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``{record id: ref score}`` of each text (``max_tokens`` first tokens; texts of fewer than
    two tokens have no score). ``cache`` keeps the base model's log-probs across methods."""
    tok = scorer.tokenizer
    ids = list(texts)
    seqs = [encode(tok, texts[i])[:max_tokens] for i in ids]
    keep = [j for j, s in enumerate(seqs) if len(s) >= 2]
    seqs = [seqs[j] for j in keep]
    if not seqs:
        return {}
    target = batched_token_logprobs(scorer, seqs, batch_size=batch_size)
    reference = cached_token_logprobs(base, seqs, batch_size=batch_size, cache=cache)
    return {
        ids[j]: ratio_score(t.numpy(), r.numpy())
        for j, t, r in zip(keep, target, reference, strict=True)
    }


def _risk_key(d: Mapping[str, Any] | None) -> tuple[float, int, float]:
    if d is None:
        return (0.0, 0, -math.inf)
    ref = d.get("ref")
    return (d["extracted"], int(d["whole"]), ref if ref is not None else -math.inf)


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def risk_lines(results: Mapping[str, SecretsResult]) -> list[dict[str, Any]]:
    """The risk report's lines from each method's :class:`SecretsResult` (with its ``ref``
    scores): one per record and method, records sorted by their risk under No CP (the first
    method when No CP was not run), methods in :data:`scpdr.methods.METHOD_ORDER`; ``rank`` is
    the record's place (1 = most at risk)."""
    if not results:
        return []
    order = _method_order(list(results))
    per = {m: results[m].per_record() for m in order}
    for m in order:
        for rid, d in per[m].items():
            d["ref"] = results[m].ref.get(rid)
    lead = NO_CP if NO_CP in per else order[0]
    records = list(dict.fromkeys(rid for m in order for rid in per[m]))
    records.sort(key=lambda rid: _risk_key(per[lead].get(rid)), reverse=True)
    lines = []
    for rank, rid in enumerate(records, start=1):
        for m in order:
            d = per[m].get(rid)
            if d is None:
                continue
            lines.append(
                {
                    "rank": rank,
                    "record": rid,
                    "partition": d["partition"],
                    "method": m,
                    "extracted": round(d["extracted"], 4),
                    "whole": d["whole"],
                    "secrets": d["secrets"],
                    "secrets_whole": d["secrets_whole"],
                    "ref": None if d["ref"] is None else round(d["ref"], 4),
                    "counterfactual_extracted": _rounded(d.get("counterfactual_extracted")),
                    "counterfactual_whole": d.get("counterfactual_whole"),
                    "memorized": d.get("memorized"),
                }
            )
    return lines


def save_risk(path: str | os.PathLike[str], lines: Sequence[Mapping[str, Any]]) -> Path:
    """Write the risk lines as JSONL (atomically)."""
    import json

    from scpdr.io import atomic_write

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(dict(line), ensure_ascii=False) + "\n")

    return atomic_write(path, write)
