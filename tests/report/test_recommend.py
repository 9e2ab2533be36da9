"""The operating point of the budget sweep (scpdr.report.recommend) on hand-made rows."""

from __future__ import annotations

from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.recommend import operating_points_text, recommend, recommendation_line

M = "scp-delta-r-b"


def _setting(mode, *, budget=None, anchor=None, tpr, auc, acc, tpa, method=M):
    extra = {"mode": mode, "budget": budget, "anchor": anchor}
    rows = []
    for test in ("ref", "loss"):
        t, a = tpr[test], auc[test]
        rows.append(
            {
                "method": method,
                "attack": "budget",
                "metric": f"{test}_tpr@0.01fpr",
                "value": t[0],
                "n": 200,
                "ci_low": t[1],
                "ci_high": t[2],
                **extra,
            }
        )
        rows.append(
            {
                "method": method,
                "attack": "budget",
                "metric": f"{test}_auc",
                "value": a[0],
                "n": 200,
                "ci_low": a[1],
                "ci_high": a[2],
                **extra,
            }
        )
    rows.append(
        {
            "method": method,
            "attack": "budget",
            "metric": "accuracy",
            "value": acc,
            "n": 500,
            "ci_low": acc - 0.01,
            "ci_high": acc + 0.01,
            **extra,
        }
    )
    rows.append(
        {
            "method": method,
            "attack": "budget",
            "metric": "tokens_per_answer",
            "value": tpa,
            "n": 32,
            "ci_low": tpa - 1,
            "ci_high": tpa + 1,
            **extra,
        }
    )
    return rows


CHANCE = {
    "tpr": {"ref": (0.01, 0.0, 0.03), "loss": (0.02, 0.0, 0.05)},
    "auc": {"ref": (0.52, 0.45, 0.59), "loss": (0.5, 0.43, 0.57)},
}
LEAKY = {
    "tpr": {"ref": (0.08, 0.04, 0.12), "loss": (0.02, 0.0, 0.05)},
    "auc": {"ref": (0.76, 0.72, 0.81), "loss": (0.5, 0.43, 0.57)},
}
VAL = [
    {
        "method": NO_CP_VAL,
        "attack": "ref",
        "metric": "auc",
        "value": 0.55,
        "n": 200,
        "ci_low": 0.5,
        "ci_high": 0.6,
    }
]


def test_the_best_utility_at_chance_wins_over_a_better_leaky_one():
    rows = VAL + _setting("stop", budget=5.0, **CHANCE, acc=0.06, tpa=2.8)
    rows += _setting("fallback", budget=5.0, **CHANCE, acc=0.30, tpa=7.8)
    rows += _setting("stop", budget=None, **LEAKY, acc=0.32, tpa=7.8)
    rec = recommend(rows)
    assert rec is not None and rec.reached
    assert (rec.mode, rec.budget, rec.accuracy) == ("fallback", 5.0, 0.30)
    line = recommendation_line(rec, "D")
    assert "scpdr serve D --method scp-delta-r-b --budget 5 --on-budget base" in line
    assert "no setting" not in line


def test_none_at_chance_says_so_and_what_the_closest_costs():
    worse = {**LEAKY, "tpr": {**LEAKY["tpr"], "ref": (0.2, 0.1, 0.3)}}
    rows = VAL + _setting("anchor", anchor=0.5, **LEAKY, acc=0.2, tpa=7.0)
    rows += _setting("stop", budget=None, **worse, acc=0.32, tpa=7.8)
    rec = recommend(rows)
    assert rec is not None and not rec.reached
    assert (rec.mode, rec.anchor, rec.test, rec.tpr) == ("anchor", 0.5, "ref", 0.08)
    line = recommendation_line(rec, "D")
    assert "no setting of the grid reaches chance" in line and "TPR@1% 0.08" in line
    assert "accuracy 0.2" in line and "--anchor 0.5" in line


def test_an_auc_near_no_cp_val_counts_as_chance_and_ties_go_to_the_tokens_then_the_budget():
    near = {**CHANCE, "auc": {**CHANCE["auc"], "ref": (0.56, 0.51, 0.61)}}  # excludes .5
    rows = VAL + _setting("stop", budget=10.0, **near, acc=0.3, tpa=5.0)
    rows += _setting("fallback", budget=10.0, **near, acc=0.3, tpa=7.0)
    rows += _setting("fallback", budget=2.0, **near, acc=0.3, tpa=7.0)
    rec = recommend(rows)
    assert rec.reached and (rec.mode, rec.budget) == ("fallback", 2.0)
    far = [dict(VAL[0], value=0.4, ci_low=0.35, ci_high=0.45)]  # now distinguishable: leaky
    assert not recommend(far + rows[1:]).reached


def test_declared_secrets_above_chance_block_every_setting():
    rows = VAL + _setting("fallback", budget=5.0, **CHANCE, acc=0.3, tpa=7.8)
    sec = [
        {
            "method": M,
            "attack": "secrets",
            "metric": "fer",
            "value": 0.5,
            "n": 50,
            "ci_low": 0.36,
            "ci_high": 0.64,
        },
        {
            "method": NO_CP_VAL,
            "attack": "secrets",
            "metric": "fer",
            "value": 0.0,
            "n": 50,
            "ci_low": 0.0,
            "ci_high": 0.0,
        },
    ]
    assert recommend(rows).reached and not recommend(rows + sec).reached
    assert recommend([]) is None
    assert "none" in recommendation_line(None)


def test_a_restricted_search_compares_the_stop_rule_at_the_same_guarantee():
    rows = VAL + _setting("stop", budget=5.0, **CHANCE, acc=0.06, tpa=2.8)
    rows += _setting("fallback", budget=5.0, **CHANCE, acc=0.30, tpa=7.8)
    rows += _setting("stop", budget=None, **LEAKY, acc=0.32, tpa=7.8)
    rows += _setting("stop", budget=None, **LEAKY, acc=0.5, tpa=9.0, method="cp-delta-r")
    stop = recommend(rows, method=M, modes=("stop",))
    assert stop.reached and (stop.mode, stop.budget, stop.accuracy) == ("stop", 5.0, 0.06)
    assert recommend(rows, method="cp-delta-r").method == "cp-delta-r"
    assert recommend(rows, method="nope") is None
    text = operating_points_text(rows)
    mine = text[text.index(f"{M} —") :]
    assert "at chance: fallback B = 5 (accuracy 0.3, 7.8 tokens" in mine
    assert "the stop rule at chance: stop B = 5 (accuracy 0.06, 2.8 tokens" in mine
    assert "unbudgeted: accuracy 0.32, 7.8 tokens per answer" in mine
    assert "cp-delta-r — no setting at chance" in text
    assert operating_points_text(VAL) == ""
