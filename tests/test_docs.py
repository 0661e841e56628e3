"""The documentation a user clones with the repository is whole: no link leaves it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _markdown_files() -> list[Path]:
    skip = {".venv", ".venv-base", ".git", "build", "dist"}
    return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def test_relative_links_stay_inside_the_repository_and_exist():
    """A reader of a fresh clone can follow every relative link in every Markdown file."""
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "design.md" in files
    broken = []
    for path in files:
        for target in _LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken
