"""DTensor dropout per call: rng_tracker.parallel.dtensor.dropout against torch's F.dropout on the
same DTensor, on CPU gloo ranks, one run.

Each rank of a 2-rank mesh times a DTensor sharded by rows (Shard(0)) at a few shapes: ours
drawn (from the default generator, as torch's) and keyed (``seed=``), and torch's
``F.dropout`` (its DTensor random ops: the offset-based tracker). Prints rank 0's median
milliseconds per call over several repeats and the ratio ours / torch's (below 1.00 means
ours is faster). Both compute the mask on the local shard only; what differs is the placement
arithmetic and the kernel.

    python scripts/bench_dtensor_dropout.py [--iters 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = ((8, 16), (512, 1024), (4096, 1024))


def _per_call(body, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        body()
    return (time.perf_counter() - start) / iters


def _rank(iters: int, repeats: int) -> list[tuple[tuple[int, int], dict[str, float]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rng_tracker.parallel import dtensor

    torch.set_num_threads(1)  # two ranks on one machine: one core each
    mesh = init_device_mesh("cpu", (2,))
    seed = torch.tensor([7, 0, 1, 0])
    rows = []
    for shape in SHAPES:
        x = distribute_tensor(
            torch.randn(shape, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]
        )
        bodies = {
            "ours, drawn": lambda x=x: dtensor.dropout(x, 0.1),
            "ours, keyed": lambda x=x: dtensor.dropout(x, 0.1, seed=seed),
            "torch F.dropout": lambda x=x: F.dropout(x, 0.1),
        }
        samples: dict[str, list[float]] = {name: [] for name in bodies}
        for body in bodies.values():
            body()  # warm-up: the compiled CPU kernel loads, torch's tracker starts
        for _ in range(repeats):  # interleaved so drift hits all alike
            for name, body in bodies.items():
                samples[name].append(_per_call(body, iters))
        rows.append((shape, {name: statistics.median(v) for name, v in samples.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from rng_tracker.parallel.testing import run_distributed

    rows = run_distributed(_rank, world_size=2, args=(args.iters, args.repeats), timeout=600)[0]
    print(
        f"torch {torch.__version__}, 2 CPU gloo ranks, Shard(0), p = 0.1, rank 0's median of "
        f"{args.repeats} x {args.iters} calls"
    )
    for shape, medians in rows:
        torchs = medians["torch F.dropout"]
        print(f"  global {shape}:")
        for name, value in medians.items():
            ratio = "" if name.startswith("torch") else f"  ratio {value / torchs:.2f}"
            print(f"    {name:<16} {value * 1e3:8.3f} ms per call{ratio}")


if __name__ == "__main__":
    main()
