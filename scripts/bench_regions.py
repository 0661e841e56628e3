"""CPU cost of placements on the reference path, and of today's index maps against an older commit.

Times ``fused_dropout_reference`` (mask generation and the fused arithmetic, no op dispatch or
generator draw) for an unsharded tensor, equal-chunk shards (a contiguous block, and a column
shard: one division), an unaligned box and a box of 4 merged dims, as ratios to the unsharded
call measured in the same run. With ``--baseline REV`` it also loads that commit's
philox/shard/reference modules into this process and times them on the placements they
support, interleaved call by call with today's, so machine load hits both alike.

    python scripts/bench_regions.py [--baseline 4c67e51] [--log2 16 18 20] [--reps 15] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rng_tracker.kernels._index_map import Chunk, Region, index_map_of
from rng_tracker.kernels.reference import fused_dropout_reference

_HIDDEN = 1024
_P = 0.1


def _load_baseline(rev: str):
    """That commit's kernels/{philox,shard,reference}.py as a private package (no op registration)."""
    root = Path(tempfile.mkdtemp(prefix="rng_baseline_"))
    package = root / "_rng_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    words = 4
    for name in ("philox", "shard", "reference"):
        source = subprocess.run(
            ["git", "show", f"{rev}:kernels/{name}.py"], capture_output=True, text=True, check=True
        ).stdout
        (package / f"{name}.py").write_text(
            source.replace("rng_tracker.kernels.", "_rng_baseline.")
        )
        if name == "reference" and "c2, c3" not in source:
            words = 2  # before explicit seed words: [key, base]
    sys.path.insert(0, str(root))
    shard = importlib.import_module("_rng_baseline.shard")
    return shard, importlib.import_module("_rng_baseline.reference"), words


def _old_shard(module, dim: int, index: int, count: int, extent: int):
    """The baseline's Chunk (``extent`` only where that revision has it)."""
    try:
        return module.Chunk(dim, index, count, extent=extent)
    except TypeError:
        return module.Chunk(dim, index, count)


def _median_interleaved(fns: list[Callable[[], object]], reps: int) -> list[float]:
    for fn in fns:  # warm-up
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision to compare against")
    parser.add_argument("--log2", type=int, nargs="+", default=[16, 18, 20])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline = _load_baseline(args.baseline) if args.baseline else None
    load = os.getloadavg()[0]
    print(
        f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, load average "
        f"{load:.1f} at start; reference path fwd, fp32, ms per call (median of {args.reps})"
    )
    header = f"{'placement':<24}{'N':>5}{'ms':>10}{'/unsharded':>11}"
    if baseline:
        header += f"{'baseline ms':>13}{'/baseline':>10}"
    print(header)
    seed = torch.tensor([0x1234_5678_9ABC, 0, 0, 0])
    old_seed = seed[: baseline[2]].clone() if baseline else None  # its seed words
    for log2 in args.log2:
        rows = 2**log2 // _HIDDEN
        full = torch.randn(rows, _HIDDEN)
        # name -> (local tensor, today's placement, the baseline's equivalent or None); every
        # local tensor has the same 2**log2 elements.
        cases = {
            "unsharded": (full, None, lambda m: None),
            "Chunk rows (block)": (
                full,
                Chunk(0, 1, 4, extent=rows * 4),
                lambda m, rows=rows: _old_shard(m, 0, 1, 4, rows * 4),
            ),
            "Chunk columns (gap)": (
                full,
                Chunk(1, 1, 4, extent=_HIDDEN * 4),
                lambda m: _old_shard(m, 1, 1, 4, _HIDDEN * 4),
            ),
            "Region unaligned box": (full, Region((rows, _HIDDEN + 3), (0, 3)), None),
            "Region 4-d box": (
                full.reshape(2, rows // 2, 2, _HIDDEN // 2),
                Region((4, rows, 4, _HIDDEN), (1, 0, 1, 4)),
                None,
            ),
        }
        unsharded_ms = None
        for name, (local, placement, old) in cases.items():
            local = local.contiguous()
            layout = index_map_of(local.shape, placement)
            fns = [
                lambda x=local, lay=layout: fused_dropout_reference(x, None, None, seed, _P, lay)
            ]
            if baseline and old is not None:
                old_shard, old_reference, _ = baseline
                old_layout = old_shard.index_map_of(local.shape, old(old_shard))
                fns.append(
                    lambda x=local, lay=old_layout, ref=old_reference: ref.fused_dropout_reference(
                        x, None, None, old_seed, _P, lay
                    )
                )
            times = [t * 1e3 for t in _median_interleaved(fns, args.reps)]
            unsharded_ms = unsharded_ms or times[0]
            line = (
                f"{name:<24}{'2^' + str(log2):>5}{times[0]:>10.2f}{times[0] / unsharded_ms:>11.2f}"
            )
            if len(times) == 2:
                line += f"{times[1]:>13.2f}{times[0] / times[1]:>10.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
