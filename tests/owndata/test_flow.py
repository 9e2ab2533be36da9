"""The own-data contract, end to end on a tiny base: train with secrets and groups → eval (table,
results.json with secrets rows, risk.jsonl) → export (no text, no secret: a byte search of every
file) → `scpdr serve` of the export, queried with the official openai client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ticket_data import tickets, write_jsonl

from scpdr import methods
from scpdr.attacks.secrets import COUNTERFACTUAL_METRICS
from scpdr.cli import main
from scpdr.data import load_partitions, secret_occurrences
from scpdr.data.user_data import DEFAULT_VAL_RULE, default_val_size
from scpdr.export import verify_export

SCP_B = methods.resolve("scp-delta-r").name
NO_CP = methods.MAIN_TABLE_METHODS[0]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    root = tmp_path_factory.mktemp("owndata")
    rows = tickets(28, seed=3, customers=12)
    data = write_jsonl(root / "tickets.jsonl", rows)
    bundle, evald, export = root / "B", root / "E", root / "D"
    argv = ["train", "--data", str(data), "--text-field", "text", "--secrets-field", "secrets"]
    argv += ["--group-field", "customer", "--partitions", "2", "--epochs", "3"]
    assert main([*argv, "--base", "tiny", "--out", str(bundle)]) == 0
    return {"root": root, "rows": rows, "B": bundle, "E": evald, "D": export}


def test_train_keeps_groups_and_secrets_in_one_partition(flow):
    pset = load_partitions(flow["B"] / "partitions")
    assert [(flow["B"] / "partitions" / f"partition-{i}.jsonl").is_file() for i in (0, 1)] == [
        True,
        True,
    ]
    where = {r.group: i for i, p in enumerate(pset.parts) for r in p}
    assert all(where[r.group] == i for i, p in enumerate(pset.parts) for r in p)
    assert not secret_occurrences(pset.parts)  # no declared secret in both partitions
    assert all(r.secrets for r in pset.records())
    info = json.loads((flow["B"] / "constituent-0" / "train_info.json").read_text())
    assert info["plan"]["warmup_steps"] <= 0.1 * info["plan"]["total_steps"]
    assert not info["plan"]["packing"]
    extra = json.loads((flow["B"] / "scpdr.json").read_text())["extra"]
    validation = extra["dataset"]["validation"]
    assert validation["rule"] == DEFAULT_VAL_RULE  # no --val-fraction: the default carve
    assert 0 < validation["records"] <= default_val_size(len(flow["rows"]))  # whole groups


def test_eval_prints_the_table_and_writes_secret_rows_and_risk_lines(flow, capsys):
    argv = ["eval", str(flow["B"]), "--out", str(flow["E"]), "--methods", f"{NO_CP},{SCP_B}"]
    assert main([*argv, "--tte-n", "4", "--lira-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "Main results" in out and "Records most at risk" in out and "Certificate" in out
    rows = json.loads((flow["E"] / "results.json").read_text())
    secrets = [r for r in rows if r["attack"] == "secrets"]
    for method in (NO_CP, SCP_B):
        got = {r["metric"]: r for r in secrets if r["method"] == method}
        assert set(got) == {"extracted", "fer", *COUNTERFACTUAL_METRICS}
        assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in got.values())
        assert got["fer_vs_counterfactual"]["test"] == "mcnemar-exact"
        assert 0.0 <= got["fer_vs_counterfactual"]["p_value"] <= 1.0
        assert got["memorized"]["n"] == got["fer"]["n"]
    # membership is shown, with its No CP-val row and what the non-members can resolve
    assert "Membership inference" in out
    mia = [
        r for r in rows if r["attack"] == "lira" and r["metric"] == "auc" and r["method"] == NO_CP
    ]
    non, mem = mia[0]["n_nonmembers"], mia[0]["n_members"]
    power = f"members {mem} / non-members {non}; the smallest FPR {non} non-members can resolve"
    report_md = (flow["E"] / "report.md").read_text()
    assert power in out and power in report_md and "## Membership inference" in report_md
    assert non < 100 and "TPR@1% cannot be resolved" in report_md
    assert "memorized" in out and "guessable" in out  # the paragraphs tell the two apart
    lines = [json.loads(x) for x in (flow["E"] / "risk.jsonl").read_text().splitlines()]
    assert lines and all({"record", "partition", "method", "extracted"} <= set(x) for x in lines)
    assert all(isinstance(x["counterfactual_whole"], bool) for x in lines)
    assert all(0.0 <= x["counterfactual_extracted"] <= 1.0 for x in lines)
    assert all(0 <= x["memorized"] <= x["secrets_whole"] for x in lines)
    assert "Guessable" in out
    assert {x["method"] for x in lines} == {NO_CP, SCP_B}
    assert all(x["ref"] is not None for x in lines)  # the ref MIA score vs the base model
    secrets_text = {s for r in flow["rows"] for s in r["secrets"]}
    report = (flow["E"] / "risk.jsonl").read_text() + (flow["E"] / "report.md").read_text()
    assert not any(s in report for s in secrets_text)


def test_eval_shows_membership_with_its_no_cp_val_row_and_power(flow, capsys):
    # 2 members and 2 non-members leave validation records no model saw: the null row
    out_dir = flow["root"] / "mia"
    argv = ["eval", str(flow["B"]), "--out", str(out_dir), "--methods", f"{NO_CP},{SCP_B}"]
    assert main([*argv, "--attacks", "mia", "--lira-n", "2"]) == 0
    out = capsys.readouterr().out
    rows = json.loads((out_dir / "results.json").read_text())
    assert any(r["method"] == "none-val" and r["attack"] == "loss" for r in rows)
    report_md = (out_dir / "report.md").read_text()
    table = report_md.split("## Membership inference")[1].split("##")[0]
    assert "| No CP-val |" in table and "| SCP-Δr-b |" in table and "| No CP |" in table
    assert "LOSS" in table and "Ref (base)" in table and "LiRA (p0)" in table
    power = "members 2 / non-members 2; the smallest FPR 2 non-members can resolve is 1/2"
    assert power in out and power in table
    assert "Warning: fewer than 100 non-members" in table
    console = out.split("Membership inference")[1]
    assert "No CP-val" in console.split("ROC AUC and TPR")[0]  # a row of the printed table


def test_eval_budgets_sweeps_the_serving_modes_and_names_an_operating_point(flow, capsys):
    out_dir = flow["root"] / "budgets"
    argv = ["eval", str(flow["B"]), "--out", str(out_dir), "--methods", f"{NO_CP},{SCP_B}"]
    argv += ["--attacks", "utility", "--lira-n", "4", "--budgets", "1,inf", "--on-budget", "base"]
    assert main([*argv, "--anchor", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = json.loads((out_dir / "results.json").read_text())
    swept = [r for r in rows if r["attack"] == "budget"]
    settings = {(r["mode"], r.get("budget"), r.get("anchor")) for r in swept}
    assert {("stop", 1.0, None), ("fallback", 1.0, None), ("anchor", None, 0.5)} <= settings
    assert all(r["method"] == SCP_B for r in swept)  # No CP has no certificate to budget
    tests = ("loss", "zlib", "min-k", "min-k++", "ref", "lira", "rmia")  # every test, each setting
    for mode, budget, anchor in settings:
        here = {
            r["metric"]
            for r in swept
            if (r["mode"], r.get("budget"), r.get("anchor")) == (mode, budget, anchor)
        }
        assert {f"{t}_tpr@0.01fpr" for t in tests} | {"accuracy", "private_fraction"} <= here
    tpr = [r for r in swept if r["metric"].endswith("_tpr@0.01fpr")]
    assert tpr and all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in tpr)
    assert any(r["method"] == "none-val" and r["metric"] == "auc" for r in rows)  # mia added
    # one operating point, printed and in report.md, with the flags that deploy it
    (line,) = [ln for ln in out.splitlines() if "scpdr serve" in ln and "--method" in ln]
    assert f"--method {SCP_B}" in line
    assert ("--on-budget" in line) or ("--anchor" in line) or ("--budget" in line)
    assert line.strip() in " ".join((out_dir / "report.md").read_text().split())


@pytest.mark.parametrize(
    ("flag", "value"), [("--budgets", "2,x"), ("--budgets", "-1"), ("--anchor", "inf")]
)
def test_eval_budget_grids_are_checked_before_any_model_loads(flow, capsys, flag, value):
    argv = ["eval", str(flow["B"]), "--out", str(flow["root"] / "bad"), flag, value]
    assert main(argv) != 0
    assert flag in capsys.readouterr().err
    assert not (flow["root"] / "bad" / "results.json").exists()


def test_an_m_sweep_runs_the_smoothed_methods_at_each_m(flow, capsys):
    out = flow["root"] / "sweep"
    argv = ["eval", str(flow["B"]), "--out", str(out), "--methods", f"{NO_CP},{SCP_B}"]
    assert main([*argv, "--attacks", "secrets,utility", "--m", "1,3"]) == 0
    assert "Choosing m" in capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())
    assert {r["m"] for r in rows if r["method"] == SCP_B} == {1, 3}
    assert all("m" not in r for r in rows if r["method"] == NO_CP)  # not smoothed: run once
    # the bundle's m (10) is not swept: the main table runs at the first m, the rest are sweeps
    assert all(r.get("sweep") is None for r in rows if r.get("m") == 1)
    assert all(r.get("sweep") == "m" for r in rows if r.get("m") == 3)


def test_export_has_no_training_text_or_secret(flow):
    assert main(["export", str(flow["B"]), "--out", str(flow["D"])]) == 0
    assert verify_export(flow["D"]) == []
    needles = {r["text"] for r in flow["rows"]} | {s for r in flow["rows"] for s in r["secrets"]}
    needles = [n.encode() for n in needles]
    files = [p for p in flow["D"].rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    for p in files:  # every byte of every file, weights included
        blob = p.read_bytes()
        assert not any(n in blob for n in needles), p
    assert not (flow["D"] / "partitions").exists()
    assert oct(flow["D"].stat().st_mode & 0o777) == "0o750"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_export_serves_openai_chat(flow):
    import openai

    if not (flow["D"] / "scpdr.json").exists():
        assert main(["export", str(flow["B"]), "--out", str(flow["D"])]) == 0
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scpdr", "serve", str(flow["D"]), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                models = client.models.list().data
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        out = client.chat.completions.create(
            model=models[0].id,
            messages=[{"role": "user", "content": "My account number is"}],
            max_tokens=6,
            temperature=0,
        )
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].finish_reason in ("length", "stop")
        assert "naf" in out.choices[0].model_extra
    finally:
        proc.terminate()
        proc.wait(30)
