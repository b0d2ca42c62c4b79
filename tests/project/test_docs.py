"""The user documents (README.md and docs/*.md): the README stays a newcomer's page (small, with the two commands),
every relative link resolves to a file of the repository, and no document speaks of the project's own process or
of paths outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
USER_DOCUMENTS = [README, *DOCS]

# The README's two commands, word for word: set up and serve; set up the test toolchain and run what CI runs.
SERVE_COMMAND = "bash .ci/setup && .venv/bin/lora-server serve"
TEST_COMMAND = "bash .ci/setup --tests && bash .ci/check && .venv/bin/python -m pytest -q"

# [text](target) and [text](target "title"); images too. Reference-style definitions: [label]: target
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
PROCESS_WORDS = re.compile(r"\b(issue|stop) \d+", re.IGNORECASE)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _links(text: str) -> list[str]:
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def test_there_are_docs():
    assert DOCS, "docs/*.md is empty"


def test_readme_is_at_most_12_kib():
    size = len(README.read_bytes())
    assert size <= 12_288, f"README.md is {size} bytes; move detail into docs/"


def test_readme_has_the_two_commands():
    lines = [line.strip() for line in README.read_text().splitlines()]
    assert SERVE_COMMAND in lines
    assert TEST_COMMAND in lines


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_ids(USER_DOCUMENTS))
def test_relative_links_resolve(document: Path):
    missing = []
    for target in _links(document.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:...
            continue
        path = target.split("#", 1)[0]
        if not path:  # an anchor in the same document
            continue
        resolved = (document.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            missing.append(target)
    assert not missing, f"{document.relative_to(ROOT)}: links that resolve to no file of the repository: {missing}"


@pytest.mark.parametrize("document", USER_DOCUMENTS, ids=_ids(USER_DOCUMENTS))
def test_no_process_words_or_outside_paths(document: Path):
    text = document.read_text()
    assert not PROCESS_WORDS.findall(text), f"{document.relative_to(ROOT)}: {PROCESS_WORDS.findall(text)}"
    assert "../shared" not in text
