"""One module per CLI command; each exposes a plain typer command function (see ``scpdr.cli``)."""
