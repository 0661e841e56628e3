"""scripts/demo.sh keeps its checkpoint where it tells the user to resume from it.

On main the demo saved into a temporary directory that it deleted on exit, then printed
``resume with --resume /tmp/...``. Here it runs as a user runs it (short: DEMO_STEPS=1, this
venv), and every ``--resume DIR`` it prints names a committed checkpoint that still exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from gpt_training.dcp_checkpoint import read_manifest

ROOT = Path(__file__).resolve().parents[1]


def _demo(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    environ.update(VENV=sys.prefix, DEMO_STEPS="1", **env)  # this venv: nothing to install
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_printed_resume_directory_exists_and_resumes(tmp_path):
    """Default place: out/demo/ckpt under the directory it was started from. Each printed
    --resume names it, it holds the step-1 checkpoint the second run resumed from."""
    proc = _demo(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ckpt = tmp_path / "out" / "demo" / "ckpt"
    printed = re.findall(r"--resume (\S+?)\)?$", proc.stdout, flags=re.M)
    assert len(printed) >= 2 and set(printed) == {str(ckpt)}, printed
    manifest = read_manifest(str(ckpt))  # committed, every file matching its hash
    assert manifest.step == 1 and manifest.rng_mode == "keyed"
    assert f"resumed step 1 of run {manifest.run_id[:8]} from {ckpt}" in proc.stdout


def test_a_failed_demo_prints_no_resume_command(tmp_path):
    """DEMO_OUT chooses the place; when the first run is refused nothing is saved there and no
    resume command is printed."""
    out = tmp_path / "elsewhere"
    proc = _demo(tmp_path, "--tp", "3", DEMO_OUT=str(out))
    assert proc.returncode == 2 and "use --tp 1, 2 or 4" in proc.stderr
    assert "--resume" not in proc.stdout and not (out / "ckpt").exists()
