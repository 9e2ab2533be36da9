"""The README's example runs and prints what the README says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block() -> str:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    return blocks[0]


def test_readme_starts_with_the_two_commands():
    lines = [ln.strip() for ln in README.read_text(encoding="utf-8").splitlines()]
    cmds = [ln.split("#")[0].strip() for ln in lines if ln.startswith("make ")]
    assert cmds[:2] == ["make demo", "make test"]


def test_readme_example_prints_documented_numbers():
    code = _python_block()
    expected = [
        ln.lstrip("# ").split()[:3] for ln in code.splitlines() if re.match(r"# (cp|scp)-", ln)
    ]
    assert expected, "README example documents no output"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    got = [ln.split() for ln in out.getvalue().strip().splitlines()]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g[0] == e[0]
        assert abs(float(g[1]) - float(e[1])) < 5e-3
        assert abs(float(g[2]) - float(e[2])) < 5e-3
