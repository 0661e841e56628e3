"""Fused dropout throughput and saved memory against eager torch, torch.compile and a copy.

On a GPU: effective GB/s of forward and backward of dropout and bias-dropout-add (bf16,
fp32; 2**20..2**28 elements) for rng_tracker's Triton kernel, eager torch (the unfused
sequence), torch.compile of that sequence, and a device-to-device copy (the bandwidth
bound), with ratios against eager and copy, all measured in this run (backward: the gradients
of every input, as a training step asks for them); then the host time per call at 2**10
elements (the fixed cost), against F.dropout, a clone and an empty Triton kernel.

On a CPU (the compiled kernel, impl="cpu", kernels/cpu_dropout.c; medians of repeats with
ours and the baseline interleaved, so load drifts hit both alike):
1. memory limit: forward and backward against ``x.clone()`` at 2**24 and 2**26 elements (bf16,
   fp32; the generator-drawn and the keyed seed), all threads;
2. per core: elements/s on one thread at 2**16..2**20, of the whole call and of the kernel
   alone (one ctypes call into the library: what the C code itself sustains), per
   instruction-set path;
3. fixed cost: 256 elements against F.dropout, forward and forward+backward, one thread;
4. against eager torch (F.dropout, the eager three-op bias-dropout-add), 2**16..2**24;
5. start-up in fresh processes: a cold build (empty kernel cache), the first call with a
   warm cache, and a call on a new size;
6. in place: ``dropout(x, p, True, True)`` against F.dropout(inplace=True) and our out-of-place
   call, 2**20 and 2**24, with the bytes of tensors each allocates per call (profiler).
Both print the bytes saved for backward per call (saved-tensor hooks).

Effective bytes are the bytes an op must move: dropout fwd/bwd 2N elements (read, write);
bias-dropout-add fwd 3N (x, residual, out), bwd 2N (grad in, grad out).

    python scripts/bench_dropout.py [--min-log2 20] [--max-log2 28] [--p 0.1]
    python scripts/bench_dropout.py --sections limit,core,fixed   # CPU: some sections only
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rng_tracker.kernels import bias_dropout_add, dropout

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU sections need no triton
    triton = None

if triton is not None:

    @triton.jit
    def _empty_kernel(x_ptr):
        """Loads one word: its launch is the floor of any Triton call's host cost."""
        tl.load(x_ptr)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100) / 1e3  # seconds

    def cpu_time(fn: Callable[[], object]) -> float:
        for _ in range(3):  # warm-up (thread pool, allocator)
            fn()
        samples = []
        for _ in range(15):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return cpu_time


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def _eager_dropout(x, bias, residual, p):
    return F.dropout(x, p)


def _eager_bda(x, bias, residual, p):
    return residual + F.dropout(x + bias, p)


