"""run_eval skips an attack whose data is missing, with a log line naming what is missing."""

from __future__ import annotations

import logging

import pytest

from scpdr.attacks.evaluation import EvalData, run_eval
from scpdr.attacks.exposure import Canary
from scpdr.errors import ConfigError


class _Untouchable:
    """A scorer that fails if an attack reaches it: every attack here must be skipped first."""

    tokenizer = None
    name = "untouchable"

    def __getattr__(self, name: str):
        raise AssertionError(f"a skipped attack used the scorer ({name})")


def test_attacks_without_their_data_are_skipped_with_a_reason(caplog):
    # canaries without their candidate space cannot be scored either
    data = EvalData(canaries=[Canary("prefix", ("a", "b"), 1)], canary_space=None)
    with caplog.at_level(logging.INFO, logger="scpdr.attacks.evaluation"):
        rep = run_eval(
            {"none": _Untouchable(), "cp-delta": _Untouchable()},
            data,
            ["canary", "pii", "tte", "mia", "utility"],
        )
    assert rep.rows == [] and rep.timings == []
    text = caplog.text
    for line in (
        "canary: no canaries in the data, skipped",
        "pii: no Names2IDs records in the data, skipped",
        "tte: no training texts, skipped",
        "utility: no validation texts, skipped",
        "mia: no members or no non-members (auto population), skipped",
    ):
        assert line in text, line


def test_unknown_attack_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown attack\(s\) \['mi'\]; known: canary, pii"):
        run_eval({}, EvalData(), ["pii", "mi"])
