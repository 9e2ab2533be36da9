"""The one method registry (``scpdr.methods``): names, aliases, the main table and the error."""

from __future__ import annotations

import pytest

from scpdr import methods, naf
from scpdr.errors import ConfigError


def test_main_table_is_the_papers_table_3_in_order():
    # Table 3 of the paper: No CP, CP-Δ, CP-ΔKL, CP-Fuse, CP-Δr, SCP-Δr-c, SCP-Δr-b.
    labels = [methods.label(n) for n in methods.MAIN_TABLE_METHODS]
    assert labels == ["No CP", "CP-Δ", "CP-ΔKL", "CP-Fuse", "CP-Δr", "SCP-Δr-c", "SCP-Δr-b"]


@pytest.mark.parametrize("spec", list(methods.SPECS.values()), ids=lambda s: s.name)
def test_every_row_runs_a_known_rule_and_resolves_to_itself(spec):
    assert spec.rule in methods.RULES
    assert methods.resolve(spec.name) is spec
    for alias in spec.aliases:
        assert methods.resolve(alias) is spec
        assert alias not in methods.SPECS  # an alias never shadows a row
    # a smoothed rule needs a base to smooth towards, an unsmoothed one has none
    assert (spec.base is not None) == spec.smoothed


def test_rules_are_the_naf_registry_plus_the_stateful_cp_fuse():
    assert set(methods.STATELESS_RULES) == set(naf.METHODS)
    assert set(methods.RULES) == set(naf.METHODS) | {"cp-fuse"}


def test_bounds_cover_every_stateless_rule_and_no_stateful_one():
    for spec in methods.SPECS.values():
        if spec.kind == "aggregate":
            assert spec.bounded == (spec.rule != "cp-fuse")
            assert (spec.kx_divergence is None) == (spec.rule == "cp-fuse")
    assert "cp-fuse" not in methods.BOUND_METHODS


def test_the_scp_delta_r_alias_is_the_b_variant():
    spec = methods.resolve("scp-delta-r")
    assert (spec.rule, spec.base, spec.label) == ("scp-delta-r", "model", "SCP-Δr-b")


@pytest.mark.parametrize("bad", ["scp-delta-rb", "", "CP-DELTA", "cp_fuse"])
def test_unknown_names_get_one_clear_error(bad):
    with pytest.raises(ConfigError) as info:
        methods.resolve(bad)
    msg = str(info.value)
    assert repr(bad) in msg and "known:" in msg
    for name in methods.MAIN_TABLE_METHODS:
        assert name in msg
    assert isinstance(info.value, ValueError)


def test_restricted_resolution_names_what_is_accepted():
    with pytest.raises(ConfigError, match="not one this accepts"):
        methods.resolve("cp-fuse", allowed=methods.BOUND_METHODS, what="bound method")
    assert methods.resolve("scp-delta-r", allowed=methods.BOUND_METHODS).name in (
        methods.BOUND_METHODS
    )


def test_rows_resolves_and_dedups_in_order():
    got = [s.name for s in methods.rows(["cp-kl", "scp-delta-r", methods.MAIN_TABLE_METHODS[-1]])]
    assert got == ["cp-kl", methods.MAIN_TABLE_METHODS[-1]]
    assert all(s.kind != "reference" for s in methods.rows())
