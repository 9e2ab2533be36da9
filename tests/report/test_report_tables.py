"""Report tables on hand-made result rows: the paper's Table 3 reproduced (NAS and marks),
formatting, STE, directions, k_x and canary tables."""

from __future__ import annotations

import math

import pytest

from scpdr import methods
from scpdr.report.cells import NEAR_CHANCE
from scpdr.report.tables import (
    canary_table,
    format_value,
    kx_table,
    main_table,
    mia_table,
    nas_scores,
    rank_marks,
    to_html,
    to_markdown,
    to_rich,
)

# Table 3 of the paper (values as printed; FER of SCP-Δr-b "<.001" entered as 5e-4).
COLS = [
    ("canary", "mean", "math"),
    ("canary", "p95", "math"),
    ("pii", "ael", "ids"),
    ("pii", "fer", "ids"),
    ("tte", "auc", "math"),
    ("tte", "acc", "math"),
    ("tte", "auc", "story"),
    ("tte", "acc", "story"),
    ("tte", "auc", "code"),
    ("tte", "acc", "code"),
    ("utility", "acc", "math"),
    ("utility", "acc", "story"),
    ("utility", "acc", "code"),
]
PAPER = {
    "none": [28, 31, 7.4, 0.73, 0.94, 0.84, 0.98, 0.92, 0.96, 0.84, 0.47, 0.37, 0.67],
    "cp-delta": [8.8, 17, 2.4, 0.15, 0.90, 0.69, 0.96, 0.80, 0.89, 0.76, 0.50, 0.41, 0.70],
    "cp-kl": [23, 33, 4.1, 0.34, 0.93, 0.77, 0.97, 0.86, 0.88, 0.80, 0.51, 0.42, 0.70],
    "cp-fuse": [3.8, 7.1, 4.1, 0.34, 0.93, 0.77, 0.97, 0.86, 0.88, 0.80, 0.48, 0.38, 0.68],
    "cp-delta-r": [3.6, 8.0, 1.9, 0.06, 0.80, 0.50, 0.86, 0.58, 0.80, 0.61, 0.50, 0.40, 0.69],
    "scp-delta-r-c": [1.6, 3.4, 1.8, 0.05, 0.79, 0.49, 0.83, 0.59, 0.81, 0.61, 0.49, 0.40, 0.69],
    "scp-delta-r-b": [1.4, 3.2, 0.43, 5e-4, 0.76, 0.46, 0.84, 0.60, 0.78, 0.60, 0.50, 0.39, 0.72],
    "none-val": [1.4, 3.6, 0.12, 1e-10, 0.66, 0.38, 0.71, 0.45, 0.71, 0.51, 0.47, 0.37, 0.67],
}
PAPER_NAS = {
    "none": 0.99,
    "cp-delta": 0.47,
    "cp-kl": 0.76,
    "cp-fuse": 0.50,
    "cp-delta-r": 0.22,
    "scp-delta-r-c": 0.17,
    "scp-delta-r-b": 0.11,
    "none-val": 0.002,
}
# Marks of the paper's table: B = bold, U = underlined, . = plain (NAS first, then COLS).
PAPER_MARKS = {
    "none": "..............",
    "cp-delta": "...........UUU",
    "cp-kl": "...........BBU",
    "cp-fuse": "..............",
    "cp-delta-r": "........BUUU..",
    "scp-delta-r-c": "UUUUUUUBU.U...",
    "scp-delta-r-b": "BBBBBBBU.BBU.B",
}


def paper_rows(std: float | None = None, n: int = 100) -> list[dict]:
    rows = []
    for method, vals in PAPER.items():
        for (attack, metric, corpus), v in zip(COLS, vals, strict=True):
            rows.append(
                {
                    "method": method,
                    "attack": attack,
                    "metric": metric,
                    "value": v,
                    "n": n,
                    "std": std,
                    "corpus": corpus,
                }
            )
    return rows


