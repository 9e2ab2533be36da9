"""The one method registry: every result-row name, its aggregation rule and how it is shown.

Layer 0 of scpdr (``docs/architecture.md``): it imports only :mod:`scpdr.errors`, and every other
table of methods (the rule a row runs, its base variant, its display label and colour, whether it
depends on m, the divergence its certificate ``k_x`` is stated in, whether it has ``v_x``, the
order of the paper's main table) derives from :data:`SPECS` (STYLE.md 5 and 17, after Opacus
``accountants/registry.py``).

Two kinds of names:

- **rules** (:data:`RULES`): what :func:`scpdr.naf.aggregate` and ``ProtectedLM(method=...)`` run:
  "none", "cp-delta" (Def. 2.2), "cp-kl" (Def. 2.4), "cp-fuse" (stateful, §5.1), "cp-delta-r"
  (Def. 2.6), "scp-delta-r" (Alg. 1), "scp-delta" (the ablation: CP-Δ over the smoothed
  constituents);
- **result rows** (:data:`SPECS`): what ``results.json``, the report and the CLI's ``--methods``
  name: a rule plus the base its smoothing uses ('b': the base model, 'c': a constant base vector,
  paper §5.1), the training-time baselines evaluated as one model ("goldfish"; "dp-eps1",
  "dp-eps8": one model trained with DP-SGD on all partitions together, what a user would deploy
  instead), a NAF rule over constituents trained another way ("scp-delta-r-b+dp8": SCP-Δr-b over
  constituents trained with DP-SGD at ε = 8), and the reference rows ("none-val": No CP on data
  no constituent saw; "ste": the paper's STE row).

:func:`resolve` maps a row name or an alias ("scp-delta-r" is SCP-Δr-b) to its :class:`MethodSpec`,
or raises the one error naming the known names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from scpdr.errors import ConfigError

__all__ = [
    "AGGREGATE_METHODS",
    "BASELINE_METHODS",
    "BOUND_METHODS",
    "DP_METHODS",
    "GOLDFISH",
    "MAIN_TABLE_METHODS",
    "METHOD_ORDER",
    "REFERENCE_METHODS",
    "RETRAINED_METHODS",
    "RULES",
    "SMOOTHED_RULES",
    "SPECS",
    "STATELESS_RULES",
    "V_X_RULES",
    "MethodSpec",
    "UnknownMethodError",
    "canonical",
    "kx_divergence",
    "label",
    "resolve",
    "rows",
]

Base = Literal["model", "constant"]
Kind = Literal["aggregate", "single", "retrained", "reference"]
Divergence = Literal["max", "kl", "relative-max"]


class UnknownMethodError(ConfigError):
    """A method name that is neither a result-row name nor an alias (a ``ConfigError``, so also a
    ``ValueError``)."""


@dataclass(frozen=True)
class MethodSpec:
    """One result-row name and everything derived from it.

    Attributes:
        name: the result-row name (``results.json``'s ``method``).
        rule: the aggregation rule it runs (a name of :data:`RULES`); "none" for single models.
        base: the smoothing base ('b' = "model", 'c' = "constant"), ``None`` without smoothing.
        label: display name in the paper's notation.
        color: the plot colour.
        kind: "aggregate" (a NAF rule over the K constituents, or No CP = constituent 0),
            "single" (a training-time baseline evaluated as one model), "retrained" (a NAF rule
            over K constituents trained another way: its own bundle) or "reference" (rows an
            attack adds for comparison, never requested as a method).
        main_order: position in the paper's main table (Table 3), ``None`` when not in it.
        aliases: other names :func:`resolve` accepts for it.
        dp_epsilon: the ε its models are trained to with DP-SGD (``scpdr.training.dp``), None
            for non-DP rows; a "single" DP row is one model on all partitions together.
    """

    name: str
    rule: str
    base: Base | None
    label: str
    color: str = "#7f7f7f"
    kind: Kind = "aggregate"
    main_order: int | None = None
    aliases: tuple[str, ...] = field(default=())
    dp_epsilon: float | None = None

    @property
    def smoothed(self) -> bool:
        """Whether its output depends on the smoothing level m (Alg. 1: the SCP rules)."""
        return self.rule in SMOOTHED_RULES

    @property
    def kx_divergence(self) -> Divergence | None:
        """The divergence its NAF bound ``k_x`` is stated in (Thm. 2.3, 2.5, 2.7; Lemma A.2);
        ``None`` for CP-Fuse (stateful: no per-position bound) and rows that are no rule."""
        return _KX_DIVERGENCE.get(self.rule) if self.kind != "reference" else None

    @property
    def has_v_x(self) -> bool:
        """Whether a LiRA bound ``v_x`` exists for it (Thm. 4.5, Remark 4.7)."""
        return self.kind == "aggregate" and self.rule in V_X_RULES

    @property
    def bounded(self) -> bool:
        """Whether per-position bounds (k_x, t_x) can be computed for it from its components."""
        return self.kind == "aggregate" and self.rule in STATELESS_RULES

    @property
    def needs_base_model(self) -> bool:
        return self.base == "model"

    @property
    def needs_constant_base(self) -> bool:
        return self.base == "constant"


#: Aggregation rules (what ``scpdr.naf.aggregate`` and ``ProtectedLM`` run).
RULES: tuple[str, ...] = (
    "none",
    "cp-delta",
    "cp-kl",
    "cp-fuse",
    "cp-delta-r",
    "scp-delta-r",
    "scp-delta",
)
#: Rules that are a function of one position's distributions (every rule but CP-Fuse).
STATELESS_RULES: frozenset[str] = frozenset(r for r in RULES if r != "cp-fuse")
#: Rules that smooth the constituents first (Alg. 1) and so depend on m and need a base.
SMOOTHED_RULES: frozenset[str] = frozenset({"scp-delta-r", "scp-delta"})
#: Rules with a LiRA bound ``v_x`` (Thm. 4.5 and Remark 4.7).
V_X_RULES: tuple[str, ...] = ("cp-delta", "cp-delta-r", "scp-delta-r")

_KX_DIVERGENCE: dict[str, Divergence] = {
    "none": "max",
    "cp-delta": "max",
    "scp-delta": "max",
    "cp-kl": "kl",
    "cp-delta-r": "relative-max",
    "scp-delta-r": "relative-max",
}


SPECS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        MethodSpec("none", "none", None, "No CP", "#444444", main_order=0),
        MethodSpec("cp-delta", "cp-delta", None, "CP-Δ", "#1f77b4", main_order=1),
        MethodSpec("cp-kl", "cp-kl", None, "CP-ΔKL", "#9467bd", main_order=2),
        MethodSpec("cp-fuse", "cp-fuse", None, "CP-Fuse", "#8c564b", main_order=3),
        MethodSpec("cp-delta-r", "cp-delta-r", None, "CP-Δr", "#ff7f0e", main_order=4),
        MethodSpec("scp-delta-r-c", "scp-delta-r", "constant", "SCP-Δr-c", "#17becf", main_order=5),
        MethodSpec(
            "scp-delta-r-b",
            "scp-delta-r",
            "model",
            "SCP-Δr-b",
            "#2ca02c",
            main_order=6,
            aliases=("scp-delta-r",),
        ),
        MethodSpec(
            "scp-delta", "scp-delta", "model", "SCP-Δ (raw)", "#e377c2", aliases=("scp-delta-b",)
        ),
        MethodSpec("scp-delta-c", "scp-delta", "constant", "SCP-Δ-c (raw)", "#f7b6d2"),
        MethodSpec("goldfish", "none", None, "Goldfish", "#bcbd22", kind="single"),
        MethodSpec("dp-eps1", "none", None, "DP (ε=1)", "#393b79", kind="single", dp_epsilon=1.0),
        MethodSpec("dp-eps8", "none", None, "DP (ε=8)", "#6b6ecf", kind="single", dp_epsilon=8.0),
        MethodSpec(
            "scp-delta-r-b+dp8",
            "scp-delta-r",
            "model",
            "SCP-Δr-b + DP (ε=8)",
            "#98df8a",
            kind="retrained",
            dp_epsilon=8.0,
        ),
        MethodSpec("none-val", "none", None, "No CP-val", "#999999", kind="reference"),
        MethodSpec("ste", "none", None, "STE", "#c7c7c7", kind="reference"),
    )
}
"""Every result-row name → its :class:`MethodSpec`, in the order of every table and plot."""

_ALIASES: dict[str, str] = {a: s.name for s in SPECS.values() for a in s.aliases}

#: The rows of the paper's main table (Table 3), in its order: an experiment's and ``scpdr eval``'s
#: default methods.
MAIN_TABLE_METHODS: tuple[str, ...] = tuple(
    sorted(
        (s.name for s in SPECS.values() if s.main_order is not None),
        key=lambda n: SPECS[n].main_order or 0,
    )
)
#: The order of method rows in every table and plot (methods not listed follow, sorted).
METHOD_ORDER: tuple[str, ...] = tuple(s.name for s in SPECS.values() if s.kind != "reference")
#: Rows a bundle computes by itself: every NAF rule over its K constituents (and No CP =
#: constituent 0), in table order. ``scpdr eval``'s and an experiment's requestable methods.
AGGREGATE_METHODS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.kind == "aggregate")
#: Training-time baselines: evaluated as a single model like No CP ("single"), or a NAF rule over
#: constituents trained another way ("retrained"). Their NAS is read on the scale the other rows
#: set (``scpdr.attacks.nas``).
BASELINE_METHODS: frozenset[str] = frozenset(
    s.name for s in SPECS.values() if s.kind in ("single", "retrained")
)
#: The goldfish-loss baseline (Hans et al. 2024): partition 0 trained with goldfish loss.
GOLDFISH: str = "goldfish"
#: Rows whose models are trained with DP-SGD, in table order (their ε: ``dp_epsilon``).
DP_METHODS: tuple[str, ...] = tuple(s.name for s in SPECS.values() if s.dp_epsilon is not None)
#: NAF rules over constituents trained another way (their own bundle).
RETRAINED_METHODS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.kind == "retrained")
#: Rows attacks add for comparison (never requested as methods).
REFERENCE_METHODS: tuple[str, ...] = tuple(s.name for s in SPECS.values() if s.kind == "reference")
#: Rows with per-position bounds (k_x, t_x; v_x where :attr:`MethodSpec.has_v_x`).
BOUND_METHODS: tuple[str, ...] = tuple(s.name for s in SPECS.values() if s.bounded)


def canonical(name: str) -> str:
    """The result-row name of ``name`` (itself, or what the alias stands for); no check."""
    return _ALIASES.get(name, name)


def resolve(name: str, *, allowed: Iterable[str] | None = None, what: str = "method") -> MethodSpec:
    """The :class:`MethodSpec` of a result-row name or alias.

    Args:
        name: e.g. "scp-delta-r-b" or its alias "scp-delta-r".
        allowed: restrict to these row names (e.g. :data:`BOUND_METHODS`); the error names them.
        what: how the error calls the thing ("method", "bound method", ...).

    Raises:
        UnknownMethodError: naming the known names (and aliases) and the one asked for.
    """
    key = canonical(name) if isinstance(name, str) else name
    names = tuple(SPECS) if allowed is None else tuple(canonical(a) for a in allowed)
    if key in names and key in SPECS:
        return SPECS[key]
    shown = [n for n in names if n in SPECS and SPECS[n].kind != "reference"] or list(names)
    aliases = [f"{a} (= {c})" for a, c in _ALIASES.items() if c in shown]
    known = ", ".join(shown) + (f"; aliases: {', '.join(aliases)}" if aliases else "")
    hint = ""
    if isinstance(name, str) and canonical(name) in SPECS and allowed is not None:
        hint = f" ({name!r} is a method, but not one this accepts)"
    raise UnknownMethodError(f"unknown {what} {name!r}{hint}; known: {known}")


def rows(names: Iterable[str] | None = None) -> list[MethodSpec]:
    """Specs of ``names`` (resolved, duplicates dropped, in the given order), default all
    requestable rows (every kind but "reference")."""
    if names is None:
        return [s for s in SPECS.values() if s.kind != "reference"]
    out: dict[str, MethodSpec] = {}
    for n in names:
        spec = resolve(n)
        out.setdefault(spec.name, spec)
    return list(out.values())


def label(name: str) -> str:
    """Display name of a result row (the name itself for rows not in the registry)."""
    spec = SPECS.get(canonical(name))
    return spec.label if spec is not None else name


def kx_divergence(rule: str) -> Divergence:
    """The divergence the NAF bound ``k_x`` of a stateless rule is stated in."""
    try:
        return _KX_DIVERGENCE[rule]
    except KeyError:
        raise UnknownMethodError(
            f"no NAF bound for rule {rule!r}; bounds exist for {', '.join(_KX_DIVERGENCE)} "
            "(cp-fuse is stateful and has no per-position NAF bound of its own)"
        ) from None
