"""``scpdr experiment --executor ray`` on a real local Ray cluster (CPU, one per module): a killed
run resumes from the stage cache without re-running a finished stage, and its ``results.json``
has the same values as the local executor's (one test: a separate whole run on Ray took another
~3 min of the suite on a slow CI host and checked nothing the resumed run does not)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module: 2 CPUs, no dashboard; its GCS address."""
    if ray.is_initialized():  # pragma: no cover - another module left one running
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory):
    """``results.json`` of configs/tiny.yaml under the local executor."""
    from scpdr.experiment import run_experiment

    out = tmp_path_factory.mktemp("tiny-local")
    return json.loads(run_experiment(TINY, out, progress=False).results_json.read_text())


def _same_rows(a: list[dict], b: list[dict]) -> None:
    """Equal rows: the same keys and strings, numbers equal up to the last bits (a Ray worker
    sums in another order when its thread count differs)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert math.isclose(x[k], y[k], rel_tol=1e-6, abs_tol=1e-9), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


def _markers(out: Path) -> dict[str, str]:
    """The finished stages under ``out``: marker path → its content (written once, when the
    stage finished: a re-run stage would rewrite it). A marker still in a ``.partial`` dir (the
    run was killed before the rename) is no finished stage. A running experiment renames its
    ``.partial`` dirs while this walks them: a walk that meets a vanished path starts again."""
    while True:
        markers = (out / "stages").rglob("_stage.json") if (out / "stages").is_dir() else ()
        try:
            return {
                str(p.relative_to(out)): p.read_text()
                for p in markers
                if not p.parent.name.endswith(".partial")
            }
        except FileNotFoundError:  # a stage finished (renamed its dir) mid-walk
            continue


def test_a_killed_ray_run_resumes_without_rerunning_finished_stages(cluster, local_rows, tmp_path):
    """`python -m scpdr experiment --executor ray --address ...` is killed after some stages
    finished; the next run (through ``make_executor("ray")`` on the same cluster) reports them
    cached (their markers untouched) and finishes the rest: every stage ran on Ray, once, and
    ``results.json`` equals the local executor's."""
    from scpdr.experiment import make_executor, run_experiment

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "scpdr", "experiment", str(TINY), "--out", str(out)]
    cmd += ["--executor", "ray", "--address", cluster, "--no-progress"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(_markers(out)) < 6:
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no 6 stages finished in 300 s"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the cluster kills the dead driver's tasks: wait until their CPUs are free again (a task
    # may still finish its stage until then)
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, "the killed run's tasks did not stop"
        time.sleep(0.2)
    before = _markers(out)
    assert not (out / "results.json").exists()

    result = run_experiment(
        TINY, out, progress=False, executor=make_executor("ray", address=cluster)
    )
    after = _markers(out)
    finished_before = {str(Path(m).parent.relative_to("stages")) for m in before}
    by_dir = {str(o.dir.relative_to(out / "stages")): o.status for o in result.outcomes}
    assert {by_dir[d] for d in finished_before} == {"cached"}
    assert all(after[m] == before[m] for m in before)  # never re-run: markers unchanged
    assert result.ran and len(result.ran) + len(before) == len(result.outcomes)
    _same_rows(json.loads(result.results_json.read_text()), local_rows)
    assert ray.is_initialized()  # a cluster the executor connected to keeps running


def test_unknown_executor_and_address_without_ray_are_errors():
    from scpdr.errors import ConfigError
    from scpdr.experiment import make_executor

    with pytest.raises(ConfigError, match="must be one of local, ray"):
        make_executor("dask")
    with pytest.raises(ConfigError, match="--executor ray"):
        make_executor("local", address="auto")


def test_a_ray_run_rejects_a_pinned_gpu(cluster, tmp_path, monkeypatch):
    """Under Ray every task gets its own GPU: `device: cuda:1` (or SCPDR_DEVICE=cuda:1 with no
    device: in the config) is an error before any stage."""
    from scpdr.errors import ConfigError
    from scpdr.experiment import load_config, make_executor, run_experiment

    cfg = load_config(TINY).model_copy(update={"device": "cuda:1"})
    with pytest.raises(ConfigError, match="use device: cuda"):
        run_experiment(cfg, tmp_path, progress=False, executor=make_executor("ray"))
    monkeypatch.setenv("SCPDR_DEVICE", "cuda:1")
    cfg = load_config(TINY).model_copy(update={"device": None})
    with pytest.raises(ConfigError, match=r"SCPDR_DEVICE cuda:1 pins one GPU.*SCPDR_DEVICE=cuda"):
        run_experiment(cfg, tmp_path, progress=False, executor=make_executor("ray"))
    assert not (tmp_path / "stages").exists()
