"""scpdr.experiment: config validation (one test per rule), the cached stage runner (resume,
force, garbage collection, lock), and a tiny end-to-end experiment (every stage, every table
column and figure; a second run is fully cached; a changed setting re-runs only its dependants).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from scpdr import methods
from scpdr.errors import ConfigError, ScpdrError
from scpdr.experiment import (
    MARKER,
    ExperimentConfig,
    Stage,
    StageRunner,
    load_config,
    plan,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def tiny_dict() -> dict[str, Any]:
    return yaml.safe_load(TINY.read_text())


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["tiny.yaml", "demo.yaml", "paper.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(ROOT / "configs" / name)
    assert isinstance(cfg, ExperimentConfig)
    stages, report = plan(cfg)
    assert report.deps and all(s.hash for s in stages)


def test_ablation_configs_validate():
    files = sorted((ROOT / "configs" / "ablations").glob("*.yaml"))
    assert {f.stem for f in files} >= {"m", "epochs", "smoothing_raw", "k3", "lora", "goldfish"}
    for f in files:
        plan(load_config(f))


def test_config_round_trips_through_yaml():
    cfg = validate_config(tiny_dict())
    again = validate_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again == cfg


def test_sections_are_the_librarys_configs():
    """``train:`` is scpdr.training.TrainConfig (every field, formerly ``train.extra``),
    ``canaries:`` scpdr.data.CanaryConfig, ``partitions:`` GroupingConfig's fields plus k (the
    former key ``near_duplicate_threshold`` still reads as ``threshold``)."""
    from scpdr.data import CanaryConfig, GroupingConfig
    from scpdr.training import TrainConfig

    patch = {
        "train": {"optim": "adamw_torch", "save_steps": 7, "epochs": 0.5},
        "partitions": {"near_duplicate_threshold": 0.5, "num_perm": 64},
    }
    cfg = validate_config(merged(tiny_dict(), patch))
    assert isinstance(cfg.train, TrainConfig) and cfg.train.save_steps == 7
    assert cfg.train.epochs == 0.5
    assert isinstance(cfg.corpora[0].canaries, CanaryConfig)
    assert cfg.corpora[0].canaries.repetitions == (1, 3)
    assert cfg.partitions.grouping == GroupingConfig(threshold=0.5, num_perm=64)


CORPUS = {"name": "names2ids", "n_train": 12, "n_val": 6}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"colour": "red"}, "colour: unknown key"),
        ({"train": {"epoch": 3}}, "train.epoch: unknown key"),
        ({"train": {"epochs": 0}}, "train.epochs: must be > 0 (got 0)"),
        ({"train": {"epochs": "many"}}, "train.epochs: must be a number"),
        ({"train": {"seq_len": 1}}, "train.seq_len: must be ≥ 2 (got 1)"),
        ({"train": {"extra": {"bf16": True}}}, "train.extra: unknown key"),
        ({"seed": 1, "train": {"seed": 2}}, "train.seed: the top-level `seed` seeds training"),
        (
            {"baselines": {"goldfish": {"h": 40}}, "train": {"seq_len": 32}},
            "baselines.goldfish: goldfish_h=40 must be smaller than seq_len=32",
        ),
        ({"baselines": {"goldfish": {"k": 1}}}, "baselines.goldfish.k: must be ≥ 2 (got 1)"),
        ({"train": {"learning_rate": -1.0}}, "train.learning_rate: must be > 0"),
        ({"partitions": {"k": 1}}, "partitions.k: must be ≥ 2 (got 1)"),
        ({"partitions": {"threshold": 1.5}}, "partitions.threshold: must be < 1"),
        ({"partitions": {"num_perm": 8}}, "partitions.num_perm: must be ≥ 16 (got 8)"),
        ({"m": 0}, "m: must be ≥ 1 (got 0)"),
        ({"methods": ["none", "cp-magic"]}, "methods: unknown method(s) ['cp-magic']"),
        (
            {"methods": ["none", *methods.BASELINE_METHODS]},
            "training-time baselines are switched on under `baselines:`",
        ),
        ({"methods": ["none", "none"]}, "methods: methods repeated: ['none']"),
        ({"corpora": []}, "corpora: must have at least 1 item"),
        (
            {"corpora": [{**CORPUS, "source": "/no/such/file.jsonl"}]},
            "is neither a built-in corpus",
        ),
        (
            {"corpora": [{**CORPUS, "name": "two words"}]},
            "corpora.0.name: must be a plain identifier",
        ),
        ({"corpora": [CORPUS, CORPUS]}, "corpora: names must be unique, repeated: ['names2ids']"),
        (
            {"corpora": [{**CORPUS, "canaries": {"partition": 2}}]},
            "corpora.0.canaries.partition: must be < partitions.k = 2",
        ),
        (
            {"corpora": [{**CORPUS, "canaries": {"repetitions": [0, 3]}}]},
            "corpora.0.canaries.repetitions: repetitions must be a non-empty list of integers >= 1",
        ),
        ({"corpora": [{**CORPUS, "attacks": ["pii", "sql"]}]}, "unknown attack(s) ['sql']"),
        ({"corpora": [{**CORPUS, "attacks": ["canary"]}]}, "attack 'canary' needs canaries"),
        (
            {"corpora": [{"name": "code", "source": "pycode", "attacks": ["pii"]}]},
            "attack 'pii' needs the names2ids corpus",
        ),
        (
            {"partitions": {"k": 3}, "methods": ["none", "cp-fuse"]},
            "cp-fuse fuses exactly 2 constituents",
        ),
        ({"bounds": {"methods": ["cp-delta", "nope"]}}, "bounds.methods"),
        (
            {
                "attacks": {"generations": {"methods": ["cp-delta-r"]}},
                "methods": ["none", "cp-delta"],
            },
            "attacks.generations.methods",
        ),
        (
            {"attacks": {"budget": {"methods": ["cp-kl"]}}},
            "attacks.budget.methods",
        ),
        (
            {"sweeps": [{"key": "train.epochz", "values": [1]}]},
            "sweeps.0.key: 'train.epochz' is not a config key",
        ),
        ({"sweeps": [{"key": "m", "values": []}]}, "sweeps.0.values: must have at least 1 item"),
        ({"attacks": {"canary": {"n_reference": 10}}}, "attacks.canary.n_reference: must be ≥ 100"),
        ({"references": {"holdout": 0}}, "references.holdout: must be ≥ 1"),
        (
            {"attacks": {"mia": {"population": "names"}}},
            "attacks.mia.population: must be 'auto', 'canaries' or 'records'",
        ),
        ({"bounds": {"methods": ["cp-fuse"]}}, "bounds.methods: cp-fuse is stateful"),
    ],
)
def test_config_errors_name_the_key(patch, message):
    data = merged(tiny_dict(), patch)
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert message in str(err.value)


@pytest.mark.parametrize("alias", sorted(a for s in methods.SPECS.values() for a in s.aliases))
def test_a_method_alias_is_stored_as_its_result_row(alias):
    row = methods.canonical(alias)
    base = merged(tiny_dict(), {"sweeps": [], "attacks": {"generations": {"methods": ["none"]}}})
    patch = {"methods": ["none", alias], "bounds": {"methods": [alias]}}
    cfg = validate_config(merged(base, patch))
    assert row != alias and cfg.methods == ["none", row] and cfg.bounds.methods == [row]
    with pytest.raises(ConfigError, match="methods repeated"):
        validate_config(merged(base, {"methods": ["none", alias, row]}))


def test_missing_corpora_and_wrong_top_level():
    with pytest.raises(ConfigError, match="corpora: is required"):
        validate_config({"name": "x"})
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        validate_config(["a"])  # type: ignore[arg-type]


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncorpora: [\n  - {name: a\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line \d+"):
        load_config(bad)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="the config is empty"):
        load_config(tmp_path / "empty.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_relative_data_paths_resolve_against_the_config(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.jsonl").write_text('{"text": "hello there"}\n' * 3)
    cfg_path = tmp_path / "exp.yaml"
    cfg_path.write_text(
        yaml.safe_dump({"corpora": [{"name": "mine", "source": "data/mine.jsonl"}]})
    )
    cfg = load_config(cfg_path)
    assert cfg.corpora[0].resolved_source == str((tmp_path / "data" / "mine.jsonl").resolve())
    assert cfg.corpora[0].resolved_attacks == ["tte", "mia", "utility", "generations"]


def test_invalid_sweep_value_is_reported_at_planning():
    cfg = validate_config(merged(tiny_dict(), {"sweeps": [{"key": "m", "values": [10, 0]}]}))
    with pytest.raises(ConfigError, match=r"sweeps\.0: value 0 for 'm' is invalid"):
        plan(cfg)


def test_plan_hashes_depend_only_on_relevant_settings():
    base = validate_config(tiny_dict())
    stages_a, _ = plan(base)
    stages_b, _ = plan(base.with_value("m", 20))
    a = {s.key for s in stages_a}
    changed = {s.name for s in stages_b if s.key not in a}
    # m changes the smoothed methods' attacks, the bounds and nothing upstream.
    assert changed
    assert all(n.startswith(("attack/names2ids/scp-delta-r", "bounds/")) for n in changed), changed
    stages_c, _ = plan(base.with_value("train.learning_rate", 5e-3))
    changed = {s.name.split("/")[0] for s in stages_c if s.key not in a}
    assert "train" in changed and "partitions" not in changed


def test_budget_methods_limit_the_sweep_to_those_methods():
    patch = {"attacks": {"budget": {"methods": ["scp-delta-r"]}}}
    base = merged(tiny_dict(), {"sweeps": []})
    base["corpora"][0]["attacks"] = ["utility", "budget"]
    every, _ = plan(validate_config(base))
    some, _ = plan(validate_config(merged(base, patch)))
    swept = lambda stages: {s.name for s in stages if s.name.endswith("/budget")}  # noqa: E731
    assert len(swept(every)) == len(validate_config(base).all_methods) > 1
    assert swept(some) == {"attack/names2ids/scp-delta-r-b/budget"}  # the alias's row
    utility = lambda stages: {s.name for s in stages if s.name.endswith("/utility")}  # noqa: E731
    assert utility(some) == utility(every)  # the other attacks keep every method


def test_sweep_point_stages_carry_their_sweep_value_in_the_label():
    from scpdr.experiment import matches_stage

    cfg = validate_config(tiny_dict())  # sweeps m over [1, 100], train.epochs over [1, 2] (1: main)
    planned_stages, _ = plan(cfg)
    stages = list({s.key: s for s in planned_stages}.values())  # the runner runs each key once
    labels = [s.label for s in stages]
    assert len(labels) == len(set(labels)), "two stages share a display label"
    canary_m1 = [s for s in stages if s.label == "attack/names2ids/scp-delta-r-b/canary [m=1]"]
    assert len(canary_m1) == 1 and canary_m1[0].name == "attack/names2ids/scp-delta-r-b/canary"
    assert any(s.label.startswith("train/") and "[train.epochs=2]" in s.label for s in stages)
    main_stage = next(s for s in stages if s.name == "partitions/names2ids")
    assert main_stage.label == main_stage.name  # shared with the main run: no sweep tag
    forced = [s for s in stages if matches_stage(s, canary_m1[0].label)]
    assert forced == canary_m1


# ----------------------------------------------------------------------------- runner


def _stage(name: str, fn, deps=None, inputs=None) -> Stage:
    return Stage(name=name, kind="report", inputs=inputs or {}, run=fn, deps=deps or {})


def test_runner_caches_resumes_forces_and_collects_garbage(tmp_path):
    cfg = validate_config(tiny_dict())
    calls: list[str] = []

    def first(ctx):
        calls.append("first")
        (ctx.dir / "x.txt").write_text("1")

    def second(ctx):
        calls.append("second")
        # Resumable work: a file left by an interrupted attempt is still there.
        part = ctx.dir / "half.txt"
        if not part.exists():
            part.write_text("started")
            raise KeyboardInterrupt
        (ctx.dir / "y.txt").write_text((ctx.dep("a") / "x.txt").read_text() + "+done")

    a = _stage("a", first, inputs={"v": 1})
    b = _stage("b/sub", second, deps={"a": a})
    runner = StageRunner(tmp_path, cfg, progress=False)
    with pytest.raises(KeyboardInterrupt):
        runner.run_all([b])
    assert calls == ["first", "second"]
    b_dir = runner.stage_dir(b)
    assert not b_dir.exists() and b_dir.with_name(b_dir.name + ".partial").is_dir()
    assert not runner.is_done(b) and runner.is_done(a)

    runner = StageRunner(tmp_path, cfg, progress=False)
    outcomes = runner.run_all([b])
    assert [(o.name, o.status) for o in outcomes] == [("a", "cached"), ("b/sub", "ran")]
    assert (b_dir / "y.txt").read_text() == "1+done" and (b_dir / MARKER).is_file()
    assert json.loads((b_dir / MARKER).read_text())["hash"] == b.hash

    runner = StageRunner(tmp_path, cfg, progress=False)
    assert [o.status for o in runner.run_all([b])] == ["cached", "cached"]
    runner = StageRunner(tmp_path, cfg, progress=False)
    assert [o.status for o in runner.run_all([b], force=["a"])] == ["ran", "cached"]

    # A changed input makes a new hash dir; garbage collection drops the old one.
    a2 = _stage("a", first, inputs={"v": 2})
    assert a2.hash != a.hash
    runner = StageRunner(tmp_path, cfg, progress=False)
    runner.run_all([a2])
    removed = runner.collect_garbage([a2])
    assert removed == [runner.stage_dir(a)]
    assert runner.is_done(a2)


def test_runner_refuses_a_second_concurrent_run(tmp_path):
    from scpdr.experiment import run_lock

    with run_lock(tmp_path), pytest.raises(ScpdrError, match="another `scpdr experiment`"):
        with run_lock(tmp_path):
            pass


# ----------------------------------------------------------------------------- CLI


def test_cli_help():
    from scpdr.cli import main

    assert main(["experiment", "--help"]) == 0
    assert main(["demo", "--help"]) == 0


def test_cli_config_error_exit_code(tmp_path, capsys):
    from scpdr.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(merged(tiny_dict(), {"train": {"epochs": 0}})))
    assert main(["experiment", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "train.epochs: must be > 0 (got 0)" in capsys.readouterr().err


def test_cli_dry_run_lists_stages(tmp_path, capsys):
    from scpdr.cli import main

    assert main(["experiment", str(TINY), "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "to run  partitions/names2ids" in out and "report" in out


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from scpdr.experiment import run_experiment

    out = tmp_path_factory.mktemp("tiny-run")
    return run_experiment(TINY, out, progress=False)


def test_tiny_experiment_produces_every_column_figure_and_file(tiny_run):
    res = tiny_run
    assert res.results_json.is_file() and res.report_md.is_file() and res.report_html.is_file()
    table = res.main_table
    cols = {(c.group, c.label) for c in table.columns}
    assert cols == {
        ("NAS", "Mean"),
        ("Canary", "Mean"),
        ("Canary", "95%"),
        ("PII", "AEL"),
        ("PII", "FER"),
        ("TTE", "AUC"),
        ("TTE", "ACC"),
        ("Utility", "ACC"),
    }
    # the config's methods (tiny: none, cp-delta, SCP-Δr-c/-b), its baseline, No CP-val and STE
    assert table.row_keys == [*load_config(TINY).all_methods, *methods.REFERENCE_METHODS]
    for key in table.row_keys[:-1]:  # every method row has a value in every column
        row = table.cells[table.row_keys.index(key)]
        assert all(c.value is not None for c in row[1:]), key
    for name in ("kx_hist", "tx_vx_hist", "exposure_vs_m", "tte_vs_epochs", "mia_roc_names2ids"):
        assert (res.out / "plots" / f"{name}.png").is_file(), name
    md = res.report_md.read_text()
    assert "Omitted" not in md and "## k_x bounds (99th percentile)" in md
    assert "Greedy continuations of training prompts" in md
    page = res.report_html.read_text()
    assert page.count("data:image/png;base64,") == 5
    rows = json.loads(res.results_json.read_text())
    assert {"method", "attack", "metric", "value"} <= set(rows[0])
    row_methods = {r["method"] for r in rows}
    assert {"scp-delta-r-b", "scp-delta-r-c", "none-val", "goldfish"} <= row_methods
    # Sweep rows are tagged and kept out of the main table.
    m_rows = [r for r in rows if r.get("sweep") == "m"]
    assert {r["sweep_value"] for r in m_rows} == {1, 100}
    assert {r["method"] for r in m_rows} == {"scp-delta-r-b"}
    kx = [r for r in rows if r["attack"] == "bounds" and r["metric"] == "k_x_p99"]
    assert {r["method"] for r in kx} == {"cp-delta", "scp-delta-r-c", "scp-delta-r-b"}


def test_tiny_experiment_cache_and_selective_rerun(tiny_run, tmp_path):
    from scpdr.experiment import run_experiment

    res = tiny_run
    again = run_experiment(TINY, res.out, progress=False)
    assert again.ran == [] and len(again.cached) == len(res.outcomes)
    assert json.loads(again.results_json.read_text()) == json.loads(res.results_json.read_text())

    # A changed setting re-runs only the stages that depend on it (here: the generations and
    # the report; test_plan_hashes_depend_only_on_relevant_settings covers m and training).
    changed = tmp_path / "tiny-gen.yaml"
    changed.write_text(
        yaml.safe_dump(merged(tiny_dict(), {"attacks": {"generations": {"max_new_tokens": 3}}}))
    )
    third = run_experiment(changed, res.out, progress=False)
    assert sorted(third.ran) == [
        "attack/names2ids/none/generations",
        "attack/names2ids/scp-delta-r-b/generations",
        "report",
    ]
    assert len(third.cached) == len(res.outcomes) - 3


def test_precision_is_part_of_the_evaluating_stages_hashes_only_where_it_changes_the_dtype():
    """``precision`` resolves where the plan is made: auto and fp32 load float32 on the CPU
    (the suite pins auto's decision to fp32), so their hashes are the default's; bf16 changes
    the attack, bounds and budget stages' hashes and nothing upstream; a bad value is refused."""
    base = validate_config(tiny_dict())
    keys = {s.key for s in plan(base)[0]}  # (sweep points share the main run's stage names)
    for same in ("auto", "fp32"):
        assert {s.key for s in plan(base.with_value("precision", same))[0]} == keys
    bf16 = plan(base.with_value("precision", "bf16"))[0]
    changed = [s for s in bf16 if s.key not in keys]
    assert changed and changed == [s for s in bf16 if s.kind in ("attack", "bounds")]
    assert all(s.inputs["dtype"] == "bfloat16" for s in changed)
    # on CUDA bf16 is the device's default and fp32 is not (planned without a GPU)
    cuda = base.with_value("device", "cuda")
    assert {s.key for s in plan(cuda.with_value("precision", "bf16"))[0]} == keys
    fp32 = [s for s in plan(cuda.with_value("precision", "fp32"))[0] if s.key not in keys]
    assert fp32 and all(s.inputs["dtype"] == "float32" for s in fp32)
    with pytest.raises(ConfigError, match="precision"):
        validate_config(merged(tiny_dict(), {"precision": "fp16"}))


def test_a_bf16_experiment_evaluates_bf16_models_over_the_cached_training(tiny_run, tmp_path):
    """``precision: bf16`` over a finished run's cache: only the evaluating stages and the
    report run again, and the bounds' per-position certificates come from bf16 models (they
    differ from the float32 run's)."""
    import shutil

    import numpy as np

    from scpdr.experiment import run_experiment
    from scpdr.experiment.stages_eval import DISTRIBUTIONS_NAME

    out = tmp_path / "run"
    shutil.copytree(tiny_run.out, out)
    cfg = tmp_path / "tiny-bf16.yaml"
    cfg.write_text(yaml.safe_dump(merged(tiny_dict(), {"precision": "bf16"})))
    res = run_experiment(cfg, out, progress=False)
    evaluating = {o.name for o in tiny_run.outcomes if o.name.startswith(("attack/", "bounds/"))}
    assert set(res.ran) == evaluating | {"report"}
    assert res.results_json.is_file()
    dist = {}
    for r in (tiny_run, res):
        (o,) = [o for o in r.outcomes if o.name.startswith("bounds/")]
        with np.load(o.dir / DISTRIBUTIONS_NAME) as z:
            dist[r is res] = {k: z[k] for k in z.files}
    assert dist[True].keys() == dist[False].keys()
    assert any(
        a.shape != b.shape or not np.array_equal(a, b)
        for a, b in ((dist[False][k], dist[True][k]) for k in dist[False])
    )


def test_scpdr_eval_gives_the_rows_of_the_experiments_attack_stages(tiny_run, tmp_path):
    """One evaluation pipeline: ``scpdr eval`` on the experiment's own bundle and partitions,
    with the experiment's settings (LiRA: its targets as members, its p0 as reference), gives
    exactly the rows of the experiment's attack stages."""
    from scpdr.attacks.evaluation import ATTACKS as PIPELINE_ATTACKS
    from scpdr.attacks.evaluation import smoothing_method
    from scpdr.attacks.mia import MIA_ATTACKS
    from scpdr.attacks.results import NO_CP_VAL
    from scpdr.experiment.sections import ATTACKS as EXPERIMENT_ATTACKS

    # the attacks an experiment runs (the own-data "secrets" attack is scpdr eval's only)
    ATTACKS = [a for a in PIPELINE_ATTACKS if a in EXPERIMENT_ATTACKS]
    from scpdr.cli import main
    from scpdr.data import load_partitions, save_records
    from scpdr.experiment import StageCache

    cfg = load_config(TINY)
    stages, _ = plan(cfg)
    stage = {}
    for s in stages:  # the main run's stages come first (sweep points share their names)
        stage.setdefault(s.name, s)
    cache = StageCache(tiny_run.out)
    bundle = cache.stage_dir(stage["bundle/names2ids"]) / "bundle"
    parts_dir = cache.stage_dir(stage["partitions/names2ids"])
    p0 = cache.stage_dir(stage["train/names2ids/ref"]) / "model"
    holdout = set(json.loads((parts_dir / "targets.json").read_text())["holdout"])
    pset = load_partitions(parts_dir / "partitions")
    members = save_records(
        tmp_path / "members.jsonl", [r for r in pset.parts[0] if r.id in holdout]
    )
    methods_ = ["none", smoothing_method("model")]
    out = tmp_path / "eval"
    argv = ["eval", str(bundle), "--data", str(parts_dir / "partitions"), "--out", str(out)]
    argv += ["--attacks", ",".join(ATTACKS), "--methods", ",".join(methods_)]
    argv += ["--corpus", "names2ids", "--reference", str(p0), "--members", str(members)]
    argv += ["--m", str(cfg.m), "--n-reference", str(cfg.attacks.canary.n_reference)]
    argv += ["--tte-n", str(cfg.attacks.tte.n), "--batch-size", str(cfg.attacks.batch_size)]
    assert main([*argv, "--seed", str(cfg.seed)]) == 0

    def canonical(rows):
        return sorted(json.dumps(r, sort_keys=True) for r in rows)

    got = json.loads((out / "results.json").read_text())
    row_attacks = {*ATTACKS, *MIA_ATTACKS} - {"mia"}  # the suite's rows name its six attacks
    want = [
        r
        for r in tiny_run.rows
        if r.get("sweep") is None
        and r["attack"] in row_attacks
        and r["method"] in (*methods_, NO_CP_VAL)
    ]
    assert {r["attack"] for r in want} == row_attacks
    assert {r["method"] for r in want} == {*methods_, NO_CP_VAL}
    assert canonical(got) == canonical(want)
    # and what `scpdr eval` writes beside the rows
    timings = json.loads((out / "timings.json").read_text())
    assert {(t["method"], t["attack"]) for t in timings} >= {
        (m, a) for m in methods_ for a in ATTACKS
    }
    assert all(t["seconds"] > 0 for t in timings)
    assert (out / "lira_roc.png").read_bytes()[:4] == b"\x89PNG"
    assert set(json.loads((out / "roc.json").read_text())["names2ids"]) == set(methods_)


def test_the_experiment_prepares_and_trains_with_the_librarys_one_config(tiny_run):
    """The seam to scpdr.data / scpdr.training: the partitions stage is
    ``prepare_partitions`` with the corpus's settings (the same manifest), and every model trains
    with the ``train:`` section as a TrainConfig, seeded by the top-level seed (the goldfish
    baseline with its fields added)."""
    from scpdr.data import GroupingConfig, load_partitions, prepare_partitions
    from scpdr.experiment import StageCache
    from scpdr.training import TRAIN_INFO, TrainConfig

    cfg = load_config(TINY)
    corpus = cfg.corpora[0]
    stages, _ = plan(cfg)
    stage = {}
    for s in stages:
        stage.setdefault(s.name, s)
    cache = StageCache(tiny_run.out)

    direct = prepare_partitions(
        corpus.resolved_source,
        k=cfg.partitions.k,
        seed=cfg.seed,
        n_train=corpus.n_train,
        n_val=corpus.n_val,
        grouping=GroupingConfig(),
        canaries=corpus.canaries,
    )
    got = load_partitions(cache.stage_dir(stage["partitions/names2ids"]) / "partitions")
    assert got.manifest.sha256() == direct.pset.manifest.sha256()

    def trained_with(name: str) -> TrainConfig:
        info = cache.stage_dir(stage[name]) / "model" / TRAIN_INFO
        return TrainConfig.model_validate(json.loads(info.read_text())["config"])

    want = cfg.train.model_copy(update={"seed": cfg.seed, "progress": False}).resolved()
    assert trained_with("train/names2ids/c0") == want
    assert trained_with("train/names2ids/c1") == want
    baseline = methods.GOLDFISH  # its stage: train/<corpus>/<row name>
    goldfish = cfg.baselines.goldfish
    assert goldfish is not None
    assert trained_with(f"train/names2ids/{baseline}") == want.model_copy(
        update={"goldfish": True, "goldfish_k": goldfish.k, "goldfish_h": goldfish.h}
    )


def test_demo_checks_on_hand_made_rows():
    from scpdr.commands.demo import demo_checks

    rows = [
        {"method": "none", "attack": "pii", "metric": "fer", "value": 0.75},
        {"method": "scp-delta-r-b", "attack": "pii", "metric": "fer", "value": 0.0},
        {"method": "none", "attack": "utility", "metric": "accuracy", "value": 0.500},
        {"method": "scp-delta-r-b", "attack": "utility", "metric": "accuracy", "value": 0.470},
        {
            "method": "scp-delta-r-b",
            "attack": "pii",
            "metric": "fer",
            "value": 0.9,
            "sweep": "m",
            "sweep_value": 1000,
        },
    ]
    lines = demo_checks(rows)
    assert len(lines) == 3
    assert lines[0].startswith("[green]✓") and "75%" in lines[0]
    assert lines[1].startswith("[green]✓") and "0%" in lines[1]  # the sweep row is ignored
    assert lines[2].startswith("[red]✗")  # 0.03 apart
    # CP-Fuse is CP-ΔKL at a fresh request's first step: their TTE within .05
    tte = [
        {"method": m, "attack": "tte", "metric": k, "value": v}
        for m, auc, acc in (("cp-fuse", 0.90, 0.70), ("cp-kl", 0.93, 0.74))
        for k, v in (("auc", auc), ("acc", acc))
    ]
    lines = demo_checks(rows + tte)
    assert len(lines) == 4 and lines[2].startswith("[green]✓") and "CP-Fuse" in lines[2]
    tte[1]["value"] = 0.80  # CP-Fuse's ACC .10 below: the whole-prefix protocol's symptom
    assert demo_checks(rows + tte)[2].startswith("[red]✗")


def test_missing_base_model_is_a_clear_error(tmp_path):
    from scpdr.experiment import run_experiment

    cfg = validate_config(merged(tiny_dict(), {"base": str(tmp_path / "no-model")}))
    with pytest.raises(ConfigError, match=r"base: model .* does not exist"):
        run_experiment(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
