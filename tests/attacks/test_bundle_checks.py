"""The bundle checks shared by ``scpdr eval``, ``scpdr bounds`` and the experiment (scpdr.attacks.bundle_scorers)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from scpdr.attacks.evaluation import bundle_bases, bundle_data_dir, check_attacks
from scpdr.errors import ConfigError


def _manifest(*, base=None, constant_base=None, partitions=None):
    extra = {} if partitions is None else {"partitions": partitions}
    return SimpleNamespace(base=base, constant_base=constant_base, extra=extra)


def test_bundle_data_dir_is_data_else_the_manifests_partitions(tmp_path):
    assert bundle_data_dir(tmp_path, _manifest(partitions="p"), tmp_path / "d") == tmp_path / "d"
    assert bundle_data_dir(tmp_path, _manifest(partitions="p")) == tmp_path / "p"
    assert bundle_data_dir(str(tmp_path), _manifest(partitions="p"), None) == Path(tmp_path, "p")
    with pytest.raises(ConfigError, match=r"no extra.partitions\); pass --data DIR"):
        bundle_data_dir(tmp_path, _manifest())
    with pytest.raises(ConfigError, match="pass --prompts FILE or --data DIR"):
        bundle_data_dir(tmp_path, _manifest(), instead="--prompts FILE or ")


def test_bundle_bases_names_the_missing_base(tmp_path):
    assert bundle_bases(tmp_path, _manifest(base="base"), ["model", None]) is None
    assert bundle_bases(tmp_path, _manifest(), [None]) is None
    with pytest.raises(ConfigError, match="has no base model: drop the '-b' methods"):
        bundle_bases(tmp_path, _manifest(), [None, "model"])
    with pytest.raises(ConfigError, match="no constant base vector: drop the '-c' methods"):
        bundle_bases(tmp_path, _manifest(base="base"), ["constant"])


def test_check_attacks():
    # "lira" is the MIA suite's older name: it resolves to "mia", once
    assert check_attacks(["canary", "lira", "pii", "mia"]) == ["canary", "mia", "pii"]
    with pytest.raises(
        ConfigError, match=r"\['x'\]; known: canary, pii, tte, mia, utility, secrets, lira"
    ):
        check_attacks(["pii", "x"])