def _bench_size(n, dtype, device, timer, ours, eager_ops, compiled_ops, p) -> None:
    """Print fwd and bwd rows of both ops at ``n`` elements of ``dtype``."""
    hidden = 1024
    x = torch.randn(n // hidden, hidden, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn_like(x, requires_grad=True)
    grad = torch.randn_like(x)
    copy_dst = torch.empty_like(x)
    copy_gbs = 2 * n * x.element_size() / timer(lambda: copy_dst.copy_(x.detach())) / 1e9
    for op, fwd_elems in (("dropout", 2), ("bias_dropout_add", 3)):
        impls = {"ours": ours[op], "eager": eager_ops[op]}
        if op in compiled_ops:
            impls["compile"] = compiled_ops[op]
        rows: dict[str, dict[str, float]] = {"fwd": {}, "bwd": {}}
        for name, fn in impls.items():
            fwd_s = timer(lambda fn=fn: fn(x, bias, residual, p))
            rows["fwd"][name] = fwd_elems * n * x.element_size() / fwd_s / 1e9
            out = fn(x, bias, residual, p)
            # every input's gradient, as a training step asks (for bias_dropout_add, the bias's
            # sum too; asking for x's alone would let eager skip it and not the fused op)
            wrt = (x,) if op == "dropout" else (x, bias, residual)
            bwd_s = timer(
                lambda out=out, wrt=wrt: torch.autograd.grad(out, wrt, grad, retain_graph=True)
            )
            rows["bwd"][name] = 2 * n * x.element_size() / bwd_s / 1e9
        for pass_name, r in rows.items():
            comp = _gbs(r["compile"], 8) if "compile" in r else f"{'-':>8}"
            print(
                f"{op:<17}{str(dtype).replace('torch.', ''):<9}{'2^' + str(n.bit_length() - 1):>6} {pass_name:<4}"
                f"{_gbs(r['ours'], 10)}{_gbs(r['eager'], 8)}{comp}{_gbs(copy_gbs, 8)}  "
                f"{r['ours'] / r['eager']:10.3f}{r['ours'] / copy_gbs:10.3f}"
            )


def _gbs(value: float, width: int) -> str:
    """GB/s with one decimal, or three significant digits below 10 (CPU reference figures)."""
    return f"{value:{width}.1f}" if value >= 10 else f"{value:{width}.3g}"


def _interleaved_medians(
    fns: list[Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> list[float]:
    """Median seconds of each fn, run in turn each repeat so load drifts hit all alike.

    ``clock=time.thread_time`` counts the calling thread's CPU time only (single-threaded
    figures on a shared machine: time spent descheduled does not count)."""
    for fn in fns:  # warm-up: kernels built, allocator and thread pool primed
        fn()
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples, strict=True):
            start = clock()
            fn()
            out.append(clock() - start)
    return [statistic(v) for v in samples]


def _looped(
    fn: Callable[[], object], calls: int, sync: Callable[[], object] | None = None
) -> Callable[[], object]:
    """``fn`` run ``calls`` times (then ``sync``): one timed sample of a microsecond call."""

    def run() -> None:
        for _ in range(calls):
            fn()
        if sync is not None:
            sync()

    return run


def _cpu_rows(n: int, dtype: torch.dtype, p: float, repeats: int) -> None:
    hidden = 1024
    x = torch.randn(n // hidden, hidden, dtype=dtype, requires_grad=True)
    bias = torch.randn(hidden, dtype=dtype)
    residual = torch.randn_like(x)
    grad = torch.randn_like(x)
    ops = {
        "dropout": (lambda: dropout(x, p, impl="cpu"), lambda: F.dropout(x, p)),
        "bias_dropout_add": (
            lambda: bias_dropout_add(x, bias, residual, p, impl="cpu"),
            lambda: residual + F.dropout(x + bias, p),
        ),
    }
    for name, (ours, base) in ops.items():
        ours_out, base_out = ours(), base()

        def both(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
            return lambda: torch.autograd.grad(fn(), (x,), grad)

        fwd, base_fwd, bwd, fb, base_fb = _interleaved_medians(
            [
                ours,
                base,
                lambda out=ours_out: torch.autograd.grad(out, (x,), grad, retain_graph=True),
                both(ours),
                both(base),
            ],
            repeats,
        )
        del base_out
        label = str(dtype).replace("torch.", "")
        print(
            f"{name:<17}{label:<9}{'2^' + str(n.bit_length() - 1):>5}"
            f"{fwd * 1e3:9.2f}{base_fwd * 1e3:9.2f}{base_fwd / fwd:8.2f}"
            f"{bwd * 1e3:9.2f}{bwd / fwd:8.2f}{fb * 1e3:9.2f}{base_fb * 1e3:9.2f}{fb / base_fb:8.2f}",
            flush=True,
        )


_STARTUP = """
import time
clock = lambda: (time.perf_counter(), time.process_time())
t0 = clock()
import torch
from rng_tracker.kernels import dropout
t1 = clock()
dropout(torch.randn(256, 256), 0.1, impl="cpu")
t2 = clock()
dropout(torch.randn(300, 77), 0.1, impl="cpu")
t3 = clock()
fmt = lambda a, b: f"{b[0] - a[0]:7.2f} s wall {b[1] - a[1]:6.2f} s cpu"
print(f"imports (torch, rng_tracker) {fmt(t0, t1)}")
print(f"first call                   {fmt(t1, t2)}")
print(f"call on a new size           {fmt(t2, t3)}")
"""


def _startup_report() -> None:
    """Cold build, then warm-cache first call and new size, each in a fresh process."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, RNG_TRACKER_CACHE_DIR=cache)
        for label in ("cold: empty kernel cache", "warm: the cache the cold run filled"):
            print(f"\n5. fresh process, {label}")
            result = subprocess.run(
                [sys.executable, "-c", _STARTUP], env=env, capture_output=True, text=True
            )
            print(result.stdout.rstrip() or result.stderr[-2000:])


def _keyed_seed() -> torch.Tensor:
    return torch.tensor([0x1234_5678_9ABC, 0, 7, 3], dtype=torch.int64)


def _limit_rows(log2s: list[int], p: float, repeats: int) -> None:
    """Forward and backward against a clone, at sizes beyond the caches (all threads)."""
    print(
        f"\n1. memory limit: ms, median of {repeats} interleaved; {torch.get_num_threads()} "
        "threads; clone = x.clone() of the same tensor; target fwd/clone and bwd/clone: dropout "
        "<= 1.5, bias_dropout_add <= 2.0 (it moves 1.5x a clone's bytes)"
    )
    print(
        f"{'op':<17}{'dtype':<9}{'seed':<7}{'N':>5}{'fwd ms':>9}{'bwd ms':>9}{'clone ms':>10}"
        f"{'fwd/clone':>10}{'bwd/clone':>10}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for log2 in log2s:
            for seed_mode in ("drawn", "keyed"):
                for name in ("dropout", "bias_dropout_add"):
                    _limit_row(name, dtype, log2, seed_mode, p, repeats)


def _limit_row(name: str, dtype: torch.dtype, log2: int, seed_mode: str, p: float, repeats: int):
    x = torch.randn(2**log2 // 1024, 1024, dtype=dtype).requires_grad_()
    bias = torch.randn(1024, dtype=dtype)
    residual = torch.randn_like(x)
    grad = torch.randn_like(x)
    seed = _keyed_seed() if seed_mode == "keyed" else None

    def op() -> torch.Tensor:
        if name == "dropout":
            return dropout(x, p, seed=seed, impl="cpu")
        return bias_dropout_add(x, bias, residual, p, seed=seed, impl="cpu")

    out = op()
    fwd, bwd, clone = _interleaved_medians(
        [
            op,
            lambda: torch.autograd.grad(out, (x,), grad, retain_graph=True),
            lambda: x.detach().clone(),
        ],
        repeats,
    )
    label = str(dtype).replace("torch.", "")
    print(
        f"{name:<17}{label:<9}{seed_mode:<7}{'2^' + str(log2):>5}{fwd * 1e3:9.2f}"
        f"{bwd * 1e3:9.2f}{clone * 1e3:10.2f}{fwd / clone:10.2f}{bwd / clone:10.2f}",
        flush=True,
    )


def _kernel_only(x: torch.Tensor, p: float, path: str) -> Callable[[], object]:
    """One ctypes call into the compiled library (the arguments prepared once): the C code's
    own time, without the Python around it."""
    from rng_tracker.kernels import _c_build, _cpu_kernel
    from rng_tracker.kernels._index_map import index_map_of

    out = torch.empty_like(x)
    saved = _cpu_kernel._state["isa"]
    _cpu_kernel._state["isa"] = _c_build.ISA_CODES[path]
    try:
        args = _cpu_kernel._arguments(index_map_of(x.shape, None), x.dtype, 0, p, 1)
    finally:
        _cpu_kernel._state["isa"] = saved
    args[4:8] = (0x1234_5678, 0, 0, 0)
    library = _cpu_kernel._library()
    x_ptr, out_ptr = x.data_ptr(), out.data_ptr()

    def call(keep_alive: tuple[torch.Tensor, ...] = (x, out)) -> object:  # the pointers' owners
        return library.rt_fused_dropout(x_ptr, None, None, out_ptr, args)

    return call


_CORE_LOOP = 16  # calls per sample of the per-core section's loop columns


def _core_rows(log2s: list[int], p: float, repeats: int) -> None:
    """Elements/s on one thread (one core), the whole call and the kernel alone."""
    from rng_tracker.kernels import _c_build, _cpu_kernel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        paths = _cpu_kernel.isa_paths()
        forced = _cpu_kernel._state["isa"]
        picks = next(
            (
                f"{name} (forced by {_c_build.ISA_ENV})"
                for name, code in _c_build.ISA_CODES.items()
                if forced and code == forced
            ),
            f"{paths[-1]} (auto: the fastest)" if paths else "no compiled path",
        )
        print(
            f"\n2. per core: G elements/s on 1 thread (its CPU time: time.thread_time), best "
            f"of {repeats} interleaved; "
            f"call = dropout(x, p, impl='cpu') forward / its backward (torch.autograd.grad), "
            f"each a single call between the others (so its caches are cold); loop = "
            f"{_CORE_LOOP} such calls back to back (x and the output memory stay in cache); "
            f"kernel = one ctypes "
            f"call, per instruction-set path ({', '.join(paths)}); the call runs {picks}; "
            "copy = y.copy_(x) into a tensor made once, the same bytes as the kernel alone "
            "(the core's memory speed where x and y leave the caches); "
            "target >= 1.5 G elements/s"
        )
        header = f"{'dtype':<9}{'N':>5}" + "".join(
            f"{name:>10}" for name in ("call fwd", "call bwd", "loop fwd", "loop bwd")
        )
        print(header + "".join(f"{'kernel ' + path:>16}" for path in paths) + f"{'copy':>10}")
        for dtype in (torch.bfloat16, torch.float32):
            for log2 in log2s:
                _core_row(dtype, log2, p, repeats, paths)
    finally:
        torch.set_num_threads(threads)


def _core_row(dtype: torch.dtype, log2: int, p: float, repeats: int, paths: list[str]) -> None:
    n = 2**log2
    x = torch.randn(n, dtype=dtype).requires_grad_()
    grad = torch.randn_like(x)
    out = dropout(x, p, impl="cpu")
    copy = torch.empty_like(x.detach())

    def forward() -> object:
        return dropout(x.detach(), p, impl="cpu")

    def backward() -> object:
        return torch.autograd.grad(out, (x,), grad, retain_graph=True)

    times = _interleaved_medians(
        [
            forward,
            backward,
            _looped(forward, _CORE_LOOP),
            _looped(backward, _CORE_LOOP),
            *(_kernel_only(x.detach(), p, path) for path in paths),
            lambda: copy.copy_(x.detach()),
        ],
        repeats,
        clock=time.thread_time,
        statistic=min,  # what the code sustains: load only ever adds time
    )
    times[2:4] = [t / _CORE_LOOP for t in times[2:4]]
    label = str(dtype).replace("torch.", "")
    print(
        f"{label:<9}{'2^' + str(log2):>5}"
        + "".join(
            f"{n / t / 1e9:{16 if 4 <= i < 4 + len(paths) else 10}.2f}" for i, t in enumerate(times)
        ),
        flush=True,
    )


def _fixed_rows(p: float, repeats: int) -> None:
    """The fixed cost of a call: 256 elements against F.dropout, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(256)
        xg = torch.randn(256, requires_grad=True)
        grad = torch.randn(256)
        calls = 200  # per timed sample: microsecond calls need a loop to time
        ours_f, base_f, ours_fb, base_fb, floor_fb = _interleaved_medians(
            [
                _looped(lambda: dropout(x, p), calls),
                _looped(lambda: F.dropout(x, p), calls),
                _looped(lambda: dropout(xg, p).backward(grad), calls),
                _looped(lambda: F.dropout(xg, p).backward(grad), calls),
                _looped(lambda: _Doubled.apply(xg).backward(grad), calls),
            ],
            repeats,
            clock=time.thread_time,
        )
        print(
            f"\n3. fixed cost: 256 elements, 1 thread, us of its CPU time (time.thread_time) per "
            f"call (median of {repeats} interleaved samples of {calls} calls); target "
            "ours/F.dropout <= 2"
        )
        print(f"{'pass':<18}{'ours us':>9}{'F.dropout us':>14}{'ours/F.dropout':>16}")
        for label, ours, base in (
            ("forward", ours_f, base_f),
            ("forward+backward", ours_fb, base_fb),
        ):
            print(
                f"{label:<18}{ours / calls * 1e6:9.1f}{base / calls * 1e6:14.1f}{ours / base:16.2f}"
            )
        print(
            f"floor: any Python autograd.Function (one that doubles x), forward+backward: "
            f"{floor_fb / calls * 1e6:.1f} us, {floor_fb / base_fb:.2f}x F.dropout's"
        )
    finally:
        torch.set_num_threads(threads)


class _Doubled(torch.autograd.Function):
    """The least a Python autograd.Function costs (ours is one): x * 2 and its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2.0


def _allocated_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the tensors torch allocates on the CPU during one call of ``fn`` (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def _inplace_rows(log2s: list[int], p: float, repeats: int) -> None:
    """``dropout(x, p, True, inplace=True)`` against torch's in-place dropout and our own
    out-of-place call: time, and the bytes of tensors allocated per call (the peak's excess)."""
    print(
        f"\n6. in place: ms, median of {repeats} interleaved; {torch.get_num_threads()} threads; "
        "torch = F.dropout(x, p, True, inplace=True); MB = tensors allocated per call\n"
        f"{'dtype':<9}{'N':>5}{'ours ms':>9}{'torch ms':>9}{'out-of-place ms':>16}"
        f"{'torch/ours':>11}{'ours MB':>9}{'torch MB':>9}{'out-of-place MB':>16}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for log2 in log2s:
            x = torch.randn(2**log2 // 1024, 1024, dtype=dtype)
            calls = [
                lambda x=x: dropout(x, p, True, True, impl="cpu"),
                lambda x=x: F.dropout(x, p, True, inplace=True),
                lambda x=x: dropout(x, p, impl="cpu"),
            ]
            ours, base, copy = _interleaved_medians(calls, repeats)
            ours_mb, base_mb, copy_mb = (_allocated_bytes(call) / 2**20 for call in calls)
            label = str(dtype).replace("torch.", "")
            print(
                f"{label:<9}{'2^' + str(log2):>5}{ours * 1e3:9.2f}{base * 1e3:9.2f}"
                f"{copy * 1e3:16.2f}{base / ours:11.2f}{ours_mb:9.1f}{base_mb:9.1f}{copy_mb:16.1f}",
                flush=True,
            )


_SECTIONS = ("limit", "core", "fixed", "eager", "startup", "inplace")


def _huge_pages() -> str:
    """Whether a new output's pages may be huge: the kernels' setting and the system's mode (the
    limit section's figures depend on both)."""
    from rng_tracker.kernels import _c_build

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as modes:
            system = modes.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        system = "none"
    asked = "asked" if _c_build.HUGE_PAGES else f"not asked ({_c_build.HUGE_PAGES_ENV}=0)"
    return f"huge pages for new outputs: {asked}, transparent huge pages {system}"


def _cpu_main(args: argparse.Namespace) -> None:
    from rng_tracker.kernels import _cpu_kernel

    sections = args.sections.split(",") if args.sections else list(_SECTIONS)
    unknown = set(sections) - set(_SECTIONS)
    if unknown:
        raise SystemExit(f"unknown --sections {sorted(unknown)}; choose from {_SECTIONS}")
    lo = args.min_log2 if args.min_log2 is not None else 16
    hi = args.max_log2 if args.max_log2 is not None else 24
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"CPU ({_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, load "
        f"average {load:.1f}), torch {torch.__version__}; impl='cpu' (kernels/cpu_dropout.c, "
        f"paths {_cpu_kernel.isa_paths()}), p={args.p}; {_huge_pages()}"
    )
    if "limit" in sections:
        _limit_rows([24, 26], args.p, max(5, args.repeats // 2))
    if "core" in sections:
        _core_rows([16, 18, 20], args.p, args.repeats)
    if "fixed" in sections:
        _fixed_rows(args.p, args.repeats)
    if "eager" in sections:
        _eager_rows(lo, hi, args)
    if "startup" in sections and not args.no_startup:
        _startup_report()
    if "inplace" in sections:
        _inplace_rows([20, 24], args.p, args.repeats)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _eager_rows(lo: int, hi: int, args: argparse.Namespace) -> None:
    print(f"\n4. against eager torch: ms = median of {args.repeats}, interleaved")
    print(
        f"{'op':<17}{'dtype':<9}{'N':>5}{'fwd ms':>9}{'base':>9}{'base/us':>8}"
        f"{'bwd ms':>9}{'bwd/fwd':>8}{'f+b ms':>9}{'base':>9}{'us/base':>8}"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for log2 in range(lo, hi + 1, 2):
            _cpu_rows(2**log2, dtype, args.p, args.repeats)
    print(
        "base = F.dropout (dropout) or residual + F.dropout(x + bias) (bias_dropout_add). "
        "targets: dropout base/us >= 1.0; bias_dropout_add base/us >= 1.5; bwd/fwd <= 1.5; "
        "dropout f+b us/base <= 2"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-log2", type=int, default=None)
    parser.add_argument("--max-log2", type=int, default=None)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument(
        "--repeats",
        type=int,
        default=15,
        help="timed repeats per figure (the CPU sections and the GPU fixed cost)",
    )
    parser.add_argument("--no-startup", action="store_true", help="CPU: skip the start-up runs")
    parser.add_argument(
        "--sections", default=None, help=f"CPU: comma-separated subset of {','.join(_SECTIONS)}"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU: torch.set_num_threads for both sides"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _cpu_main(args)
        _print_saved_bytes(torch.device("cpu"), "cpu")
        return
    device = torch.device("cuda")
    lo = args.min_log2 if args.min_log2 is not None else 20
    hi = args.max_log2 if args.max_log2 is not None else 28
    timer = _timer(device)
    impl = "triton"
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    compile_ok = not args.no_compile
    eager_ops = {"dropout": _eager_dropout, "bias_dropout_add": _eager_bda}
    if compile_ok and hasattr(torch._functorch.config, "donated_buffer"):
        # backward is timed again and again over one graph (retain_graph=True), which a compiled
        # backward that donates its saved buffers refuses
        torch._functorch.config.donated_buffer = False
    compiled_ops = {k: torch.compile(v) for k, v in eager_ops.items()} if compile_ok else {}
    ours = {
        "dropout": lambda x, b, r, p: dropout(x, p, impl=impl),
        "bias_dropout_add": lambda x, b, r, p: bias_dropout_add(x, b, r, p, impl=impl),
    }
    header = f"{'op':<17}{'dtype':<9}{'N':>6} {'pass':<4}{'ours GB/s':>10}{'eager':>8}{'compile':>8}{'copy':>8}  {'ours/eager':>10}{'ours/copy':>10}"
    print(header)
    for dtype in (torch.bfloat16, torch.float32):
        for log2 in range(lo, hi + 1, 2):
            _bench_size(2**log2, dtype, device, timer, ours, eager_ops, compiled_ops, args.p)
    print("targets (H100): bias_dropout_add ours/copy >= 0.85 and ours/eager >= 2")
    _gpu_fixed_rows(args.p, args.repeats)
    _print_saved_bytes(device, impl)


def _gpu_fixed_rows(p: float, repeats: int) -> None:
    """Host time per call at 2**10 elements, where launching is all the work: where it goes."""
    from rng_tracker.kernels._call import dropout_call
    from rng_tracker.kernels._index_map import index_map_of
    from rng_tracker.kernels._triton_kernel import fused_dropout_triton

    x = torch.randn(1024, device="cuda")
    xg = torch.randn(1024, device="cuda", requires_grad=True)
    grad = torch.randn(1024, device="cuda")
    seed = torch.tensor([3, 0, 0, 0], device="cuda")
    call = dropout_call(x, None, None, p, index_map_of(x.shape, None))
    calls = 200
    rows = {
        "F.dropout": lambda: F.dropout(x, p),
        "x.clone()": lambda: x.clone(),
        "dropout, drawn (generator)": lambda: dropout(x, p, impl="triton"),
        "dropout, keyed (seed on GPU)": lambda: dropout(x, p, seed=seed, impl="triton"),
        "its Triton launch alone": lambda: fused_dropout_triton(call, seed),
        "its launch, words as arguments": lambda: fused_dropout_triton(call, (3, 0, 0, 0)),
        "an empty Triton kernel (the floor)": lambda: _empty_kernel[(1,)](x),
        "F.dropout forward+backward": lambda: F.dropout(xg, p).backward(grad),
        "dropout forward+backward, drawn": lambda: dropout(xg, p, impl="triton").backward(grad),
    }

    times = _interleaved_medians(
        [_looped(fn, calls, torch.cuda.synchronize) for fn in rows.values()], repeats
    )
    print(
        f"\nfixed cost: 2^10 fp32 elements, us of host time per call (median of {repeats} "
        f"interleaved samples of {calls} calls, synced)"
    )
    for name, seconds in zip(rows, times, strict=True):
        print(f"  {name:<36}{seconds / calls * 1e6:8.1f}")


def _print_saved_bytes(device: torch.device, impl: str) -> None:
    print("\nbytes saved for backward per call (saved-tensor hooks), fp32:")
    for label, numel in (("2^10 elements", 2**10), ("2^16 elements", 2**16)):
        x = torch.randn(numel, device=device, requires_grad=True)
        print(
            f"  {label}: rng_tracker dropout {_saved_bytes(lambda x=x: dropout(x, 0.5, impl=impl))} B, "
            f"F.dropout {_saved_bytes(lambda x=x: F.dropout(x, 0.5))} B"
        )


if __name__ == "__main__":
    main()
