"""The budget sweep in the experiment: attack ``budget`` plans one stage per corpus × method that
runs :func:`scpdr.experiment.stages_budget.run_budget` (with p0's reference bundle when the run
has one), its section validates the budgets, and other stages keep their hashes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scpdr.errors import ConfigError
from scpdr.experiment import plan, validate_config
from scpdr.experiment.stages_budget import run_budget

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _cfg(attacks, **patch):
    d = yaml.safe_load(TINY.read_text())
    d["corpora"][0]["attacks"] = attacks
    d["sweeps"] = []
    d["attacks"].update(patch)
    return validate_config(d)


def test_budget_attack_plans_one_stage_per_method_with_the_reference():
    cfg = _cfg(["lira", "budget"], budget={"budgets": [1, 2.5, None], "mia_n": 4})
    stages, report = plan(cfg)
    budget = [s for s in stages if s.name.endswith("/budget")]
    assert sorted(s.inputs["method"] for s in budget) == sorted(cfg.all_methods)
    for s in budget:
        assert s.run is run_budget and s.kind == "attack"
        assert {"bundle", "partitions", "ref_bundle"} <= set(s.deps)
        assert s.inputs["config"]["budgets"] == [1.0, 2.5, None]
        assert s.key in {d.key for d in report.deps.values()}  # its rows reach the report
    # the other stages do not depend on the budget section
    again, _ = plan(_cfg(["lira", "budget"], budget={"budgets": [3]}))
    others = {s.name: s.key for s in stages if not s.name.endswith("/budget")}
    assert others == {s.name: s.key for s in again if not s.name.endswith("/budget")}
    assert {s.key for s in budget}.isdisjoint(s.key for s in again)


@pytest.mark.parametrize("bad", [[-1.0], [float("inf")], []])
def test_budget_section_validates_the_budgets(bad):
    with pytest.raises(ConfigError, match="budgets"):
        _cfg(["budget"], budget={"budgets": bad})
