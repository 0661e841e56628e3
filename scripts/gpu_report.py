"""Everything a GPU session must measure, in one command, written to one report.

    python scripts/gpu_report.py [--out out/gpu_report.md] [--quick] [--bench-timeout S]

1. the CUDA tests (``CUDA_TESTS``: tests/test_cuda.py and the captured-graph test of
   tests/test_keyed.py; they skip without CUDA, so this script refuses to run at all without it);
2. CUDA-graph capture and replay: the outcome, PASS or FAIL, of the CUDA tests that capture
   and replay a graph (``GRAPH_TESTS``), from the same run:
   a. a forked dropout: ``F.dropout`` inside ``tracker.fork(...)`` captured once (the streams
      registered with ``tracker.register_graph``) and replayed; each replay draws what the
      same stream draws eagerly, call after call;
   b. a keyed fused dropout (``seed=`` on the device, the step in word 3) captured and replayed;
      each replay equals the reference for the seed words it found;
   c. a checkpointed block (``rng_tracker.checkpoint(..., preserve_rng_state=False)``, keyed
      dropout inside: its mask needs no saved generator state) whose forward and backward are
      captured and replayed: each replay's gradients equal an eager step's, bit for bit;
   d. KeyedRNG's words and step advancing inside a captured graph;
3. the kernel benchmark on the GPU (``scripts/bench_dropout.py``: rng_tracker's Triton kernel
   against a device-to-device copy, eager torch and torch.compile, bf16 and fp32, 2**20..2**28
   elements; ``--quick``: 2**20..2**24).

Each part is written to the report as it finishes, so a run cut short keeps what it measured.
The report starts with the date, the device (``torch.cuda.get_device_name``), the driver and
the versions of torch and triton, so its figures can go to docs/benchmarks.md as they are.
Without CUDA it stops with exit status 2 and says so: it never reports a figure it did not
measure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
_KEYED_GRAPH_TEST = (
    "tests/test_keyed.py::test_keyed_words_and_step_advance_inside_a_captured_cuda_graph"
)
# every test that needs a CUDA device (each skips without one)
CUDA_TESTS = ["tests/test_cuda.py", _KEYED_GRAPH_TEST]
# the CUDA tests that capture and replay a graph: what the report's graph section shows
GRAPH_TESTS = {
    "forked dropout (F.dropout in tracker.fork, streams registered)": (
        "tests/test_cuda.py::test_fork_in_a_captured_graph_draws_the_stream_on_each_replay_once_registered"
    ),
    "keyed fused dropout (seed on the device)": (
        "tests/test_cuda.py::test_capture_with_a_device_seed_replays_with_the_current_seed_words"
    ),
    "checkpointed block (forward + backward, keyed)": (
        "tests/test_cuda.py::test_checkpoint_in_a_capture_refuses_to_keep_rng_and_runs_keyed_without_it"
    ),
    "KeyedRNG words and step": _KEYED_GRAPH_TEST,
}


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """Exit status and combined output of ``command`` run from the repository root."""
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as error:
        return 124, f"timed out after {timeout:.0f} s\n{error.stdout or ''}{error.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def _header() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as error:  # the GPU kernels need it: its absence is the first finding
        triton_version = f"NOT IMPORTABLE ({error})"
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 60)[1]
    return "\n".join(
        [
            "# GPU report",
            "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- device: {torch.cuda.get_device_name()} (driver {driver.strip() or 'unknown'})",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version}",
            f"- command: python scripts/gpu_report.py {' '.join(sys.argv[1:])}".rstrip(),
            "",
        ]
    )


def graph_section(test_output: str) -> tuple[list[str], bool]:
    """The report's CUDA-graph section: each of ``GRAPH_TESTS`` as pytest's verbose output of the
    CUDA tests reports it (a test missing from the output is a failure: it did not run)."""
    lines, ok = ["## CUDA-graph capture and replay", ""], True
    for check, node in GRAPH_TESTS.items():
        found = re.search(rf"^{re.escape(node)} (PASSED|FAILED|ERROR|SKIPPED)", test_output, re.M)
        outcome = found.group(1) if found else "NOT RUN"
        ok &= outcome == "PASSED"
        lines.append(f"- {'PASS' if outcome == 'PASSED' else 'FAIL'} {check}: `{node}` {outcome}")
    return [*lines, ""], ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu_report.md", help="the report (markdown)")
    parser.add_argument("--quick", action="store_true", help="benchmark 2**20..2**24 only")
    parser.add_argument(
        "--bench-timeout", type=float, default=3600, help="seconds the benchmark may run"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_report.py: no CUDA device here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}): nothing was measured and no report was written. Run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    out = ROOT / args.out if not os.path.isabs(args.out) else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: list[str] = []

    def add(section: list[str]) -> None:
        """Print a finished section and rewrite the report, so a run cut short keeps it."""
        report.extend(section)
        print("\n".join(section), flush=True)
        out.write_text("\n".join(report))

    add([_header()])
    ok = True

    status, output = _run([sys.executable, "-m", "pytest", *CUDA_TESTS, "-v", "-rs"], 1800)
    ok &= status == 0
    add([f"## CUDA tests (exit status {status})", "", "```text", output.strip(), "```", ""])

    lines, graphs_ok = graph_section(output)
    ok &= graphs_ok
    add(lines)

    bench = [sys.executable, "scripts/bench_dropout.py", "--min-log2", "20"]
    bench += ["--max-log2", "24" if args.quick else "28"]
    status, output = _run(bench, args.bench_timeout)
    ok &= status == 0
    add(
        [
            f"## Kernel benchmark: `{' '.join(bench[1:])}` (exit status {status})",
            "",
            "```text",
            output.strip(),
            "```",
            "",
        ]
    )
    print(f"wrote {out}; {'all parts passed' if ok else 'SOME PARTS FAILED (see the report)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
