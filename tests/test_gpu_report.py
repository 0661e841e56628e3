"""scripts/gpu_report.py without a GPU: it refuses to report, and its CUDA-graph section reads
the outcome of CUDA tests that exist (each skips here, and a skip is not reported as a pass)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
gpu_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_report)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_without_cuda_it_exits_2_and_writes_no_report(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_report.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "no CUDA device here" in done.stderr
    assert not out.exists()


def test_the_graph_section_reads_each_graph_test_from_pytests_output():
    """The report runs pytest -v on CUDA_TESTS; run the graph tests the same way here: every one
    is collected and reported, and a skip (here, without CUDA) is a FAIL, not a PASS."""
    nodes = list(gpu_report.GRAPH_TESTS.values())
    assert all(node.startswith(tuple(gpu_report.CUDA_TESTS)) for node in nodes)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *nodes, "-v", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    lines, ok = gpu_report.graph_section(done.stdout + done.stderr)
    outcome = "PASSED" if torch.cuda.is_available() else "SKIPPED"
    assert ok == torch.cuda.is_available()
    for node in nodes:
        assert any(line.endswith(f"`{node}` {outcome}") for line in lines), (node, lines)
    lines, ok = gpu_report.graph_section("")  # a test that did not run fails the section
    assert not ok and all("NOT RUN" in line for line in lines if line.startswith("- "))
