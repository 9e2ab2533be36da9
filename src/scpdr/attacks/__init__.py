"""Attacks and evaluations of a protected model (paper §5, App. C–D).

Every attack takes a :class:`~scpdr.attacks.scorer.Scorer` — a ``scpdr.ProtectedLM`` under any
method, or a single model (the "No CP" rows) — and uses only its teacher-forced ``score`` and
``next_token_logprobs`` (never a constituent). Results are
:class:`~scpdr.attacks.results.ResultRow` s saved as one JSON list.

- ``exposure``: canary exposure (Carlini et al. 2019), exact or skew-normal extrapolated.
- ``pii``: adaptive digit-by-digit PII extraction on Names2IDs (AEL, FER).
- ``tte``: token-by-token extraction (selective-classification accuracy–coverage AUC, ACC).
- ``lira``: offline LiRA membership inference (ROC AUC, TPR at low FPR, log-scale ROC).
- ``mia``: the membership-inference suite (loss, zlib, Min-K%, Min-K%++, base-model reference,
  LiRA) on the same members and non-members; ``stats``: bootstrap intervals and ROC metrics.
- ``utility``: next-token accuracy and NLL on held-out data.
- ``nas``: the normalized attack score of §5.4.
- ``bounds_analysis``: per-position k_x / t_x / v_x distributions on real prompts (Def. 2.1,
  Thms. 2.3, 2.7, 4.4, 4.5).
- ``sparps``: the Expected SpaRPS curve B(m) of Fig. 2a (Def. 3.4).
- ``prop_bounds``: the App. D.4 synthetic illustration of Proposition 4.8.
- ``evaluation``: the one evaluation pipeline of ``scpdr eval`` and ``scpdr experiment``:
  scorers from a bundle (``bundle_scorers``) → every attack on every method, with timings, on the
  data of ``eval_data`` → result rows.

Submodules import lazily: ``import scpdr.attacks`` loads nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Scorer": "scorer",
    "LogitsScorer": "logits_scorer",
    "ResultRow": "results",
    "save_results": "results",
    "load_results": "results",
    "Canary": "exposure",
    "CanarySpace": "exposure",
    "canary_exposure": "exposure",
    "random_canaries": "exposure",
    "PIIRecord": "pii",
    "pii_extraction": "pii",
    "token_by_token_extraction": "tte",
    "accuracy_coverage_curve": "tte",
    "lira": "lira",
    "plot_roc": "lira",
    "membership_inference": "mia",
    "MIAResult": "mia",
    "utility": "utility",
    "nas": "nas",
    "nas_from_rows": "nas",
    "EvalData": "eval_data",
    "select": "eval_data",
    "EvalOptions": "evaluation",
    "run_eval": "evaluation",
    "generations": "evaluation",
    "load_scorers": "bundle_scorers",
    "BundleScorers": "bundle_scorers",
    "ModelStore": "bundle_scorers",
    "bound_distributions": "bounds_analysis",
    "expected_sparps_curve": "sparps",
    "collect_next_token_logprobs": "sparps",
    "prop_bounds_experiment": "prop_bounds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'scpdr.attacks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"scpdr.attacks.{mod}"), name)


def __dir__() -> list[str]:
    return __all__
