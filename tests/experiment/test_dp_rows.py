"""The DP baseline rows (dp-eps1, dp-eps8, SCP-Δr-b + DP at ε = 8) in the one evaluation
pipeline: the stages `baselines.dp` plans, and a tiny experiment whose results.json, main table
(NAS included) and MIA table (RMIA included) carry them with their intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scpdr import methods
from scpdr.experiment import plan, validate_config

pytest.importorskip("opacus", reason="the `dp` extra (in `dev`)")

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _config(**patch):
    data = yaml.safe_load(TINY.read_text())
    data.update(
        methods=["none", "scp-delta-r-b"],
        attacks={**data["attacks"], "generations": {"n": 1, "methods": ["none"]}},
        baselines={"dp": {}},
        sweeps=[],
        bounds={"enabled": False},
        corpora=[
            {"name": "names2ids", "n_train": 12, "n_val": 12, "attacks": ["pii", "mia", "utility"]}
        ],
    )
    data.update(patch)
    return validate_config(data)


def test_the_dp_rows_get_their_models_and_their_own_bundle():
    cfg = _config()
    assert cfg.all_methods == ["none", "scp-delta-r-b", *methods.DP_METHODS]
    stages, _ = plan(cfg)
    by_name = {s.name: s for s in stages}
    for single in ("dp-eps1", "dp-eps8"):
        train = by_name[f"train/names2ids/{single}"]
        assert train.inputs["partition"] is None  # every partition together
        assert train.inputs["dp"]["dp_epsilon"] == methods.SPECS[single].dp_epsilon
        attack = by_name[f"attack/names2ids/{single}/mia"]
        assert attack.deps[single] is train
    (retrained,) = methods.RETRAINED_METHODS
    bundle = by_name[f"bundle/names2ids/{retrained}"]
    assert {by_name[f"train/names2ids/{retrained}/c{i}"].inputs["partition"] for i in (0, 1)} == {
        0,
        1,
    }
    assert by_name[f"attack/names2ids/{retrained}/pii"].deps["bundle"] is bundle
    assert by_name["attack/names2ids/scp-delta-r-b/pii"].deps["bundle"] is not bundle
    # a sweep restricted to other methods drops the DP stages
    swept = _config(sweeps=[{"key": "m", "values": [2], "methods": ["scp-delta-r-b"]}])
    names = {s.name for s in plan(swept)[0] if "[m=2]" in s.label}
    assert not any("dp" in n for n in names)
    # the DP models' own learning rate replaces the train section's for them only
    tuned = {s.name: s for s in plan(_config(baselines={"dp": {"learning_rate": 5e-3}}))[0]}
    assert tuned["train/names2ids/dp-eps8"].inputs["dp"]["learning_rate"] == 5e-3
    assert "learning_rate" not in by_name["train/names2ids/dp-eps8"].inputs["dp"]
    assert tuned["train/names2ids/dp-eps8"].key != by_name["train/names2ids/dp-eps8"].key
    with pytest.raises(Exception, match="unknown DP row"):
        _config(baselines={"dp": {"methods": ["goldfish"]}})


def test_a_tiny_experiment_reports_the_dp_rows_everywhere(tmp_path):
    from scpdr.experiment import run_experiment

    cfg = _config(methods=["none"], baselines={"dp": {}, "goldfish": None})
    res = run_experiment(cfg, tmp_path / "run", progress=False)
    rows = json.loads(res.results_json.read_text())
    for method in methods.DP_METHODS:
        got = {(r["attack"], r["metric"]) for r in rows if r["method"] == method}
        assert {("pii", "fer"), ("rmia", "tpr@0.01fpr"), ("utility", "accuracy")} <= got, method
        for r in rows:
            if r["method"] == method and r["attack"] in ("rmia", "lira", "pii"):
                assert r["ci_low"] <= r["value"] <= r["ci_high"], r
    # each DP model's privacy is on record: ε ≤ its target, σ > 0
    for method in methods.DP_METHODS:
        found = list(
            (res.out / "stages" / "train" / "names2ids").glob(f"{method}*/**/train_info.json")
        )
        assert found, method
        for f in found:
            dp = json.loads(f.read_text())["dp"]
            assert dp["epsilon"] <= methods.SPECS[method].dp_epsilon and dp["noise_multiplier"] > 0
    table = res.main_table
    for method in methods.DP_METHODS:
        assert method in table.row_keys
        nas = table.cells[table.row_keys.index(method)][0]
        assert nas.value is not None  # read on the paper rows' scale
    md = res.report_md.read_text()
    assert "RMIA" in md and methods.label("dp-eps8") in md
