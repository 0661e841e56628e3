"""The oldest torch the project claims is the one its CI runs: setup.cfg, the README and the
interpreter this suite runs under agree, so no claim rests on a version nobody tested."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _declared_minimum() -> tuple[int, int]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"]
    found = re.findall(r"^\s*torch\s*>=\s*([\d.]+)\s*$", requires, re.M)
    assert len(found) == 1, f"setup.cfg must pin one minimum torch, got {requires!r}"
    return _minor(found[0])


def test_the_readme_states_setup_cfgs_minimum() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    claims = {_minor(v) for v in re.findall(r"torch >= ?([\d.]+)", readme)}
    assert claims == {_declared_minimum()}, (claims, _declared_minimum())


def test_this_suite_runs_the_declared_minimum() -> None:
    """CI installs torch 2.13.0 (scripts/_venv.sh): the declared minimum is the tested one."""
    assert _minor(torch.__version__) == _declared_minimum(), (
        f"the suite runs torch {torch.__version__} but setup.cfg declares torch >= "
        f"{'.'.join(map(str, _declared_minimum()))}: run the suite on the minimum, or raise it"
    )
    venv_script = (ROOT / "scripts" / "_venv.sh").read_text(encoding="utf-8")
    pinned = re.search(r"torch==([\d.]+)", venv_script)
    assert pinned and _minor(pinned[1]) == _declared_minimum()


def test_the_release_and_its_deprecation_messages_agree() -> None:
    """setup.cfg's version is ``rng_tracker.__version__``, and every deprecation names the next
    minor release as the one that removes the old name (the names moved in this one)."""
    import rng_tracker
    from rng_tracker._deprecation import REMOVED_IN

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["version"] == rng_tracker.__version__
    major, minor = _minor(rng_tracker.__version__)
    assert _minor(REMOVED_IN) == (major, minor + 1), (rng_tracker.__version__, REMOVED_IN)
