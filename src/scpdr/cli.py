"""The ``scpdr`` command: thin typer commands over the library (STYLE.md 8, after TRL ``cli/main.py``).

Each command lives in ``scpdr/commands/<name>.py`` as a plain function and imports its heavy
dependencies inside the function body, so ``scpdr --help`` is fast. ``main(argv) -> int`` is the
testable entry point; ``run()`` is the console script.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

import typer

#: The widest ``--help`` output, in columns (narrower terminals get narrower help).
HELP_WIDTH = 80

app = typer.Typer(
    name="scpdr",
    help="SCP-Δr: fine-tune on private data and serve with provable protection against extraction.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: wrapped at words to the terminal, at most 80 columns (HELP_WIDTH). rich's
    # option tables squeezed the help column at 80 columns and cut words with "…".
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_WIDTH},
)

# (module under scpdr.commands, attribute, command name). A module that does not exist yet is
# skipped, so the CLI grows with the library.
_COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "demo", "demo"),
    ("experiment", "experiment", "experiment"),
    ("train", "train", "train"),
    ("data", "partition", "partition"),
    ("data", "audit_partitions", "audit-partitions"),
    ("eval", "eval_", "eval"),
    ("bounds", "bounds", "bounds"),
    ("bundle", "bundle", "bundle"),
    ("export", "export", "export"),
    ("forget", "forget", "forget"),
    ("serve", "serve", "serve"),
    ("prop_bounds", "prop_bounds", "prop-bounds"),
]


def _register() -> None:
    for module, attr, name in _COMMANDS:
        try:
            mod = importlib.import_module(f"scpdr.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"scpdr.commands.{module}":
                continue
            raise
        func = getattr(mod, attr)
        app.command(name=name, short_help=_summary(func))(func)


def _summary(func: object) -> str | None:
    """The first paragraph of a command's docstring, in one line: its line in ``scpdr --help``
    (given whole, click wraps it at words instead of cutting it to fit one line)."""
    doc = inspect.getdoc(func)
    return " ".join(doc.split("\n\n")[0].split()) if doc else None


@app.callback()
def _root(
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log at DEBUG level (before the command: scpdr -v eval ...)."
    ),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


_register()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    try:
        # Non-standalone click returns typer.Exit's code instead of raising it.
        rc = app(args=argv if argv is not None else sys.argv[1:], standalone_mode=False)
        if isinstance(rc, int):
            return rc
    except SystemExit as exc:  # typer/click exit paths
        return int(exc.code or 0)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except Exception as exc:  # click usage errors and our own errors: message, not traceback
        click_exc, abort = _click_exception_types()
        if isinstance(exc, click_exc):
            exc.show()
            if getattr(exc, "option_name", None) in ("-v", "--verbose"):
                typer.echo(
                    "hint: -v/--verbose goes before the command: scpdr -v COMMAND ...", err=True
                )
            return exc.exit_code
        if isinstance(exc, abort):
            return 1
        from scpdr.errors import ScpdrError, format_validation_error

        if isinstance(exc, (ScpdrError, *_PATH_ERRORS)):
            typer.echo(f"error: {exc}", err=True)
            return 2
        if _is_validation_error(exc):  # a CLI value a settings model rejects (e.g. --threshold 2)
            title = getattr(exc, "title", "settings")
            typer.echo(f"error: invalid {title}: {format_validation_error(exc)}", err=True)
            return 2
        raise
    return 0


# A path the user gave is missing, of the wrong kind or not writable: the OS message names it.
_PATH_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def _is_validation_error(exc: BaseException) -> bool:
    try:
        from pydantic import ValidationError
    except ImportError:
        return False
    return isinstance(exc, ValidationError)


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(ClickException, Abort) classes of click and of the copy typer >= 0.29 vendors
    (``typer._click``): typer.BadParameter derives from the vendored one."""
    import click

    mods = [click]
    try:
        import typer._click as vendored

        mods.append(vendored)
    except ImportError:  # older typer: plain click only
        pass
    return (
        tuple(m.exceptions.ClickException for m in mods),
        tuple(m.exceptions.Abort for m in mods if hasattr(m.exceptions, "Abort")),
    )


def run() -> None:
    sys.exit(main())
