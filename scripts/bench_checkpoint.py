"""Activation memory and step time of checkpointing, on CPU, as ratios in one run.

A stack of transformer-like blocks (LayerNorm → Linear h→4h → GELU → dropout in the
model-parallel stream → Linear 4h→h → dropout → residual) is trained one step in each
configuration: no checkpoint, torch.utils.checkpoint (non-reentrant; the baseline), and
rng_tracker.checkpoint non-reentrant and reentrant. Memory is the live CPU heap (glibc
mallinfo2): "held" is what stays allocated at the end of the forward (saved activations
plus the output), "peak" the maximum over forward and backward, both above the level
before the step. A 2-rank run (tp=2, gloo) then shows distribute_saved_activations
dividing the held input bytes by the TP size. Then the fixed cost: a tiny block (an 8 x 64
linear and F.dropout), forward and backward on one thread, against torch.utils.checkpoint in
the same mode (non-reentrant and reentrant, torch's own RNG preservation), interleaved.

    python scripts/bench_checkpoint.py [--hidden 256] [--tokens 2048] [--layers 4] [--steps 7]
    python scripts/bench_checkpoint.py --tiny-only [--tiny-repeats 31]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _memory import PeakHeap, heap_bytes

from rng_tracker import (
    MODEL_PARALLEL_RNG,
    checkpoint,
    get_rng_tracker,
    model_parallel_seed,
    rng_context_fn,
)


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (tokens, hidden)
        h = F.gelu(self.fc1(self.norm(x)))  # (tokens, 4 hidden)
        with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
            h = F.dropout(h, 0.1)
        return x + F.dropout(self.fc2(h), 0.1)


Wrapper = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]

CONFIGS: dict[str, Wrapper] = {
    "no checkpoint": lambda block, x: block(x),
    "torch.utils.checkpoint": lambda block, x: torch_checkpoint.checkpoint(
        block, x, use_reentrant=False, context_fn=rng_context_fn()
    ),
    "rng_tracker non-reentrant": lambda block, x: checkpoint(block, x, use_reentrant=False),
    "rng_tracker reentrant": lambda block, x: checkpoint(block, x, use_reentrant=True),
}


def _step(blocks: list[Block], x: torch.Tensor, wrap: Wrapper, measure: bool) -> tuple[int, int]:
    gc.collect()
    base = heap_bytes()
    with PeakHeap() if measure else contextlib.nullcontext() as mode:
        h = x * 1.0  # a non-leaf first input, so that only the checkpoints hold block inputs
        for block in blocks:
            h = wrap(block, h)
        held = heap_bytes() - base
        h.square().mean().backward()
    peak = (mode.peak - base) if measure else 0
    for block in blocks:
        block.zero_grad(set_to_none=True)
    x.grad = None
    return held, peak


def _measure(
    hidden: int, tokens: int, layers: int, steps: int, wraps: dict[str, Wrapper]
) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model_parallel_seed(1234, tp_rank=0)
    blocks = [Block(hidden) for _ in range(layers)]
    x = torch.randn(tokens, hidden, requires_grad=True)
    results: dict[str, dict[str, float]] = {}
    for name, wrap in wraps.items():
        _step(blocks, x, wrap, measure=False)  # warm-up
        held, peak = _step(blocks, x, wrap, measure=True)
        results[name] = {"held": held, "peak": peak, "times": []}
    for _ in range(steps):  # interleaved so machine drift hits every configuration alike
        for name, wrap in wraps.items():
            start = time.perf_counter()
            _step(blocks, x, wrap, measure=False)
            results[name]["times"].append(time.perf_counter() - start)
    for r in results.values():
        r["time"] = statistics.median(r.pop("times"))
    return results


def _distributed_held(hidden: int, tokens: int, layers: int) -> dict[str, int]:
    from rng_tracker.parallel import init_model_parallel

    init_model_parallel(tensor=2)
    torch.set_num_threads(1)
    wraps = {
        "non-reentrant": lambda block, x: checkpoint(block, x),
        "non-reentrant + distribute": lambda block, x: checkpoint(
            block, x, distribute_saved_activations=True
        ),
        "reentrant": lambda block, x: checkpoint(block, x, use_reentrant=True),
        "reentrant + distribute": lambda block, x: checkpoint(
            block, x, use_reentrant=True, distribute_saved_activations=True
        ),
    }
    result = _measure(hidden, tokens, layers, 1, wraps)
    return {name: int(r["held"]) for name, r in result.items()}


def _tiny_fixed_cost(repeats: int, calls: int = 100) -> None:
    """Forward + backward of a checkpointed 8 x 64 linear + dropout, ours against torch's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model_parallel_seed(1234, tp_rank=0)
        linear = torch.nn.Linear(64, 64)
        x = torch.randn(8, 64, requires_grad=True)

        def block(h: torch.Tensor) -> torch.Tensor:
            return F.dropout(linear(h), 0.1)

        wraps = {
            "torch non-reentrant": lambda: torch_checkpoint.checkpoint(
                block, x, use_reentrant=False
            ),
            "rng_tracker non-reentrant": lambda: checkpoint(block, x, use_reentrant=False),
            "torch reentrant": lambda: torch_checkpoint.checkpoint(block, x, use_reentrant=True),
            "rng_tracker reentrant": lambda: checkpoint(block, x, use_reentrant=True),
        }

        def timed(wrap: Callable[[], torch.Tensor]) -> Callable[[], float]:
            def run() -> float:
                start = time.thread_time()  # this thread's CPU time: the machine is shared
                for _ in range(calls):
                    wrap().sum().backward()
                return time.thread_time() - start

            return run

        runs = {name: timed(wrap) for name, wrap in wraps.items()}
        for run in runs.values():  # warm-up
            run()
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):  # interleaved so machine drift hits every configuration alike
            for name, run in runs.items():
                samples[name].append(run())
        us = {name: statistics.median(v) / calls * 1e6 for name, v in samples.items()}
    finally:
        torch.set_num_threads(threads)
    print(
        f"\nfixed cost: checkpoint of an 8 x 64 linear + F.dropout, forward + backward, 1 thread, "
        f"us of its CPU time (time.thread_time) per step (median of {repeats} interleaved "
        f"samples of {calls} steps)"
    )
    for mode in ("non-reentrant", "reentrant"):
        ours, theirs = us[f"rng_tracker {mode}"], us[f"torch {mode}"]
        print(
            f"  {mode:<14} rng_tracker {ours:8.1f}  torch {theirs:8.1f}  ratio {ours / theirs:.2f}"
            " (target <= 1.10)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--tiny-repeats", type=int, default=31)
    parser.add_argument("--tiny-only", action="store_true", help="only the tiny-block fixed cost")
    args = parser.parse_args()
    if args.tiny_only:
        _tiny_fixed_cost(args.tiny_repeats)
        return

    results = _measure(args.hidden, args.tokens, args.layers, args.steps, CONFIGS)
    base = results["torch.utils.checkpoint"]
    print(
        f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; {args.layers} blocks, "
        f"hidden {args.hidden}, {args.tokens} tokens; median of {args.steps} steps"
    )
    print(
        f"{'configuration':<28}{'held MB':>9}{'peak MB':>9}{'step ms':>9}  {'held/torch':>10}{'time/torch':>11}"
    )
    for name, r in results.items():
        print(
            f"{name:<28}{r['held'] / 1e6:9.2f}{r['peak'] / 1e6:9.2f}{r['time'] * 1e3:9.1f}  "
            f"{r['held'] / base['held']:10.2f}{r['time'] / base['time']:11.3f}"
        )
    print("targets: rng_tracker non-reentrant time/torch <= 1.05 and held/torch = 1.00")

    from rng_tracker.parallel.testing import run_distributed

    ranks = run_distributed(
        _distributed_held, world_size=2, args=(args.hidden, args.tokens, args.layers), timeout=600
    )
    held = ranks[0]
    input_bytes = args.layers * args.tokens * args.hidden * 4
    print(
        f"\ntp=2 (2 gloo ranks), held MB on rank 0; saved block inputs total {input_bytes / 1e6:.2f} MB unsplit"
    )
    for mode in ("non-reentrant", "reentrant"):
        plain, split = held[mode], held[f"{mode} + distribute"]
        print(
            f"  {mode:<15} plain {plain / 1e6:7.2f}  distributed {split / 1e6:7.2f}  "
            f"saved-input bytes removed {(plain - split) / input_bytes:.2f} of the inputs (target 0.50 = 1 - 1/tp)"
        )
    _tiny_fixed_cost(args.tiny_repeats)


if __name__ == "__main__":
    main()
