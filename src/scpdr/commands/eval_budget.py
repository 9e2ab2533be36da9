"""``scpdr eval BUNDLE --budgets 2,5,10 [--on-budget base] [--anchor .1,.5]``: the budget sweep on
the user's own bundle (the serving mode as an axis: docs/accountant.md, "Budgets and attacks")
and one recommendation line (:func:`scpdr.report.recommend.recommend`): the setting with the best
utility whose every membership test is within CI of chance, with the ``scpdr serve`` flags that
deploy it — or the plain statement that no setting of the grid reaches it.

The sweep runs on the data ``scpdr eval`` already drew (:class:`~scpdr.attacks.eval_data.EvalData`:
the target partition's records against the clean validation records), with the bundle's base model
as ``ref``'s reference and each method's LiRA reference (:mod:`scpdr.attacks.budget`); it adds
rows to the one ``results.json``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from scpdr.errors import ConfigError

__all__ = ["UTILITY_N", "budget_methods", "parse_values", "run_budget_eval"]

#: Held-out texts the sweep's utility (next-token accuracy, answers) is measured on.
UTILITY_N = 64


def parse_values(text: str | None, option: str, *, allow_inf: bool) -> list[float | None]:
    """A comma-separated list of non-negative numbers (``inf``: no budget, as None)."""
    if text is None:
        return []
    out: list[float | None] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(
                f"{option}: {item!r} is not a number (e.g. {option} 2,5,10)"
            ) from None
        if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{option}: {item!r} must be a finite number >= 0")
        out.append(None if math.isinf(value) else value)
    if not out:
        raise ConfigError(f"{option} is empty; pass a comma-separated list such as 2,5,10")
    return out


def budget_methods(methods: Sequence[str]) -> list[str]:
    """The methods a budget sweep serves: the aggregates (No CP and the baselines have no
    certificate to budget)."""
    from scpdr.methods import SPECS

    return [n for n in methods if n in SPECS and SPECS[n].rule != "none"]


def run_budget_eval(
    scorers: Any,
    eval_data: Any,
    methods: Sequence[str],
    *,
    budgets: Sequence[float | None],
    on_budget: str,
    anchors: Sequence[float],
    batch_size: int,
    max_tokens: int | None,
    mia_n: int | None,
    seed: int,
) -> list[Any]:
    """The sweep's rows for every method of ``methods`` that has a certificate: the stop rule
    (and with ``on_budget="base"`` the fallback) at every budget, anchored serving at every
    radius (both need a variant-'b' method: the others get the stop rule alone), every
    membership test of the suite with AUC and TPR@1%, accuracy, tokens per answer and the
    fraction of tokens served from the private aggregate."""
    import torch

    from scpdr.attacks.budget import BudgetOptions, budget_sweep
    from scpdr.attacks.eval_data import select

    if on_budget not in ("stop", "base"):
        raise ConfigError(f"--on-budget must be 'stop' or 'base', got {on_budget!r}")
    chosen = budget_methods(methods)
    if not chosen:
        raise ConfigError(
            "--budgets needs a protected method (e.g. --methods none,scp-delta-r-b): No CP has "
            "no certificate to budget"
        )
    pop = eval_data.mia_population("auto", mia_n, seed=seed)
    if pop is None:
        raise ConfigError(
            "--budgets: no members and non-members to test (the bundle's partitions and "
            "validation records); evaluate with --data pointing at them"
        )
    modes = ("stop", "fallback") if on_budget == "base" else ("stop",)
    options = BudgetOptions(
        budgets=tuple(budgets) or (None,),
        utility_n=None,
        max_tokens=max_tokens,
        batch_size=batch_size,
        seed=seed,
        modes=modes + (("anchor",) if anchors else ()),
        anchors=tuple(float(c) for c in anchors),
        all_tests=True,
    )
    rows: list[Any] = []
    for method in chosen:
        refs = {"lira": scorers.reference_of(method), "ref": scorers.base}
        with torch.inference_mode():
            rows += budget_sweep(
                scorers[method],
                method=method,
                pii=select(eval_data.pii, None, seed=seed, salt="pii"),
                validation=select(eval_data.validation, UTILITY_N, seed=seed, salt="utility"),
                members=pop.members,
                nonmembers=pop.nonmembers,
                references=refs,
                options=options,
                corpus=eval_data.corpus,
            )
    return rows
