"""The attacks on real ProtectedLMs over a tiny bundle (real tokenizer, random tiny models) and the
CLI commands end to end: padding invariance, agreement with the runtime's own certificates, every
attack producing well-formed rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scpdr import methods
from scpdr.attacks.bounds_analysis import bound_distributions
from scpdr.attacks.evaluation import EvalData, EvalOptions, load_scorers, run_eval, smoothing_method
from scpdr.attacks.mia import MIA_ATTACKS, MIA_METRICS
from scpdr.attacks.results import NO_CP_VAL, load_results
from scpdr.attacks.scorer import (
    batched_greedy,
    batched_next_token,
    batched_token_logprobs,
    encode,
)
from scpdr.cli import main

SCP_B, SCP_C = smoothing_method("model"), smoothing_method("constant")
# No CP, CP-Δr and both SCP-Δr variants: the rules whose bounds and leakage differ most
METHODS = [
    m for m in methods.MAIN_TABLE_METHODS if methods.SPECS[m].rule in ("none", "cp-delta-r")
] + [SCP_B, SCP_C]


@pytest.fixture(scope="module")
def world(attack_world):
    scorers = load_scorers(attack_world["bundle"], METHODS)
    return {
        **attack_world,
        "scorers": scorers,
        "reference_of": scorers.reference_of,
        "q": scorers.q,
    }


TEXTS = [
    "Name: Ada Lovelace, ID: 0123456789",
    "The secret words are: alpha beta",
    "def f(x): return x",
]


def test_batching_and_padding_do_not_change_scores(world):
    sc = world["scorers"][SCP_B]
    seqs = [encode(sc.tokenizer, t) for t in TEXTS]
    one = batched_token_logprobs(sc, seqs, batch_size=1)
    many = batched_token_logprobs(sc, seqs, batch_size=3)
    for a, b in zip(one, many, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    ids1, lp1 = batched_next_token(sc, seqs, batch_size=1)
    ids3, lp3 = batched_next_token(sc, seqs, batch_size=3)
    assert ids1.tolist() == ids3.tolist()
    torch.testing.assert_close(lp1, lp3, rtol=1e-4, atol=1e-4)
    # the greedy path agrees with the runtime's own argmax and with the true-token scores
    g = batched_greedy(sc, seqs, batch_size=3)
    for s, (g_ids, g_lp, tl), ref in zip(seqs, g, one, strict=True):
        out = sc.score(torch.tensor([s]), greedy=True)
        assert g_ids.tolist() == out.greedy[0].tolist()
        torch.testing.assert_close(tl, ref, rtol=1e-4, atol=1e-4)
        assert (g_lp >= tl - 1e-5).all()


def test_bound_distributions_match_the_runtime_certificates(world):
    sc = {name: world["scorers"][name] for name in ("cp-delta-r", SCP_B, SCP_C)}
    comp_scorer = sc[SCP_B]  # runs the constituents and the base model
    seqs = [encode(comp_scorer.tokenizer, t) for t in TEXTS]
    dist = bound_distributions(
        comp_scorer,
        seqs,
        methods=list(sc),
        ref_scorer=world["q"],
        base_vector=sc[SCP_C].base_vector,
        batch_size=2,
    )
    for name, scorer in sc.items():
        want = []
        for s in sorted(seqs, key=len):  # bound_distributions visits sequences by length
            want.append(scorer.score(torch.tensor([s]), k_x=True).k_x[0])
        np.testing.assert_allclose(
            dist.values["k_x"][name], torch.cat(want).numpy(), rtol=1e-3, atol=1e-5
        )
    # SCP smooths the RPDs: its k_x is far below CP-Δr's on the same positions
    assert np.percentile(dist.values["k_x"][SCP_B], 99) < np.percentile(
        dist.values["k_x"]["cp-delta-r"], 99
    )
    assert set(dist.values["v_x"]) == set(sc)
    rows = dist.rows(corpus="toy")
    assert any(r.metric == "k_x_p99" and r.method == SCP_C for r in rows)


def test_every_attack_runs_on_protected_scorers(world):
    data = EvalData.from_partitions(world["parts"])
    assert data.corpus == "names2ids" and data.pii and data.pii_val
    assert {c.repetitions for c in data.canaries} == {0, 3}
    opts = EvalOptions(
        n_reference=100,
        batch_size=8,
        tte_n=2,
        tte_max_tokens=16,
        tte_q_fails=True,
        lira_n=2,
        lira_max_tokens=16,
        utility_n=2,
        utility_max_tokens=16,
    )
    scorers = {m: world["scorers"][m] for m in ("none", SCP_B)}
    rep = run_eval(
        scorers,
        data,
        ["pii", "tte", "lira", "utility"],
        options=opts,
        reference=world["reference_of"],
        q_scorer=world["q"],
        base=world["scorers"].base,
    )
    # the canary attack scores n_reference candidates per prefix: once, on the cheapest scorer
    can = run_eval({"none": scorers["none"]}, data, ["canary"], options=opts)
    rep.rows += can.rows
    rep.timings += can.timings
    got = {(r.method, r.attack, r.metric) for r in rep.rows}
    assert {("none", "canary", "exposure_p95"), (NO_CP_VAL, "canary", "exposure_p95")} <= got
    # the never-inserted canaries are No CP-val's rows (repetitions 0), no other method's
    assert not any(r.metric.startswith("baseline_") for r in rep.rows)
    val = [r for r in rep.rows if r.method == NO_CP_VAL and r.attack == "canary"]
    assert {r.extra["repetitions"] for r in val} == {0}
    for m in ("none", SCP_B):
        for attack, metric in [
            ("pii", "ael"),
            ("pii", "fer"),
            ("tte", "auc"),
            ("tte", "acc_q_fails"),
            *((a, mt) for a in MIA_ATTACKS for mt in MIA_METRICS),
            ("utility", "nll"),
        ]:
            assert (m, attack, metric) in got, (m, attack, metric)
    for attack, metric in [("pii", "ael"), ("canary", "exposure_mean"), ("tte", "auc")]:
        assert (NO_CP_VAL, attack, metric) in got
    # No CP-val of the MIA suite: No CP on validation names no model saw, as members
    assert {(NO_CP_VAL, a, "auc") for a in MIA_ATTACKS} <= got
    for r in rep.rows:
        assert r.value is not None and (np.isfinite(r.value) or r.attack == "tte")
        d = r.to_dict()
        if r.metric in ("exposure_mean", "ael", "fer", "auc", "acc", "accuracy", "tpr@0.01fpr"):
            assert {"ci_low", "ci_high"} <= set(d), (r.method, r.attack, r.metric)
        if r.attack in MIA_ATTACKS:
            assert d["population"] == "records" and d["n_nonmembers"] == 2
    # "lira" is the suite's older name: it ran as "mia"
    assert {t["attack"] for t in rep.timings} == {"canary", "pii", "tte", "mia", "utility"}
    assert set(rep.roc_curves()) == {"none", SCP_B, NO_CP_VAL}
    assert set(rep.mia["none"].curves()) == set(MIA_ATTACKS)


@pytest.mark.parametrize("cmd", ["eval", "bounds", "prop-bounds"])
def test_help(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    assert "--out" in capsys.readouterr().out


def test_eval_cli_refuses_an_unknown_attack(world, tmp_path):
    # `scpdr eval` end to end: tests/test_experiment.py runs it on the tiny experiment's bundle
    out = tmp_path / "ev"
    assert main(["eval", str(world["bundle"]), "--out", str(out), "--attacks", "nope"]) == 2
    assert not out.exists()


def test_bounds_cli(world, tmp_path):
    out = tmp_path / "bd"
    ref = str(world["bundle"] / "constituent-1")
    rc = main(
        [
            "bounds",
            str(world["bundle"]),
            "--data",
            str(world["parts"]),
            "--out",
            str(out),
            "--reference",
            ref,
            "--n",
            "2",
            "--max-tokens",
            "16",
            "--methods",
            "cp-delta,cp-delta-r,scp-delta-r-b,scp-delta-r-c",
        ]
    )
    assert rc == 0
    dists = json.loads((out / "distributions.json").read_text())["names2ids"]
    assert {"k_x", "t_x", "v_x", "k_x_rare", "v_x_rare"} <= set(dists)
    assert len(dists["v_x_rare"][SCP_B]) > 0
    metrics = {r.metric for r in load_results(out / "results.json")}
    assert {"k_x_p99", "v_x_rare_p99"} <= metrics
    assert (out / "bounds_hist.png").stat().st_size > 0


def test_prop_bounds_cli(tmp_path):
    rc = main(
        [
            "prop-bounds",
            "--out",
            str(tmp_path),
            "--n",
            "400",
            "--m",
            "5",
            "--trials",
            "4",
            "--p1",
            "0.2,0.8",
        ]
    )
    assert rc == 0
    d = json.loads((tmp_path / "prop_bounds.json").read_text())
    assert d["p1_values"] == [0.2, 0.8] and set(d["schemes"]) == {
        "uniform",
        "smoothed",
        "maybe_smoothed",
        "not_smoothed",
    }
    assert (tmp_path / "prop_bounds.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_default_methods_skip_what_the_bundle_cannot_run(world, tmp_path, caplog):
    """A bundle without a constant base vector: the default methods run without the '-c'
    variant (and say so) instead of failing; asking for it explicitly is still an error."""
    from scpdr import models

    src = models.read_bundle(world["bundle"])
    plain = models.write_bundle(
        tmp_path / "plain",
        base=models.resolve_ref(world["bundle"], src.base),
        constituents=[models.resolve_ref(world["bundle"], c) for c in src.constituents],
    )
    out = tmp_path / "ev"
    args = ["eval", str(plain), "--data", str(world["parts"]), "--attacks", "utility"]
    with caplog.at_level("WARNING"):
        rc = main([*args, "--out", str(out), "--utility-n", "2", "--max-tokens", "8"])
    assert rc == 0
    methods = {r.method for r in load_results(out / "results.json")}
    assert SCP_B in methods and SCP_C not in methods
    assert SCP_C in caplog.text
    assert main([*args, "--out", str(tmp_path / "ev2"), "--methods", SCP_C]) != 0
