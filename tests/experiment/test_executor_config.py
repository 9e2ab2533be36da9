"""The config and CLI side of the executors: ``resources:`` per stage kind, ``device:``, and
``--executor`` / ``--address`` (no Ray cluster is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scpdr.errors import ConfigError
from scpdr.experiment import STAGE_VERSIONS, load_config, validate_config
from scpdr.experiment.sections import STAGE_KINDS

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def _tiny(**patch):
    return validate_config({**load_config(TINY).model_dump(), **patch})


def test_resources_are_requested_per_stage_kind():
    assert set(STAGE_KINDS) == set(STAGE_VERSIONS)  # every kind of stage the cache knows
    cfg = _tiny(resources={"train": {"num_gpus": 1}, "attack": {"num_gpus": 0.5, "num_cpus": 2}})
    assert cfg.resource_request("train").ray_options() == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert cfg.resource_request("attack").ray_options() == {"num_cpus": 2.0, "num_gpus": 0.5}
    # a kind left out asks for one CPU
    assert cfg.resource_request("report").ray_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    big = _tiny(resources={"train": {"memory": 2**30, "resources": {"a100": 1}}})
    assert big.resource_request("train").ray_options()["resources"] == {"a100": 1.0}


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"resources": {"trian": {"num_gpus": 1}}}, "unknown stage kind(s) ['trian']"),
        ({"resources": {"train": {"num_gpu": 1}}}, "resources.train.num_gpu: unknown key"),
        ({"resources": {"train": {"num_gpus": -1}}}, "resources.train.num_gpus: must be ≥ 0"),
        ({"device": "tpu"}, "device: must be cpu, cuda or cuda:N"),
        ({"device": "cuda:x"}, "device: must be cpu, cuda or cuda:N"),
    ],
)
def test_bad_resources_and_devices_name_the_key(patch, message):
    with pytest.raises(ConfigError) as err:
        _tiny(**patch)
    assert message in str(err.value)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:1"])
def test_device_and_resources_leave_the_stage_hashes_alone(device):
    """Where a stage runs is not what it computes: a run resumes on other hardware."""
    from scpdr.experiment import plan

    base = [s.hash for s in plan(load_config(TINY))[0]]
    moved = _tiny(device=device, resources={"train": {"num_gpus": 1}})
    assert [s.hash for s in plan(moved)[0]] == base


def test_cli_rejects_an_unknown_executor_and_a_stray_address(tmp_path, capsys):
    from scpdr.cli import main

    assert main(["experiment", str(TINY), "--out", str(tmp_path), "--executor", "dask"]) == 2
    assert "must be one of local, ray" in capsys.readouterr().err
    assert main(["experiment", str(TINY), "--out", str(tmp_path), "--address", "auto"]) == 2
    assert "--executor ray" in capsys.readouterr().err
    assert not (tmp_path / "stages").exists()


def test_cli_dry_run_with_the_ray_executor_starts_nothing(tmp_path, capsys):
    pytest.importorskip("ray")
    from scpdr.cli import main

    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(yaml.safe_dump({"extends": str(TINY), "resources": {"train": {"num_gpus": 1}}}))
    assert (
        main(
            ["experiment", str(cfg), "--out", str(tmp_path / "o"), "--executor", "ray", "--dry-run"]
        )
        == 0
    )
    assert "train/names2ids/c0" in capsys.readouterr().out
    import ray

    assert not ray.is_initialized()
