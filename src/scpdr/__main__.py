"""``python -m scpdr`` is the ``scpdr`` command."""

from scpdr.cli import run

if __name__ == "__main__":
    run()