LABELS = {"math": "Math", "ids": "IDs", "story": "Story", "code": "Code"}


def test_paper_table_columns_in_paper_order():
    t = main_table(paper_rows(), corpus_labels=LABELS)
    got = [(c.group, c.sub, c.label) for c in t.columns]
    assert got[0] == ("NAS", "", "Mean")
    assert got[1:] == [
        ("Canary", "Math", "Mean"),
        ("Canary", "Math", "95%"),
        ("PII", "IDs", "AEL"),
        ("PII", "IDs", "FER"),
        ("TTE", "Math", "AUC"),
        ("TTE", "Math", "ACC"),
        ("TTE", "Story", "AUC"),
        ("TTE", "Story", "ACC"),
        ("TTE", "Code", "AUC"),
        ("TTE", "Code", "ACC"),
        ("Utility", "Math", "ACC"),
        ("Utility", "Story", "ACC"),
        ("Utility", "Code", "ACC"),
    ]
    assert t.row_keys == list(PAPER)
    assert t.row_labels[0] == "No CP" and t.row_labels[6] == "SCP-Δr-b"
    assert t.separator_before == 7


def test_paper_table_nas_matches_the_paper():
    t = main_table(paper_rows(), corpus_labels=LABELS)
    for method, nas in PAPER_NAS.items():
        # The paper computed NAS from unrounded values: agree to its printed precision ± .01.
        assert t.value(method, 0) == pytest.approx(nas, abs=0.011), method


def test_paper_table_bold_and_underline_match_the_paper():
    t = main_table(paper_rows(), corpus_labels=LABELS)
    code = {"best": "B", "second": "U", None: "."}
    for method, expected in PAPER_MARKS.items():
        got = "".join(code[m] for m in t.marks(method))
        assert got == expected, method
    # Reference rows are never marked.
    assert set(t.marks("none-val")) == {None}


def test_nas_hand_computation_with_corpus_weights():
    # Canary (1 corpus: weight 1) and TTE AUC on 2 corpora (weight 1/2 each).
    rows = []
    table = {"none": (10.0, 0.9, 0.8), "cp-delta-r": (4.0, 0.6, 0.8), "none-val": (0.0, 0.5, 0.4)}
    for m, (c, t1, t2) in table.items():
        rows += [
            {"method": m, "attack": "canary", "metric": "mean", "value": c, "corpus": "a"},
            {"method": m, "attack": "tte", "metric": "auc", "value": t1, "corpus": "a"},
            {"method": m, "attack": "tte", "metric": "auc", "value": t2, "corpus": "b"},
        ]
    t = main_table(rows)
    # normalized: canary (1, .4, 0); tte a (1, .25, 0); tte b (1, 1, 0)
    assert t.value("none", 0) == pytest.approx(1.0)
    assert t.value("cp-delta-r", 0) == pytest.approx((0.4 + 0.5 * 0.25 + 0.5 * 1.0) / 2.0)
    assert t.value("none-val", 0) == pytest.approx(0.0)
    assert [c.weight for c in t.columns] == [0.0, 1.0, 0.5, 0.5]


def test_nas_scores_constant_column_and_missing_values():
    out = nas_scores({"a": [1.0, None], "b": [1.0, 3.0], "c": [1.0, 1.0]}, [1.0, 1.0])
    assert out["a"] == 0.0  # constant column normalizes to 0; the missing one is skipped
    assert out["b"] == pytest.approx(0.5)
    assert out["c"] == 0.0


