"""Fork enter+exit cost: RNGStatesTracker.fork against torch.random.fork_rng, on CPU, one run.

Prints the median per-iteration time of each over several repeats and the ratio
tracker / fork_rng (below 1.0 means the tracker is faster). The body draws nothing,
so the figure is the pure cost of saving and restoring generator state.

    python scripts/bench_fork.py [--iters 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rng_tracker import RNGStatesTracker


def _time_per_iter(body, iters: int) -> float:
    start = time.perf_counter()
    body(iters)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 1234)

    def tracker_fork(n: int) -> None:
        fork = tracker.fork
        for _ in range(n):
            with fork("model-parallel-rng"):
                pass

    def torch_fork_rng(n: int) -> None:
        for _ in range(n):
            with torch.random.fork_rng(devices=[]):
                pass

    samples: dict[str, list[float]] = {"tracker.fork": [], "torch.random.fork_rng": []}
    for body in (tracker_fork, torch_fork_rng):
        body(1000)  # warm-up
    for _ in range(args.repeats):  # interleaved so drift hits both alike
        samples["tracker.fork"].append(_time_per_iter(tracker_fork, args.iters))
        samples["torch.random.fork_rng"].append(_time_per_iter(torch_fork_rng, args.iters))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"torch {torch.__version__}, CPU generator, {args.iters} forks x {args.repeats} repeats")
    for name, value in medians.items():
        print(f"  {name:<24} {value * 1e6:8.2f} us per enter+exit")
    ratio = medians["tracker.fork"] / medians["torch.random.fork_rng"]
    print(f"  ratio tracker.fork / torch.random.fork_rng = {ratio:.2f} (target: <= 1.00)")


if __name__ == "__main__":
    main()
