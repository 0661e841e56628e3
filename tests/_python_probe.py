"""Run a short Python program in a fresh interpreter: what a process sees at import time."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, *, timeout: float = 120) -> str:
    """The stdout of ``python -c code``; fails the test with its stderr if it exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
