"""The README's two own-data sections: the ProtectedLM example runs on a bundle, and the
five-command workflow names options and files that exist."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_readme_starts_with_make_demo_and_make_test():
    first = re.search(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    cmds = [ln.split("#")[0].strip() for ln in first.group(1).splitlines() if ln.strip()]
    assert cmds == ["make demo", "make test"]


def test_the_protected_lm_example_runs_in_ten_lines(tiny_bundle):
    (code,) = re.findall(r"```python\n(.*?)```", _section("The library in ten lines"), re.S)
    assert len(code.strip().splitlines()) <= 10
    code = code.replace('"B"', repr(str(tiny_bundle)))
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), scope)
    printed = out.getvalue().splitlines()
    assert len(printed) >= 2
    worst, total = map(float, printed[-1].split())
    assert 0 <= worst <= total  # the response's certificate sums its tokens' charges
    assert scope["logprobs"].shape[0] == 1 and scope["next_token"].shape[0] == 1


def test_the_workflow_is_five_commands_that_exist():
    (block,) = re.findall(r"```bash\n(.*?)```", _section("Your own data in five commands"), re.S)
    commands = [ln for ln in block.splitlines() if ln.startswith("scpdr ")]
    assert [c.split()[1] for c in commands] == ["train", "eval", "eval", "export", "serve"]
    import typer

    from scpdr.cli import app

    names = {c.name for c in typer.main.get_command(app).commands.values()}
    assert {"train", "eval", "export", "serve"} <= names
    for flag in ("--secrets-field", "--group-field", "--m", "--api-key"):
        assert flag in block
