"""Everything a GPU session must measure, in one command, written to one report.

    python scripts/gpu_report.py [--out out/gpu_report.md] [--quick] [--bench-timeout S]

1. the CUDA tests (``CUDA_TESTS``: tests/test_cuda.py and the captured-graph test of
   tests/test_keyed.py; they skip without CUDA, so this script refuses to run at all without it);
2. CUDA-graph capture and replay (below);
3. the kernel benchmark on the GPU (``scripts/bench_dropout.py``: rng_tracker's Triton kernel
   against a device-to-device copy, eager torch and torch.compile, bf16 and fp32, 2**20..2**28
   elements; ``--quick``: 2**20..2**24).

Each part is written to the report as it finishes, so a run cut short keeps what it measured.
The CUDA-graph checks, each reported PASS or FAIL with its error:
   a. a forked dropout: ``F.dropout`` inside ``tracker.fork(...)`` captured once (the streams
      registered with ``tracker.register_graph``) and replayed; each replay must draw what the
      same stream draws eagerly, call after call;
   b. a keyed fused dropout (``seed=`` on the device, the step in word 3) captured and replayed;
      each replay must equal the reference for the seed words it found;
   c. a checkpointed block (``rng_tracker.checkpoint(..., preserve_rng_state=False)``, keyed
      dropout inside: its mask needs no saved generator state) whose forward and
      backward are captured and replayed: the gradients of each replay must equal an eager
      forward and backward with the same seed words, bit for bit.
The report starts with the date, the device (``torch.cuda.get_device_name``), the driver and
the versions of torch and triton, so its figures can go to docs/benchmarks.md as they are.
Without CUDA it stops with exit status 2 and says so: it never reports a figure it did not
measure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# every test that needs a CUDA device (each skips without one)
CUDA_TESTS = [
    "tests/test_cuda.py",
    "tests/test_keyed.py::test_keyed_words_and_step_advance_inside_a_captured_cuda_graph",
]


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


# --- CUDA-graph checks ------------------------------------------------------------------


def _check_forked_dropout() -> str:
    """F.dropout in a tracker fork, captured once, replayed 3 times, against the eager draws."""
    import torch.nn.functional as F

    from rng_tracker import RNGStatesTracker

    def draws(tracker: RNGStatesTracker, x: torch.Tensor, n: int, graphed: bool) -> list:
        if not graphed:
            out = []
            for _ in range(n):
                with tracker.fork("stream"):
                    out.append(F.dropout(x, 0.5))
            return out
        with tracker.fork("stream"):  # warm-up outside the capture
            F.dropout(x, 0.5)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        tracker.register_graph(graph)  # torch draws only from states registered with the graph
        with torch.cuda.graph(graph), tracker.fork("stream"):
            y = F.dropout(x, 0.5)
        out = []
        for _ in range(n):
            graph.replay()
            out.append(y.clone())
        return out

    x = torch.ones(1 << 16, device="cuda")
    results = {}
    for graphed in (False, True):
        tracker = RNGStatesTracker("cuda")
        tracker.add("stream", 1234)
        if graphed:  # the eager run drew one call less before its first kept draw
            results[graphed] = draws(tracker, x, 3, True)
        else:
            tracker_draws = draws(tracker, x, 4, False)
            results[graphed] = tracker_draws[1:]  # the capture's warm-up drew the first
    eager, replayed = results[False], results[True]
    assert not torch.equal(replayed[0], replayed[1]), "two replays drew the same mask"
    for i, (a, b) in enumerate(zip(eager, replayed, strict=True)):
        assert torch.equal(a, b), f"replay {i} differs from the eager draw of the stream"
    return "3 replays, each equal to the stream's eager draw, all different"


def _check_keyed_dropout() -> str:
    from rng_tracker.kernels import dropout

    x = torch.randn(1 << 20, device="cuda")
    seed = torch.tensor([7, 0, 0, 0], device="cuda")
    dropout(x, 0.1, seed=seed, impl="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dropout(x, 0.1, seed=seed, impl="triton")
    masks = []
    for step in range(3):
        seed[3].fill_(step)
        graph.replay()
        assert torch.equal(y, dropout(x, 0.1, seed=seed.clone(), impl="torch")), step
        masks.append(y != 0)
    assert not torch.equal(masks[0], masks[1]), "two steps drew the same mask"
    return "3 replays at steps 0, 1, 2, each equal to the reference for its seed words"


def _check_checkpointed_block() -> str:
    """Forward and backward of a checkpointed block with keyed dropout, captured and replayed."""
    from rng_tracker import checkpoint
    from rng_tracker.kernels import dropout

    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    block = block.cuda()
    seed = torch.tensor([11, 0, 0, 0], device="cuda")

    def body(h: torch.Tensor) -> torch.Tensor:
        return dropout(block(h), 0.1, seed=seed, impl="triton")

    x = torch.randn(64, 256, device="cuda", requires_grad=True)

    def step() -> list[torch.Tensor]:
        for p in (*block.parameters(), x):
            p.grad = None
        # keyed dropout needs no saved RNG state; capture refuses to copy one
        checkpoint(body, x, preserve_rng_state=False).square().sum().backward()
        return [t.grad for t in (*block.parameters(), x)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's graph docs ask
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for p in (*block.parameters(), x):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    for word in range(3):
        seed[3].fill_(word)
        graph.replay()
        replayed = [g.clone() for g in grads]
        eager = step()
        for i, (a, b) in enumerate(zip(replayed, eager, strict=True)):
            assert torch.equal(a, b), f"step {word}: gradient {i} differs from the eager step"
    return "3 replays of forward + backward, gradients equal to eager steps with the same seed"


_CHECKS: dict[str, Callable[[], str]] = {
    "forked dropout (F.dropout in tracker.fork)": _check_forked_dropout,
    "keyed fused dropout (seed on the device)": _check_keyed_dropout,
    "checkpointed block (forward + backward)": _check_checkpointed_block,
}


def _graph_section() -> tuple[list[str], bool]:
    lines, ok = ["## CUDA-graph capture and replay", ""], True
    for name, check in _CHECKS.items():
        try:
            lines.append(f"- PASS {name}: {check()}")
        except Exception:  # a finding for the report, not a reason to stop the other checks
            ok = False
            lines.append(f"- FAIL {name}:\n\n```text\n{traceback.format_exc().rstrip()}\n```")
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

    status, output = _run([sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", "-rs"], 1800)
    ok &= status == 0
    add([f"## CUDA tests (exit status {status})", "", "```text", output.strip(), "```", ""])

    lines, graphs_ok = _graph_section()
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
