"""What `scpdr eval` tells the data owner about secrets against their chance level and about the
power of its membership tests: the risk table's Guessable column, the method paragraphs, the
verdicts and the MIA table's power line, from hand-made rows."""

from __future__ import annotations

from scpdr.attacks.results import NO_CP_VAL
from scpdr.report.mia_table import mia_table, power_lines
from scpdr.report.owndata import method_paragraph, risk_table
from scpdr.report.verdicts import secrets_verdict, verdicts

NO_CP, SCP = "none", "scp-delta-r-b"


def _secret_rows(method, *, whole, guess, memorized, records_with, p):
    n = 8
    base = {"method": method, "attack": "secrets", "n": n, "corpus": "c"}
    return [
        {**base, "metric": "extracted", "value": 0.6, "ci_low": 0.4, "ci_high": 0.8},
        {**base, "metric": "fer", "value": whole / n, "ci_low": 0.1, "ci_high": 0.7},
        {
            **base,
            "metric": "guessable",
            "value": guess / n,
            "count": guess,
            "ci_low": 0,
            "ci_high": 1,
        },
        {
            **base,
            "metric": "memorized",
            "value": memorized / n,
            "count": memorized,
            "records_with": records_with,
            "ci_low": 0.0,
            "ci_high": 0.5,
        },
        {
            **base,
            "metric": "fer_vs_counterfactual",
            "value": (whole - guess) / n,
            "ci_low": -0.1,
            "ci_high": 0.6,
            "p_value": p,
            "test": "mcnemar-exact",
        },
        {
            **base,
            "metric": "extracted_vs_counterfactual",
            "value": 0.2,
            "ci_low": 0.05,
            "ci_high": 0.35,
            "p_value": 0.01,
            "test": "paired-bootstrap",
        },
    ]


def test_the_paragraph_tells_guessable_from_memorized():
    rows = _secret_rows(NO_CP, whole=3, guess=2, memorized=1, records_with=1, p=0.5)
    text = method_paragraph(NO_CP, rows)
    assert "3 of 8 came out whole" in text
    assert "2 because a model without the record produces them too" in text
    assert "1 because they were memorized (1 records: real leaks)" in text
    assert "McNemar exact p = 0.5: not distinguishable from chance at 95%" in text
    strong = _secret_rows(SCP, whole=8, guess=0, memorized=8, records_with=3, p=0.0078125)
    line = secrets_verdict(strong, SCP)
    assert "8 because they were memorized (3 records" in line and "above chance at 95%" in line
    assert any("memorized" in v for v in verdicts(strong, methods=[SCP]))
    # without a counterfactual the verdict says nothing about it
    assert secrets_verdict([r for r in rows if r["metric"] in ("extracted", "fer")], NO_CP) is None


def test_the_risk_table_shows_the_chance_level_and_the_memorized_secrets():
    line = {"rank": 1, "record": "r1", "partition": 0, "secrets": 2, "ref": 1.0}
    cf = {"counterfactual_extracted": 1.0, "counterfactual_whole": True}
    lines = [
        {
            **line,
            **cf,
            "method": NO_CP,
            "extracted": 1.0,
            "whole": True,
            "secrets_whole": 2,
            "memorized": 1,
        },
        {
            **line,
            **cf,
            "method": SCP,
            "extracted": 1.0,
            "whole": True,
            "secrets_whole": 1,
            "memorized": 0,
        },
    ]
    t = risk_table(lines)
    labels = [c.label for c in t.columns]
    assert labels[:2] == ["", ""] and [c.group for c in t.columns[:2]] == ["Partition", "Guessable"]
    assert labels.count("Memorized") == 2
    texts = [c.text for c in t.cells[0]]
    assert texts[1] == "100% whole" and "1/2" in texts and "0/2" in texts
    assert any("Guessable" in n for n in t.notes)
    # lines without a counterfactual: no Guessable column
    plain = [{k: v for k, v in ln.items() if k not in (*cf, "memorized")} for ln in lines]
    assert "Guessable" not in [c.group for c in risk_table(plain).columns]


def _mia_rows(non: int, *, null: bool):
    rows = []
    for method in (NO_CP, SCP, *([NO_CP_VAL] if null else [])):
        for metric, v in (("auc", 0.8), ("tpr@0.01fpr", 0.1)):
            rows.append(
                {
                    "method": method,
                    "attack": "loss",
                    "metric": metric,
                    "value": v,
                    "n": 49 + non,
                    "corpus": "c",
                    "ci_low": v - 0.05,
                    "ci_high": v + 0.05,
                    "n_members": 49,
                    "n_nonmembers": non,
                }
            )
    return rows


def test_the_power_line_says_what_the_non_members_can_resolve():
    (few,) = power_lines(_mia_rows(49, null=True))
    assert "members 49 / non-members 49; the smallest FPR 49 non-members can resolve is 1/49" in few
    assert "TPR@1% cannot be resolved" in few
    (enough,) = power_lines(_mia_rows(150, null=True))
    assert "cannot be resolved" not in enough and "TPR@0.1% needs 1000" in enough
    (plenty,) = power_lines(_mia_rows(1000, null=True))
    assert "TPR@" not in plenty
    t = mia_table(_mia_rows(49, null=True))
    assert t.row_keys[-1] == NO_CP_VAL and any("1/49" in n for n in t.notes)
    no_null = mia_table(_mia_rows(49, null=False))
    assert NO_CP_VAL not in no_null.row_keys
    assert any(n.startswith("No CP-val: not measured") for n in no_null.notes)
