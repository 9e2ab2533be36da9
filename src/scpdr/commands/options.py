"""Command-line options generated from the library's config models (STYLE.md 17, after TRL
building its CLI and configs from the same dataclasses): one source for each option's name,
help text, default and bounds.

:func:`with_options` adds one typer option per field of a pydantic model to a command; the
command receives the values the user gave as one dict (``dest``), and builds the model from it
(:func:`build`), so the model validates every value once, with its own bounds, and an error
names the option. Option groups shared by several commands (the field mapping of user data, the
near-duplicate grouping, the canaries) are defined here once.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from scpdr.data.canaries import CanaryConfig
from scpdr.data.grouping import GroupingConfig
from scpdr.data.records import FieldMapping
from scpdr.data.secrets import SecretsConfig
from scpdr.errors import ConfigError, format_validation_error
from scpdr.training.config import TrainConfig

__all__ = [
    "CANARY_OPTIONS",
    "FIELD_OPTIONS",
    "GROUPING_OPTIONS",
    "SECRET_OPTIONS",
    "TRAIN_OPTIONS",
    "OptionGroup",
    "bounds_text",
    "build",
    "canary_config",
    "parse_repetitions",
    "with_options",
]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class OptionGroup:
    """Options generated from ``model``'s fields.

    Attributes:
        model: the pydantic model whose fields become options.
        dest: the command's keyword argument that receives ``{field: value}`` for the options
            the user gave (unset options are left out, so the model's defaults apply).
        what: what the group configures, for error messages ("training options").
        include: the fields that become options (default: all but ``exclude``).
        exclude: fields left out (e.g. set from another option).
        flags: ``{field: (flag, alias, ...)}``; default ``--field-name``.
        default_text: ``{field: text}`` shown as the default instead of the field's default.
    """

    model: type[BaseModel]
    dest: str
    what: str
    include: tuple[str, ...] | None = None
    exclude: frozenset[str] = frozenset()
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    default_text: Callable[[str], str | None] | None = None

    def fields(self) -> list[str]:
        names = self.include if self.include is not None else tuple(self.model.model_fields)
        return [n for n in names if n not in self.exclude]

    def flags_of(self, name: str) -> tuple[str, ...]:
        return self.flags.get(name, (f"--{name.replace('_', '-')}",))

    def param(self, name: str) -> str:
        """The Python parameter that carries field ``name`` (prefixed: no clash between groups)."""
        return f"{self.dest}__{name}"


def bounds_text(model: type[BaseModel], name: str) -> str | None:
    """A field's numeric bounds as click writes ranges: ``x>0``, ``x>=1``, ``0<=x<1``."""
    b: dict[str, Any] = {}
    for m in model.model_fields[name].metadata:
        b.update({k: getattr(m, k) for k in ("gt", "ge", "lt", "le") if hasattr(m, k)})
    lo = ("<", b["gt"]) if "gt" in b else ("<=", b["ge"]) if "ge" in b else None
    hi = ("<", b["lt"]) if "lt" in b else ("<=", b["le"]) if "le" in b else None
    if lo and hi:
        return f"{lo[1]}{lo[0]}x{hi[0]}{hi[1]}"
    if lo:
        return f"x{lo[0].replace('<', '>')}{lo[1]}"
    if hi:
        return f"x{hi[0]}{hi[1]}"
    return None


def _default_text(group: OptionGroup, name: str) -> str | None:
    if group.default_text is not None:
        return group.default_text(name)
    value = group.model.model_fields[name].get_default(call_default_factory=True)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or None
    return str(value)


def _option_type(annotation: Any) -> Any:
    """The option's Python type: the field's, without ``None``, then made optional (unset)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"cannot make an option of {annotation!r}")
        annotation = inner[0]
    if typing.get_origin(annotation) is tuple:  # tuple[int, ...] → a repeatable option
        annotation = list[typing.get_args(annotation)[0]]  # type: ignore[misc]
    return annotation | None


def _help(group: OptionGroup, name: str, typ: Any) -> str:
    info = group.model.model_fields[name]
    default = _default_text(group, name)
    extras = [f"default: {default}"] if default is not None else []
    rng = bounds_text(group.model, name)
    if rng:
        extras.append(rng)
    if typing.get_origin(typing.get_args(typ)[0]) is list:
        extras.append("repeatable")
    desc = info.description or ""
    return f"{desc} [{'; '.join(extras)}]" if extras else desc


def _parameters(group: OptionGroup) -> list[inspect.Parameter]:
    params = []
    for name in group.fields():
        info = group.model.model_fields[name]
        typ = _option_type(info.annotation)
        inner = typing.get_args(typ)[0]  # typ is `inner | None`
        decls = group.flags_of(name)
        if inner is bool:
            first = decls[0]
            decls = (f"{first}/--no-{first[2:]}", *decls[1:])
        extra: dict[str, Any] = {}
        if typing.get_origin(inner) is list:  # repeat the option: --x a --x b
            extra["metavar"] = f"<{typing.get_args(inner)[0].__name__}>"
        option = typer.Option(
            None, *decls, help=_help(group, name, typ), show_default=False, **extra
        )
        params.append(
            inspect.Parameter(
                group.param(name), inspect.Parameter.KEYWORD_ONLY, default=option, annotation=typ
            )
        )
    return params


def with_options(*groups: OptionGroup) -> Callable[[F], F]:
    """Add the options of ``groups`` to a typer command function.

    The function declares one keyword parameter per group (``group.dest``) instead of the
    generated options and receives there ``{field: value}`` for the options the user gave.
    """

    def decorate(func: F) -> F:
        sig = inspect.signature(func, eval_str=True)
        dests = {g.dest for g in groups}
        missing = dests - set(sig.parameters)
        if missing:
            raise TypeError(f"{func.__name__} has no parameter(s) {sorted(missing)}")
        own = [p for p in sig.parameters.values() if p.name not in dests]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        generated = [p for g in groups for p in _parameters(g)]
        clash = {p.name for p in own} & {p.name for p in generated}
        if clash:
            raise TypeError(f"{func.__name__}: generated options clash with {sorted(clash)}")

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            for g in groups:
                given = {n: kwargs.pop(g.param(n)) for n in g.fields()}
                kwargs[g.dest] = {n: v for n, v in given.items() if v is not None}
            return func(**kwargs)

        params = [*own, *generated]
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return decorate


def build(group: OptionGroup, values: Mapping[str, Any], **fixed: Any) -> Any:
    """``group.model(**values, **fixed)``; a rejected value raises one
    :class:`~scpdr.errors.ConfigError` line per bad option, naming the option and the field."""
    try:
        return group.model.model_validate({**values, **fixed})
    except ValidationError as exc:
        raise ConfigError(f"invalid {group.what}: {describe(group, exc)}") from None


def describe(group: OptionGroup, exc: ValidationError) -> str:
    """``exc`` as ``--flag (field): message (got value)``, one clause per error."""
    names = {n: f"{group.flags_of(n)[0]} ({n})" for n in group.fields()}
    return format_validation_error(exc, names)


# ------------------------------------------------------------------------------- the groups

TRAIN_OPTIONS = OptionGroup(
    TrainConfig,
    dest="train_options",
    what="training options",
    exclude=frozenset({"seed"}),  # --seed seeds the data, the partitions and training
    flags={"learning_rate": ("--learning-rate", "--lr")},
    default_text=TrainConfig.default_text,
)
"""Every :class:`~scpdr.training.config.TrainConfig` field but ``seed`` as an option."""

FIELD_OPTIONS = OptionGroup(
    FieldMapping,
    dest="field_options",
    what="field mapping",
    flags={name: (f"--{name}-field",) for name in FieldMapping.model_fields},
)
"""``--text-field``/``--prompt-field``/``--response-field``/``--id-field``/``--messages-field``/
``--secrets-field``/``--group-field``: which columns of a user's file hold the record's fields
(:class:`~scpdr.data.records.FieldMapping`)."""

SECRET_OPTIONS = OptionGroup(
    SecretsConfig,
    dest="secret_options",
    what="secret options",
    include=("patterns", "detect_pii"),
    flags={"patterns": ("--secret-pattern",), "detect_pii": ("--detect-pii",)},
)
"""``--secret-pattern REGEX`` (repeatable) and ``--detect-pii`` of
:class:`~scpdr.data.secrets.SecretsConfig`."""

VAL_FRACTION = typer.Option(
    None,
    "--val-fraction",
    min=0.0,
    max=0.9,
    help="Share of the records held out for validation when the data has no validation split "
    "(whole near-duplicate, --group-field and shared-secret groups at a time; recorded in the "
    "manifest) [default: max(10%, min(100 records, 25%))].",
)
"""``--val-fraction`` (unset: :func:`scpdr.data.user_data.default_val_size` for a user file)."""

GROUPING_OPTIONS = OptionGroup(
    GroupingConfig,
    dest="grouping_options",
    what="near-duplicate grouping options",
    include=("threshold", "num_perm"),
)
"""``--threshold``/``--num-perm`` of :class:`~scpdr.data.grouping.GroupingConfig`."""

CANARY_OPTIONS = OptionGroup(
    CanaryConfig,
    dest="canary_options",
    what="canary options",
    include=("n_per_repetition", "num_words", "partition"),
    flags={
        "n_per_repetition": ("--canaries-per-rep",),
        "num_words": ("--canary-words",),
        "partition": ("--canary-partition",),
    },
)
"""The :class:`~scpdr.data.canaries.CanaryConfig` options besides ``--canaries`` (which turns
canaries on: the repetition counts)."""

CANARIES = typer.Option(
    "",
    "--canaries",
    help="Insert canaries, repeated this often, e.g. 1,3,10 (empty: no canaries). "
    f"{CanaryConfig.model_fields['repetitions'].description}",
)
"""``--canaries 1,3,10``: the repetition counts of :class:`~scpdr.data.canaries.CanaryConfig`."""


def parse_repetitions(text: str) -> tuple[int, ...]:
    """``"1,3,10"`` → ``(1, 3, 10)``; empty → ``()`` (no canaries)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--canaries expects repetitions like 1,3,10, got {text!r}") from None


def canary_config(canaries: str, options: Mapping[str, Any]) -> CanaryConfig | None:
    """The :class:`CanaryConfig` of ``--canaries`` and the other canary options, or ``None`` when
    ``--canaries`` is empty (then another canary option is an error: it would do nothing)."""
    reps = parse_repetitions(canaries)
    if not reps:
        if options:
            given = ", ".join(CANARY_OPTIONS.flags_of(n)[0] for n in options)
            raise ConfigError(f"{given} without --canaries does nothing; add --canaries 1,3,10")
        return None
    return build(CANARY_OPTIONS, options, repetitions=reps)