def test_utility_is_higher_better_and_attacks_lower_better():
    rows = [
        {"method": "none", "attack": "utility", "metric": "acc", "value": 0.30, "corpus": "x"},
        {"method": "cp-delta", "attack": "utility", "metric": "acc", "value": 0.50, "corpus": "x"},
        {
            "method": "scp-delta-r-b",
            "attack": "utility",
            "metric": "acc",
            "value": 0.40,
            "corpus": "x",
        },
        {"method": "none", "attack": "pii", "metric": "fer", "value": 0.9, "corpus": "x"},
        {"method": "cp-delta", "attack": "pii", "metric": "fer", "value": 0.5, "corpus": "x"},
        {"method": "scp-delta-r-b", "attack": "pii", "metric": "fer", "value": 0.0, "corpus": "x"},
    ]
    t = main_table(rows)
    fer = [c.label for c in t.columns].index("FER")
    acc = [c.label for c in t.columns].index("ACC")
    assert t.marks("scp-delta-r-b")[fer] == "best" and t.marks("cp-delta")[fer] == "second"
    assert t.marks("cp-delta")[acc] == "best" and t.marks("scp-delta-r-b")[acc] == "second"
    assert t.marks("none")[acc] is None


def test_ste_row_and_none_val_utility_default():
    rows = [
        {
            "method": "none",
            "attack": "utility",
            "metric": "acc",
            "value": 0.5,
            "n": 400,
            "std": 0.5,
            "corpus": "x",
        },
        {
            "method": "none",
            "attack": "pii",
            "metric": "ael",
            "value": 9.0,
            "n": 10,
            "std": 1.0,
            "corpus": "x",
        },
        {
            "method": "none-val",
            "attack": "pii",
            "metric": "ael",
            "value": 1.0,
            "n": 25,
            "std": 2.0,
            "corpus": "x",
        },
    ]
    t = main_table(rows)
    assert t.row_keys == ["none", "none-val", "ste"]
    ael = [c.label for c in t.columns].index("AEL")
    acc = [c.label for c in t.columns].index("ACC")
    assert t.value("ste", ael) == pytest.approx(2.0 / 5.0)
    assert t.value("none-val", acc) == pytest.approx(0.5)  # same held-out data as No CP
    assert t.value("ste", acc) == pytest.approx(0.5 / 20.0)
    assert t.value("ste", 0) is None  # no NAS for STE


def test_canary_row_choice_and_sweep_rows_ignored():
    rows = [
        {
            "method": "none",
            "attack": "canary",
            "metric": "mean",
            "value": 1.0,
            "repetitions": 1,
            "corpus": "c",
        },
        {
            "method": "none",
            "attack": "canary",
            "metric": "mean",
            "value": 3.0,
            "repetitions": 3,
            "corpus": "c",
        },
        {
            "method": "none",
            "attack": "canary",
            "metric": "mean",
            "value": 10.0,
            "repetitions": 10,
            "corpus": "c",
        },
        {
            "method": "none",
            "attack": "canary",
            "metric": "mean",
            "value": 99.0,
            "sweep": "m",
            "sweep_value": 1,
            "corpus": "c",
        },
    ]
    t = main_table(rows)
    assert t.value("none", 1) == 3.0  # the paper's main setting: 3 repetitions
    rows.append(
        {"method": "none", "attack": "canary", "metric": "mean", "value": 5.0, "corpus": "c"}
    )
    assert main_table(rows).value("none", 1) == 5.0  # a pooled row wins
    ct = canary_table(rows)
    assert ct is not None and [c.sub for c in ct.columns] == [
        "REP=1",
        "REP=1",
        "REP=3",
        "REP=3",
        "REP=10",
        "REP=10",
    ]


def test_columns_without_values_are_omitted():
    rows = [{"method": "none", "attack": "utility", "metric": "acc", "value": 0.5, "corpus": "x"}]
    t = main_table(rows)
    assert [c.group for c in t.columns] == ["Utility"]  # no attack column → no NAS either


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.99, ".99"),
        (28.0, "28"),
        (8.8, "8.8"),
        (8.0, "8.0"),
        (0.002, ".002"),
        (1e-10, "<.001"),
        (0.0, "0"),
        (None, "-"),
        (float("nan"), "-"),
        (0.5, ".50"),
        (123.4, "123"),
        (-0.25, "-.25"),
        (0.999, "1.0"),
        (math.inf, "∞"),
    ],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_rank_marks_ties_share_the_mark():
    assert rank_marks([0.501, 0.499, 0.7, None], "down") == ["best", "best", "second", None]
    assert rank_marks([1.0], "down") == [None]


def test_kx_table_and_renderers():
    rows = [
        {"method": m, "attack": "bounds", "metric": "k_x_p99", "value": v, "corpus": c}
        for c in ("m", "s")
        for m, v in (
            ("cp-delta", 11.6),
            ("cp-delta-r", 0.98),
            ("scp-delta-r-b", 0.004),
            ("scp-delta-r-c", 0.005),
        )
    ]
    t = kx_table(rows, corpus_labels={"m": "M", "s": "S"})
    assert t is not None and t.row_keys == [
        "cp-delta",
        "cp-delta-r",
        "scp-delta-r-c",
        "scp-delta-r-b",
    ]
    assert t.marks("scp-delta-r-b") == ["best", "best"] and t.marks("scp-delta-r-c") == [
        "second",
        "second",
    ]
    md = to_markdown(t)
    assert "| SCP-Δr-b | **.004** | **.004** |" in md and "<u>.005</u>" in md
    page = to_html(t)
    assert "<b>.004</b>" in page and "<u>.005</u>" in page
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(to_rich(t))
    assert "SCP-Δr-b" in console.export_text()
    assert kx_table([{"method": "none", "attack": "pii", "metric": "ael", "value": 1}]) is None


def _mia_rows(values):
    rows = []
    for m, attack, auc, tpr in values:
        for metric, v, half in (("auc", auc, 0.05), ("tpr@0.01fpr", tpr, 0.02)):
            rows.append(
                {
                    "method": m,
                    "attack": attack,
                    "metric": metric,
                    "value": v,
                    "ci_low": v - half,
                    "ci_high": v + half,
                    "n": 200,
                    "corpus": "ids",
                }
            )
    return rows


def test_mia_table_ranks_auc_by_its_distance_from_chance():
    rows = _mia_rows(
        [
            ("none", "loss", 0.95, 0.4),
            ("cp-fuse", "loss", 0.19, 0.0),  # a flipped test: as much leakage as .81
            ("cp-delta-r", "loss", 0.7, 0.05),
            ("scp-delta-r-b", "loss", 0.52, 0.011),
            ("none-val", "loss", 0.5, 0.01),
        ]
    )
    t = mia_table(rows, corpus_labels={"ids": "IDs"})
    assert t is not None and [c.label for c in t.columns] == ["AUC", "TPR@1%"]
    assert [c.group for c in t.columns] == ["LOSS", "LOSS"]
    assert t.row_keys == ["none", "cp-fuse", "cp-delta-r", "scp-delta-r-b", "none-val"]
    assert t.marks("scp-delta-r-b")[0] == "best" and t.marks("cp-delta-r")[0] == "second"
    assert t.marks("cp-fuse")[0] is None  # .19 is not "the best protection"
    assert t.marks("cp-fuse")[1] == "best"  # its TPR@1% is lowest
    cell = t.cells[t.row_keys.index("scp-delta-r-b")][0].text
    assert cell == ".52 ±.05" + NEAR_CHANCE  # within No CP-val's interval
    assert t.cells[t.row_keys.index("none")][0].text == ".95 ±.05"  # distinguishable
    assert t.separator_before == 4
    assert mia_table([]) is None


@pytest.mark.parametrize("method", methods.METHOD_ORDER)
def test_every_registered_method_is_labelled_coloured_and_ordered_by_the_registry(method):
    from scpdr.report.plots import method_color

    rows = [
        {"method": m, "attack": "pii", "metric": "ael", "value": 1.0, "corpus": "ids"}
        for m in (method, "none")
    ]
    t = main_table(rows)
    assert t.row_labels[t.row_keys.index(method)] == methods.SPECS[method].label
    assert method_color(method) == methods.SPECS[method].color
    assert t.row_keys == [m for m in methods.METHOD_ORDER if m in (method, "none")]
