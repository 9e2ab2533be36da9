"""The user's docs describe the product as it is: no tracker references, no promises of what will
"land", and the paper cited by its title (its source file is not part of the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
PAPER_TITLE = (
    "Provably Protecting Fine-Tuned LLMs from Training Data Extraction while Preserving Utility"
)

#: Tracker talk: "issue 16", "issues 2, 14", "issue #3", "once it lands", "once they land".
TRACKER = re.compile(r"issues? #?[0-9]+|once (it|they) lands?", re.IGNORECASE)


def _hits(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]


def test_the_pattern_catches_tracker_talk():
    for text in ("see issue 16", "Issues 2, 14", "issue #3", "once it lands", "once they land"):
        assert TRACKER.search(text), text
    assert not TRACKER.search("the issuer of 16 keys lands a plane")


def test_docs_cite_no_issue_numbers_and_promise_nothing():
    assert PAGES and all(p.is_file() for p in PAGES)
    assert _hits(TRACKER) == []


@pytest.mark.parametrize("path_text", ["scp_dr.tex", "shared/paper"])
def test_docs_cite_the_paper_by_title_not_by_a_path_outside_the_repository(path_text):
    assert _hits(re.compile(re.escape(path_text))) == []


def test_the_readme_names_the_paper():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert PAPER_TITLE in readme
