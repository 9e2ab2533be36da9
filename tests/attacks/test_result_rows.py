"""Result rows: JSON round trip and schema."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from scpdr.attacks.results import ResultRow, bootstrap_std, load_results, save_results


def test_round_trip(tmp_path):
    rows = [
        ResultRow(
            "scp-delta-r-b", "pii", "ael", np.float64(0.4), 100, 0.1, "names2ids", {"id_length": 10}
        ),
        ResultRow("none", "lira", "auc", float("nan"), 3),
    ]
    path = save_results(rows, tmp_path / "out" / "results.json")
    data = json.loads(path.read_text())
    assert data[0] == {
        "method": "scp-delta-r-b",
        "attack": "pii",
        "metric": "ael",
        "value": 0.4,
        "n": 100,
        "std": 0.1,
        "corpus": "names2ids",
        "id_length": 10,
    }
    assert data[1]["value"] is None  # JSON has no NaN
    back = load_results(path)
    assert back[0] == rows[0] and math.isnan(back[1].value)


def test_extra_cannot_shadow_core_fields():
    with pytest.raises(ValueError, match="collides"):
        ResultRow("m", "a", "x", 1.0, extra={"value": 2}).to_dict()


def test_bootstrap_std_of_the_mean_is_the_standard_error():
    x = np.random.default_rng(0).normal(size=400)
    assert bootstrap_std(x, np.mean, n_boot=2000) == pytest.approx(x.std() / 20, rel=0.1)
