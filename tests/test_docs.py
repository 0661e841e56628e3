"""The documentation a user clones with the repository is whole: no link leaves it, and every
code block in README.md and docs/*.md runs as written.

A fence's language says what it is: ``python`` blocks run as a script in a fresh directory with
this venv's interpreter (the venv ``scripts/test.sh`` makes from the README's own commands),
``bash``/``sh`` blocks run in bash, and ``text`` (or a data format) is output or data, never
run. An HTML comment on the line just above a fence says how to run it:

- ``<!-- doc-test: ranks=N -->``: under ``torchrun --standalone --nproc-per-node N``, as the
  README tells the reader to run a multi-rank block (the block initialises its own group);
- ``<!-- doc-test: pytest -->``: saved as a test file and run with ``python -m pytest``;
- ``<!-- doc-test: skip (reason) -->``: not run, only where running is impossible here (a GPU,
  installing into this very venv); the reason is required.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<spec>.*?)\s*-->\s*$")
_SKIP = re.compile(r"skip \((?P<reason>.+)\)")
_RANKS = re.compile(r"ranks=(?P<n>[1-9][0-9]*)")
PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell")
NOT_RUN = ("text", "json", "toml", "yaml", "ini", "diff")  # output or data
_TIMEOUT_S = 300


def _markdown_files() -> list[Path]:
    skip = {".venv", ".venv-base", ".git", "build", "dist", "out"}
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


_REPO_PATH = re.compile(
    r"`((?:docs|scripts|tests|examples|kernels|parallel|rng_tracker|\.ci)/[\w./-]*[\w/])`"
)
_OUTSIDE = re.compile(r"\bDESIGN(?:\.md| §)")


def test_every_repository_path_the_docs_name_exists():
    """A path in backticks (`docs/keyed.md`, `scripts/demo.sh`) names a file or folder of this
    repository, and no page cites a document that is not in it (the design brief outside it)."""
    missing = []
    for path in _markdown_files():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        for target in _REPO_PATH.findall(text):
            if not (ROOT / target.split("::")[0]).exists():
                missing.append(f"{where}: {target}")
        missing += [f"{where}: cites {cite!r}" for cite in _OUTSIDE.findall(text)]
    assert not missing, missing


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its doc-test marker and its text."""

    where: str  # file:line of the opening fence
    language: str
    marker: str  # the doc-test spec above it, "" when none
    code: str


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        above = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = _MARKER.match(above)
        body, j = [], i + 1
        while j < len(lines):
            close = _FENCE.match(lines[j])
            if close and close["fence"].startswith(fence) and not close["info"].strip():
                break
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        where = f"{path.relative_to(ROOT)}:{i + 1}"
        language = match["info"].strip().split(" ")[0] if match["info"].strip() else ""
        blocks.append(Block(where, language, marker["spec"] if marker else "", "\n".join(body)))
        i = j + 1
    return blocks


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


ALL_BLOCKS = [block for path in _doc_files() for block in _blocks(path)]
RUN = [b for b in ALL_BLOCKS if b.language in PYTHON + SHELL and not _SKIP.fullmatch(b.marker)]


def test_every_block_says_what_it_is():
    """Every fence names a language this test knows, every marker is one it knows, and every
    skip gives its reason: so no code block goes unrun by accident."""
    wrong = []
    for block in ALL_BLOCKS:
        if block.language not in PYTHON + SHELL + NOT_RUN:
            wrong.append(
                f"{block.where}: fence language {block.language!r}: name one of "
                f"{PYTHON + SHELL + NOT_RUN} (```text for output)"
            )
        spec = block.marker
        known = (
            spec == ""
            or _SKIP.fullmatch(spec)
            or (spec == "pytest" and block.language in PYTHON)
            or (_RANKS.fullmatch(spec) and block.language in PYTHON)
        )
        if not known:
            wrong.append(f"{block.where}: unknown doc-test marker {spec!r} for {block.language}")
    assert not wrong, "\n".join(wrong)
    assert len(RUN) >= 8  # the README's snippets and the docs' examples


def _env() -> dict[str, str]:
    """This environment without the outer pytest's own variables."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RNG_TRACKER_SAVE"))
    }


def _command(block: Block, tmp_path: Path) -> list[str]:
    if block.language in SHELL:
        script = tmp_path / "block.sh"
        script.write_text(block.code + "\n")
        return ["bash", "-euo", "pipefail", str(script)]
    if block.marker == "pytest":
        script = tmp_path / "test_doc_block.py"
        script.write_text(block.code + "\n")
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    script = tmp_path / "block.py"
    script.write_text(block.code + "\n")
    ranks = _RANKS.fullmatch(block.marker)
    if ranks:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            ranks["n"],
            str(script),
        ]
    return [sys.executable, str(script)]


@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_the_block_runs_as_written(block, tmp_path):
    """The block, exactly as the reader copies it, exits 0 (in a directory of its own)."""
    proc = subprocess.run(
        _command(block, tmp_path),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{block.where}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
