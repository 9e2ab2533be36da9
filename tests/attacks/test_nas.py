"""NAS: the paper's own table reproduces its NAS column; rows -> NAS by hand."""

from __future__ import annotations

import pytest

from scpdr.attacks.nas import nas, nas_from_rows
from scpdr.attacks.results import ResultRow

COLS = ["c_mean", "c_95", "ael", "fer", "m_auc", "m_acc", "s_auc", "s_acc", "k_auc", "k_acc"]
# Table "Full results" of the paper (attack columns only; FER "<.001" taken as .0005)
PAPER = {
    "No CP": [28, 31, 7.4, 0.73, 0.94, 0.84, 0.98, 0.92, 0.96, 0.84],
    "CP-D": [8.8, 17, 2.4, 0.15, 0.90, 0.69, 0.96, 0.80, 0.89, 0.76],
    "CP-KL": [23, 33, 4.1, 0.34, 0.93, 0.77, 0.97, 0.86, 0.88, 0.80],
    "CP-Fuse": [3.8, 7.1, 4.1, 0.34, 0.93, 0.77, 0.97, 0.86, 0.88, 0.80],
    "CP-Dr": [3.6, 8.0, 1.9, 0.06, 0.80, 0.50, 0.86, 0.58, 0.80, 0.61],
    "SCP-Dr-c": [1.6, 3.4, 1.8, 0.05, 0.79, 0.49, 0.83, 0.59, 0.81, 0.61],
    "SCP-Dr-b": [1.4, 3.2, 0.43, 0.0005, 0.76, 0.46, 0.84, 0.60, 0.78, 0.60],
    "No CP-val": [1.4, 3.6, 0.12, 1e-10, 0.66, 0.38, 0.71, 0.45, 0.71, 0.51],
    "STE": [0.11, 0.90, 0.01, 0.0, 0.01, 0.01, 0.01, 0.01, 0.02, 0.01],
}
PAPER_NAS = {
    "No CP": 0.99,
    "CP-D": 0.47,
    "CP-KL": 0.76,
    "CP-Fuse": 0.50,
    "CP-Dr": 0.22,
    "SCP-Dr-c": 0.17,
    "SCP-Dr-b": 0.11,
    "No CP-val": 0.002,
}


def test_paper_table_reproduces_paper_nas():
    table = {m: dict(zip(COLS, v, strict=True)) for m, v in PAPER.items()}
    weights = {c: (1 / 3 if c[:2] in ("m_", "s_", "k_") else 1.0) for c in COLS}
    got = nas(table, weights=weights)
    assert "STE" not in got
    for m, want in PAPER_NAS.items():
        assert got[m] == pytest.approx(want, abs=0.006), m


def test_nas_from_rows_by_hand():
    def row(method, attack, metric, value, corpus=None, **extra):
        return ResultRow(method, attack, metric, value, 1, None, corpus, extra)

    rows = []
    for m, (e_mean, ael, auc) in {
        "a": (10.0, 8.0, 0.9),
        "b": (2.0, 0.0, 0.6),
        "c": (6.0, 4.0, 0.75),
    }.items():
        rows += [
            row(m, "canary", "exposure_mean", e_mean, "math", repetitions=3),
            row(m, "canary", "exposure_mean", 50.0, "math", repetitions=1),  # not REP=3: ignored
            row(m, "canary", "baseline_exposure_mean", 99.0, "math", baseline=True),
            row(m, "pii", "ael", ael, "names2ids"),
            row(m, "tte", "auc", auc, "math"),
            row(m, "utility", "accuracy", 0.5, "math"),
        ]
    scores, out = nas_from_rows(rows)
    # weights 1, 1, 1/3: a = (1 + 1 + 1/3) / (7/3) = 1, b = 0, c = (.5 + .5 + .5/3) / (7/3) = .5
    assert scores == pytest.approx({"a": 1.0, "b": 0.0, "c": 0.5})
    assert {r.method for r in out} == {"a", "b", "c"} and out[0].attack == "nas"


def test_constant_column_contributes_zero():
    assert nas({"x": {"k": 1.0}, "y": {"k": 1.0}}) == {"x": 0.0, "y": 0.0}


def test_pooled_none_val_canary_row_joins_the_rep3_column():
    def row(method, metric, value, **extra):
        return ResultRow(method, "canary", metric, value, 1, None, "math", extra)

    rows = [
        row("none", "exposure_mean", 20.0, repetitions=3),
        row("none", "exposure_mean", 25.0, repetitions=10),  # another count: not used
        row("scp", "exposure_mean", 4.0, repetitions=3),
        row("none-val", "exposure_mean", 2.0, repetitions=0),  # never-inserted canaries
        row("ste", "exposure_mean", 0.1),
    ]
    scores, _ = nas_from_rows(rows)
    assert scores == pytest.approx({"none": 1.0, "scp": 2 / 18, "none-val": 0.0})


def test_each_attack_type_counts_equally_whatever_its_corpora():
    """§5.4: TTE columns weigh 1/3 because the paper reports TTE on three corpora; with TTE on
    one corpus they weigh 1, like canary and PII, and the report's main table agrees."""
    from scpdr.report.tables import main_table

    def rows_for(tte_corpora):
        rows = []
        # a leaks on PII only, b on TTE only: equal NAS iff TTE (all corpora) weighs like PII
        for m, (ael, auc) in {"a": (10.0, 0.5), "b": (0.0, 1.0), "z": (0.0, 0.5)}.items():
            rows.append(ResultRow(m, "pii", "ael", ael, 1, None, "names2ids", {}))
            for c in tte_corpora:
                rows.append(ResultRow(m, "tte", "auc", auc, 1, None, c, {}))
        return rows

    for corpora in (["math"], ["math", "story", "code"]):
        rows = rows_for(corpora)
        scores, _ = nas_from_rows(rows)
        assert scores["a"] == pytest.approx(scores["b"]), corpora
        assert scores["a"] == pytest.approx(0.5) and scores["z"] == 0.0
        table = main_table([r.to_dict() for r in rows])
        assert table.columns[0].group == "NAS"
        assert table.value("a", 0) == pytest.approx(scores["a"])
        assert table.value("b", 0) == pytest.approx(scores["b"])
    # explicit weights still override
    scores, _ = nas_from_rows(rows_for(["math"]), attack_weights={"pii": 1.0, "tte": 1 / 3})
    assert scores["a"] == pytest.approx(0.75)


def test_membership_aucs_never_enter_nas():
    """A flipped membership test (ROC AUC far below .5) is leakage, not protection: NAS reads
    only the paper's extraction columns, so such a row cannot make a method the best protected."""
    from scpdr.attacks.mia import MIA_ATTACKS

    base = [
        ResultRow("none", "pii", "ael", 9.0, corpus="ids"),
        ResultRow("cp-fuse", "pii", "ael", 3.0, corpus="ids"),
        ResultRow("scp-delta-r-b", "pii", "ael", 1.0, corpus="ids"),
    ]
    mia = [
        ResultRow(m, a, "auc", auc, corpus="ids")
        for a in MIA_ATTACKS
        for m, auc in (("none", 0.99), ("cp-fuse", 0.05), ("scp-delta-r-b", 0.6))
    ]
    assert nas_from_rows(base + mia)[0] == nas_from_rows(base)[0]
    assert min(nas_from_rows(base + mia)[0].items(), key=lambda kv: kv[1])[0] == "scp-delta-r-b"
