"""Compare the compiled CPU dropout kernel of two revisions, call by call, in one process.

Builds ``kernels/cpu_dropout.c`` (with the headers it includes) as it is at ``--base`` (a git
revision) and as it is in the working tree, loads both, and times one call of each in turn on
the same tensors, so the machine's load and the caches' state hit both alike: what a change to
the C code gains or costs, without the Python around it. Prints G elements/s per library and
the ratio new / base (> 1: the working tree is faster).

    python scripts/bench_kernel_ab.py --base HEAD~1                  # 1 thread
    python scripts/bench_kernel_ab.py --base HEAD~1 --cold           # caches flushed per call
    python scripts/bench_kernel_ab.py --base HEAD~1 --threads 2 --min-log2 22 --max-log2 24
    python scripts/bench_kernel_ab.py --base HEAD~1 --isa avx2        # both on one path

Both libraries must have the same ABI (``rt_abi_version``): the arguments are built once, by
the working tree's ``rng_tracker.kernels._cpu_kernel``, and each library picks the fastest
instruction-set path it has for this CPU (a base without the AVX-512 path runs AVX2).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rng_tracker.kernels import _c_build, _cpu_kernel
from rng_tracker.kernels._index_map import index_map_of

REPOSITORY = Path(__file__).resolve().parent.parent
SOURCE = "cpu_dropout.c"


def _files_at(revision: str | None) -> dict[str, bytes]:
    """The kernel's source and the headers it includes (followed from its ``#include "..."``
    lines, so a revision with other headers builds too) at a git revision (None: the working
    tree)."""

    def read(name: str) -> bytes:
        if revision is None:
            return (REPOSITORY / "kernels" / name).read_bytes()
        shown = subprocess.run(
            ["git", "show", f"{revision}:kernels/{name}"], cwd=REPOSITORY, capture_output=True
        )
        if shown.returncode != 0:
            raise SystemExit(
                f"kernels/{name} is not at {revision!r} ({shown.stderr.decode().strip()}); "
                "pick a revision that has the kernel"
            )
        return shown.stdout

    return _c_build.source_files(SOURCE, read)


def _build(files: dict[str, bytes], directory: Path) -> ctypes.CDLL:
    """Compile ``files`` as the library does (its flags and compiler) into ``directory``."""
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_bytes(text)
    built = directory / "kernel.so"
    subprocess.run(
        [_c_build._compiler(), *_c_build.FLAGS, str(directory / SOURCE), "-o", str(built)],
        check=True,
    )
    library = ctypes.CDLL(str(built))
    library.rt_fused_dropout.restype = ctypes.c_int64
    library.rt_fused_dropout.argtypes = [*(ctypes.c_void_p,) * 4, ctypes.POINTER(ctypes.c_int64)]
    return library


def _calls(
    libraries: list[ctypes.CDLL],
    n: int,
    dtype: torch.dtype,
    with_bias: bool,
    threads: int,
    p: float,
    fresh: bool,
) -> list[Callable[[], int]]:
    """One kernel call per library, all on the same tensors (so on the same memory: where an
    allocation lands changes a call's speed), kept alive by the closures. ``fresh``: each call
    writes a new output instead, allocated in the call, as a dropout call's is; then a last
    callable clones x (the memory limit the issue measures against)."""
    hidden = 1024
    x = torch.randn(n, dtype=dtype)
    out = torch.empty_like(x)
    bias = torch.randn(hidden, dtype=dtype) if with_bias else None
    residual = torch.randn_like(x) if with_bias else None
    args = _cpu_kernel._arguments(
        index_map_of(x.shape, None), dtype, hidden if with_bias else 0, p, threads
    )
    args[_cpu_kernel._ARG_KEY : _cpu_kernel._ARG_KEY + 4] = (0x1234_5678_9ABC_DEF, 77, 3, 9)
    pointers = (
        x.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
    )

    def call_of(library: ctypes.CDLL) -> Callable[[], int]:
        def call(keep_alive: tuple = (x, out, bias, residual)) -> int:
            return library.rt_fused_dropout(*pointers, args)

        def call_fresh(keep_alive: tuple = (x, bias, residual)) -> int:
            new = torch.empty_like(x)
            return library.rt_fused_dropout(*pointers[:3], new.data_ptr(), args)

        if call() != 0:
            raise SystemExit("a library refused the arguments: does it have the path --isa names?")
        return call_fresh if fresh else call

    def clone() -> int:
        x.clone()
        return 0

    return [call_of(library) for library in libraries] + ([clone] if fresh else [])


def _best_of_interleaved(
    calls: list[Callable[[], int]],
    repeats: int,
    clock: Callable[[], float],
    flush: Callable[[], object],
) -> list[float]:
    for call in calls:  # warm-up: pages mapped, code paged in
        call()
    best = [float("inf")] * len(calls)
    for repeat in range(repeats):
        order = range(len(calls)) if repeat % 2 == 0 else reversed(range(len(calls)))
        for i in order:  # each goes first as often: neither inherits the other's cache more
            call = calls[i]
            flush()
            start = clock()
            status = call()
            best[i] = min(best[i], clock() - start)
            if status != 0:
                raise RuntimeError(f"the kernel refused its arguments (status {status})")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline kernel")
    parser.add_argument("--threads", type=int, default=1, help="threads per kernel call")
    parser.add_argument("--min-log2", type=int, default=16)
    parser.add_argument("--max-log2", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=40, help="timed calls per figure (best)")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument(
        "--isa",
        choices=[name for name in _c_build.ISA_CODES],
        default="auto",
        help="instruction-set path both libraries run (auto: each its fastest)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="write 64 MiB elsewhere before each call"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="a new output per call, allocated as a dropout call's is (a new mapping from 32 MiB "
        "on; malloc may reuse memory below), and a clone of x alongside",
    )
    args = parser.parse_args()
    _cpu_kernel._state["isa"] = _c_build.ISA_CODES[args.isa]  # read into every call's arguments
    torch.set_num_threads(args.threads)  # the clone runs on as many threads as the kernels

    # one thread: its CPU time (descheduled time does not count); more: the wall clock
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    junk = torch.zeros(16 << 20 if args.cold else 0)  # 64 MiB: beyond this machine's caches

    def flush() -> object:
        return junk.add_(1.0) if args.cold else None

    with tempfile.TemporaryDirectory() as scratch:
        base = _build(_files_at(args.base), Path(scratch) / "base")
        new = _build(_files_at(None), Path(scratch) / "new")
        if base.rt_abi_version() != new.rt_abi_version():
            raise SystemExit("the two kernels have different ABIs: their arguments differ")
        print(
            f"kernel at {args.base} (base) against the working tree (new), path {args.isa}: "
            f"{args.threads} "
            f"thread(s), {'caches flushed before each call' if args.cold else 'caches not flushed'}, "
            f"{'a new output per call, ' if args.fresh else ''}"
            f"best of {args.repeats} interleaved calls, G elements/s"
            + (
                "; base/clone, new/clone: time over a clone of x's (bias_dropout_add moves 1.5x "
                "a clone's bytes)"
                if args.fresh
                else ""
            )
        )
        print(
            f"{'dtype':<9}{'op':<18}{'N':>5}{'base':>8}{'new':>8}{'new/base':>10}"
            + (f"{'base/clone':>12}{'new/clone':>11}" if args.fresh else "")
        )
        for dtype in (torch.float32, torch.bfloat16):
            for with_bias in (False, True):
                for log2 in range(args.min_log2, args.max_log2 + 1, 2):
                    n = 2**log2
                    calls = _calls(
                        [base, new], n, dtype, with_bias, args.threads, args.p, args.fresh
                    )
                    t_base, t_new, *t_clone = _best_of_interleaved(
                        calls, args.repeats, clock, flush
                    )
                    clone_ratios = "".join(f"{t_base / t:12.2f}{t_new / t:11.2f}" for t in t_clone)
                    op = "bias_dropout_add" if with_bias else "dropout"
                    label = str(dtype).replace("torch.", "")
                    print(
                        f"{label:<9}{op:<18}{'2^' + str(log2):>5}{n / t_base / 1e9:8.2f}"
                        f"{n / t_new / 1e9:8.2f}{t_base / t_new:10.2f}{clone_ratios}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
