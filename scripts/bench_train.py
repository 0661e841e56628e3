"""Training step time and peak memory per recompute mode and rng mode, on 2 gloo ranks (tp=2).

For each recompute mode the script builds TinyGPT once per rng mode ("megatron",
"invariant", "keyed") and times their training steps interleaved (one step of each mode in
turn), so the modes see the same machine load and their ratios are fair. It prints the
median step time and the peak live CPU heap of one step (glibc mallinfo2, above the level
before the step) as ratios to recompute="none" of the same rng mode, the step time of each
rng mode as ratios to megatron and invariant modes at the same recompute, and the share of
step time spent entering and leaving tracker forks (measured by timing every fork in a
step). It writes a PNG of memory and time per configuration.

    python scripts/bench_train.py [--steps 10] [--hidden 128] [--seq 64] [--png docs/bench_train.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _examples_path  # noqa: F401  (examples/ onto sys.path: the job is not installed)
from _memory import PeakHeap, heap_bytes
from gpt_training.corpus import Corpus
from gpt_training.trainer import TrainConfig, build, train_step

from rng_tracker._keyed import get_keyed_rng
from rng_tracker._tracker import RNGStatesTracker
from rng_tracker.parallel.testing import run_distributed
from rng_tracker.parallel.transformer import GPTConfig

MODES = ("megatron", "invariant", "keyed")
RECOMPUTES = ("none", "full", "selective")


class _ForkClock:
    """Times every tracker fork enter and exit while installed (benchmark instrumentation)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._enter, self._exit = RNGStatesTracker._enter, RNGStatesTracker._exit

    def __enter__(self) -> _ForkClock:
        clock = self

        def timed(original):
            def wrapper(tracker, name):
                start = time.perf_counter()
                original(tracker, name)
                clock.seconds += time.perf_counter() - start
                clock.count += 1

            return wrapper

        RNGStatesTracker._enter, RNGStatesTracker._exit = timed(self._enter), timed(self._exit)
        return self

    def __exit__(self, *exc: object) -> None:
        RNGStatesTracker._enter, RNGStatesTracker._exit = self._enter, self._exit


def _measure(steps: int, model: GPTConfig, batch: int) -> dict:
    torch.set_num_threads(1)
    corpus = Corpus(vocab=model.vocab)
    batches = [corpus.global_batch(s, batch=batch, seq_len=model.seq_len) for s in range(steps + 3)]
    results = {}
    for recompute in RECOMPUTES:
        jobs = {}
        for mode in MODES:
            cfg = TrainConfig(
                tp=2,
                model=replace(model, rng_mode=mode, recompute=recompute),
                global_batch=batch,
                quiet=True,
            )
            jobs[mode] = build(cfg)
            if mode == "keyed":
                get_keyed_rng(jobs[mode].device).manual_seed(cfg.seed)
        peaks = {}
        for mode, job in jobs.items():
            for inputs, targets in batches[:2]:  # warm-up
                train_step(job, inputs, targets)
            base = heap_bytes()
            with PeakHeap() as peak:
                train_step(job, *batches[2])
            peaks[mode] = peak.peak - base
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        fork_seconds = dict.fromkeys(MODES, 0.0)
        fork_counts = dict.fromkeys(MODES, 0)
        with _ForkClock() as clock:
            for inputs, targets in batches[3:]:
                for mode, job in jobs.items():  # interleaved: the same load for every mode
                    seconds, count = clock.seconds, clock.count
                    start = time.perf_counter()
                    train_step(job, inputs, targets)
                    times[mode].append(time.perf_counter() - start)
                    fork_seconds[mode] += clock.seconds - seconds
                    fork_counts[mode] += clock.count - count
        for mode in MODES:
            results[(mode, recompute)] = {
                "time": statistics.median(times[mode]),
                "peak": peaks[mode],
                "fork_share": fork_seconds[mode] / sum(times[mode]),
                "forks_per_step": fork_counts[mode] / 2 / len(times[mode]),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--png", default=os.path.join(os.path.dirname(__file__), "..", "docs", "bench_train.png")
    )
    args = parser.parse_args()
    model = replace(
        GPTConfig(),
        hidden=args.hidden,
        heads=8,
        ffn=4 * args.hidden,
        seq_len=args.seq,
        layers=args.layers,
    )
    results = run_distributed(
        _measure, world_size=2, args=(args.steps, model, args.batch), timeout=1200
    )[0]
    print(
        f"torch {torch.__version__}, 2 gloo ranks (tp=2), 1 thread each; TinyGPT hidden {args.hidden}, "
        f"{args.layers} layers, seq {args.seq}, batch {args.batch}; median of {args.steps} steps, rank 0"
    )
    print(
        f"{'rng_mode':<10}{'recompute':<11}{'step ms':>8}{'peak MB':>9}{'time/none':>10}{'mem/none':>9}"
        f"{'time/megatron':>14}{'time/invariant':>15}{'forks/step':>11}{'fork share':>11}"
    )
    for (mode, recompute), r in results.items():
        none = results[(mode, "none")]
        megatron, invariant = results[("megatron", recompute)], results[("invariant", recompute)]
        print(
            f"{mode:<10}{recompute:<11}{r['time'] * 1e3:8.1f}{r['peak'] / 1e6:9.2f}{r['time'] / none['time']:10.2f}"
            f"{r['peak'] / none['peak']:9.2f}{r['time'] / megatron['time']:14.2f}"
            f"{r['time'] / invariant['time']:15.2f}{r['forks_per_step']:11.0f}{r['fork_share'] * 100:10.2f}%"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return
    labels = [f"{m}\n{r}" for m, r in results]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    palette = {"megatron": "tab:blue", "invariant": "tab:orange", "keyed": "tab:green"}
    colors = [palette[m] for m, _ in results]
    ax_mem.bar(labels, [r["peak"] / 1e6 for r in results.values()], color=colors)
    ax_mem.set_ylabel("peak live heap per step (MB)")
    ax_time.bar(labels, [r["time"] * 1e3 for r in results.values()], color=colors)
    ax_time.set_ylabel("median step time (ms)")
    for ax in (ax_mem, ax_time):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("TinyGPT on 2 gloo ranks (tp=2): recompute and rng modes")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {os.path.normpath(args.png)}")


if __name__ == "__main__":
    main()
