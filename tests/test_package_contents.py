"""``pip install .`` installs the library only: not the training job, not the kernel-lowering tool.

The job (``examples/gpt_training``) and ``scripts/_lowering.py`` serve scripts and tests from the
repository. This builds the wheel from a copy of the package sources (offline, no build
isolation, no leftovers of an earlier ``build/``) and checks what it holds, then imports the
library from the unpacked wheel and finds neither the old ``rng_tracker.parallel.demo`` nor
``rng_tracker.kernels.lowering``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from rng_tracker.kernels import _c_build

ROOT = Path(__file__).resolve().parents[1]
# What setup.cfg builds the wheel from.
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "rng_tracker", "parallel", "kernels")
JOB_MODULES = {"trainer", "corpus", "pipeline", "dcp_checkpoint", "lowering", "_lowering"}

_IMPORT_CHECK = r"""
import importlib.util, sys
import rng_tracker, rng_tracker.kernels, rng_tracker.parallel, rng_tracker_pytest
assert rng_tracker.__file__.startswith(sys.argv[1]), rng_tracker.__file__
assert rng_tracker_pytest.__file__.startswith(sys.argv[1]), rng_tracker_pytest.__file__
absent = ["rng_tracker.parallel.demo", "rng_tracker.kernels.lowering", "gpt_training"]
found = [name for name in absent if importlib.util.find_spec(name) is not None]
assert not found, found
"""


def _wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path / "wheel"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index"),
            *("--no-build-isolation", "--wheel-dir", str(out), str(source)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("rng_tracker-*.whl")
    return wheel


def test_the_wheel_holds_the_library_but_not_the_job_or_the_lowering_tool(tmp_path):
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    modules = [n for n in names if n.endswith(".py")]
    assert "rng_tracker/parallel/transformer.py" in modules  # the library is there
    # the pytest plugin's entry point: a top-level module, so registering the marker needs no torch
    assert "rng_tracker_pytest.py" in modules and not [n for n in modules if "_entry_point" in n]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entry_text = (tmp_path / "site" / entry_points).read_text(encoding="utf-8")
    assert "rng_tracker_distributed = rng_tracker_pytest" in entry_text
    assert "rng_tracker/kernels/_triton_kernel.py" in modules
    # the C kernels build from the installed files: their sources and the headers they include
    kernel_files = {
        name
        for source in ("cpu_dropout.c", "keyed_fill.c")
        for name in _c_build.source_files(source, _c_build._read)
    }
    assert {"cpu_isa.h", "fresh_pages.h", "philox4x32_simd.h"} <= kernel_files  # via headers
    for kernel_file in kernel_files:
        assert f"rng_tracker/kernels/{kernel_file}" in names, kernel_file
    stray = [
        n
        for n in modules
        if Path(n).stem in JOB_MODULES or "/demo/" in n or n.startswith("gpt_training/")
    ]
    assert not stray, stray
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = str(tmp_path / "site")
    # -I: not this repository's folders; the unpacked wheel first on the path
    code = f"import sys; sys.path.insert(0, {site!r}); sys.argv[1:] = [{site!r}]\n" + _IMPORT_CHECK
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
