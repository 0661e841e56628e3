"""The compiled CPU dropout kernel (kernels/cpu_dropout.c) against the plain-torch reference.

Invariant: for every dtype, op variant, size, placement and thread count, ``impl="cpu"`` (and
``"auto"`` on CPU) returns the reference's output bit for bit, forward and backward, whether
called directly (eager) or through the op (under dispatch modes and torch.compile). The
library is built once per source and platform; a warm cache needs no compiler, and where no
C compiler runs on a cold cache, the reference runs after one warning.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _dispatch_log import OpNames

from rng_tracker.errors import KernelUnavailableError
from rng_tracker.kernels import (
    Chunk,
    Region,
    _c_build,
    _cpu_kernel,
    _dispatch,
    _keyed_fill,
    bias_dropout_add,
    dropout,
)
from rng_tracker.kernels._index_map import index_map_of
from rng_tracker.kernels._keyed_fill import keyed_uniform_

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    # A failed compile falls back to the reference, which would then be compared with itself.
    assert _cpu_kernel.available(), _cpu_kernel._state["failed"]
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _inputs(shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g).to(dtype)
    x.view(-1)[:9] = torch.tensor(
        [-0.0, 0.0, float("inf"), -float("inf"), 1e-30, -1e-30, 3.0, -3.0, float("nan")]
    )
    bias = torch.randn(shape[-1], generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    residual.view(-1)[:4] = -0.0  # a dropped element must give +0.0 + -0.0 = +0.0, not -0.0
    return x, bias, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_variant_equals_the_reference_bitwise(dtype):
    """dropout, residual-only and bias+residual at an odd size (185 = 37 x 5, not a multiple of 4)."""
    x, bias, residual = _inputs((37, 5), dtype)
    for impl_args in (
        lambda impl: dropout(x, 0.3, generator=_gen(), impl=impl),
        lambda impl: bias_dropout_add(x, None, residual, 0.3, generator=_gen(), impl=impl),
        lambda impl: bias_dropout_add(x, bias, residual, 0.3, generator=_gen(), impl=impl),
    ):
        _assert_bitwise(impl_args("cpu"), impl_args("torch"))


@pytest.mark.parametrize(
    ("shape", "placement"),
    [
        ((5, 8), Chunk(1, 1, 2, extent=16)),  # aligned, one division per group
        ((6, 4), Chunk(-1, 1, 3, extent=10)),  # torch.chunk split of 10 (4, 4, 2): not aligned
        ((3, 5), Chunk(0, 1, 3, extent=7)),  # a contiguous block at an unaligned offset
        ((2, 3, 6), Region((4, 5, 8), (1, 2, 1))),  # a 3-d box: two divisions, not aligned
        ((2, 2, 8), Region((3, 4, 16), (1, 1, 4))),  # a 3-d box, aligned
    ],
)
def test_shards_and_regions_equal_the_reference_bitwise(shape, placement):
    """Every placement draws the reference's mask of its global indices."""
    x, bias, residual = _inputs(shape, torch.float32)
    for op in (
        lambda impl: dropout(x, 0.4, shard=placement, generator=_gen(3), impl=impl),
        lambda impl: bias_dropout_add(
            x, bias, residual, 0.4, shard=placement, generator=_gen(3), impl=impl
        ),
    ):
        _assert_bitwise(op("cpu"), op("torch"))


def test_explicit_seed_words_equal_the_reference():
    """Counter words c2, c3 and a negative (high-bit) key reach the compiled Philox."""
    x, _, _ = _inputs((16, 9), torch.float32)
    seed = torch.tensor([-(2**63) + 12345, 2**40 + 7, 2**32 - 1, 99], dtype=torch.int64)
    _assert_bitwise(
        dropout(x, 0.5, seed=seed, impl="cpu"), dropout(x, 0.5, seed=seed, impl="torch")
    )


def test_backward_equals_the_reference_and_saves_only_the_seed():
    """Gradients of x and bias regenerate the forward's mask; the reference's op saves only the
    seed tensor, and the compiled kernel called straight saves no tensor (its words are ints)."""
    x, bias, residual = _inputs((12, 8), torch.bfloat16)
    grad = torch.randn(12, 8).to(torch.bfloat16)
    grads = {}
    for impl in ("cpu", "torch"):
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t) or t, lambda t: t
        ):
            out = bias_dropout_add(*leaves, 0.3, generator=_gen(9), impl=impl)
        out.backward(grad)
        grads[impl] = [leaf.grad for leaf in leaves]
        want = [(4,)] if impl == "torch" else []  # [key, base, c2, c3]
        assert [tuple(t.shape) for t in saved] == want
    for a, b in zip(grads["cpu"], grads["torch"], strict=True):
        _assert_bitwise(a, b)


def test_auto_runs_the_compiled_kernel_on_cpu_and_the_op_path_equals_the_direct_one():
    """impl="auto" on CPU runs the compiled kernel: eager calls go to it directly, and under a
    dispatch mode (or torch.compile) through the rng_tracker::fused_dropout_cpu op, which the
    mode then sees; both give the same output and gradients bit for bit."""
    x, bias, residual = _inputs((9, 16), torch.bfloat16)
    grad = torch.randn(9, 16).to(torch.bfloat16)
    whole = index_map_of(x.shape, None)
    results = []
    for mode in (None, OpNames()):
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        if mode is None:
            assert _dispatch.route(leaves[0], "auto", whole) == "cpu_direct"  # straight to C
            out = bias_dropout_add(*leaves, 0.3, generator=_gen())
            out.backward(grad)
        else:
            with mode:
                assert _dispatch.route(leaves[0], "auto", whole) == "cpu"  # through the op
                out = bias_dropout_add(*leaves, 0.3, generator=_gen())
                out.backward(grad)
            assert mode.names.count("rng_tracker.fused_dropout_cpu.default") == 2  # fwd, bwd
        results.append([out, *(leaf.grad for leaf in leaves)])
    reference = bias_dropout_add(x, bias, residual, 0.3, generator=_gen(), impl="torch")
    _assert_bitwise(results[0][0], reference)
    for a, b in zip(*results, strict=True):
        _assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_converts_like_torch(dtype):
    """All 65536 bit patterns (zeros, subnormals, inf, NaN) through the kernel's conversions to
    fp32 and back, scaled (p > 0) and with a residual, equal torch's casts bit for bit."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    residual = every.flip(0)
    for op in (
        lambda impl: dropout(every, 0.3, generator=_gen(), impl=impl),
        lambda impl: bias_dropout_add(every, None, residual, 1e-9, generator=_gen(), impl=impl),
    ):
        _assert_bitwise(op("cpu"), op("torch"))


def test_p_one_drops_everything_and_threads_split_the_work_without_changing_bits():
    """p=1 keeps nothing (threshold 2**32); a tensor large enough for several threads gives
    the bits of one thread and of the reference."""
    x, _, residual = _inputs((4, 9), torch.float32)
    _assert_bitwise(
        bias_dropout_add(x, None, residual, 1.0, impl="cpu"),
        bias_dropout_add(x, None, residual, 1.0, impl="torch"),
    )
    big = torch.randn(2 * _cpu_kernel._MIN_NUMEL_PER_THREAD + 1000, generator=_gen(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = dropout(big, 0.2, generator=_gen(), impl="cpu")
        torch.set_num_threads(1)
        single = dropout(big, 0.2, generator=_gen(), impl="cpu")
    finally:
        torch.set_num_threads(threads)
    _assert_bitwise(split, single)
    _assert_bitwise(split, dropout(big, 0.2, generator=_gen(), impl="torch"))


_SEEDS = {
    "generator-like": [1234567, 0, 0, 0],
    # the low counter word carries into the high one inside the first block of 1024 elements
    "carry": [-(2**63) + 99, 2**32 - 100, 7, 2**32 - 1],
    # c = base + g wraps modulo 2**64
    "wrap": [5, -50, 2**31, 3],
}
_PLACEMENTS = {
    "unsharded": ((3, 1100), None),  # several blocks and a tail
    "column shard (aligned)": ((40, 96), Chunk(1, 1, 3, extent=288)),
    "chunk (unaligned)": ((37, 6), Chunk(1, 1, 3, extent=17)),
    "3-d box (unaligned)": ((3, 7, 50), Region((5, 9, 61), (1, 2, 3))),
}


def test_every_instruction_set_path_equals_the_reference_bitwise(monkeypatch):
    """The kernel is compiled once per instruction-set path (portable; AVX2 and AVX-512 on x86-64);
    forcing each path this CPU runs gives the reference's bits for every dtype, op variant,
    placement and seed (counter carries and wraps included), and auto picks the fastest."""
    paths = _cpu_kernel.isa_paths()
    assert paths[0] == "portable"
    if os.path.exists("/proc/cpuinfo"):  # Linux: the kernel's pick agrees with the CPU's flags
        with open("/proc/cpuinfo") as info:
            flags = re.search(r"^flags\s*:(.*)$", info.read(), re.MULTILINE)
        names = set(flags.group(1).split()) if flags is not None else set()
        x86 = platform.machine() == "x86_64"
        assert ("avx2" in paths) == ("avx2" in names and x86)
        assert ("avx512" in paths) == ({"avx2", "avx512f"} <= names and x86)
    library = _cpu_kernel._library()
    assert library.rt_isa_best() == _c_build.ISA_CODES[paths[-1]]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, placement in _PLACEMENTS.values():
            x, bias, residual = _inputs(shape, dtype)
            for words in _SEEDS.values():
                seed = torch.tensor(words, dtype=torch.int64)
                for op_bias, op_residual in ((None, None), (None, residual), (bias, residual)):
                    args = (x, op_bias, op_residual, placement, seed)
                    want = _fused(*args, impl="torch")
                    for path in paths:
                        monkeypatch.setitem(_cpu_kernel._state, "isa", _c_build.ISA_CODES[path])
                        _assert_bitwise(_fused(*args, impl="cpu"), want)
                    monkeypatch.setitem(_cpu_kernel._state, "isa", 0)


def _fused(x, bias, residual, placement, seed, *, impl):
    if residual is None:
        return dropout(x, 0.3, shard=placement, seed=seed, impl=impl)
    return bias_dropout_add(x, bias, residual, 0.3, shard=placement, seed=seed, impl=impl)


@pytest.mark.parametrize(
    "numel, with_residual",
    [
        (2**20 + 3, False),  # 4 MiB of fp32: each next block prefetched (x, out) while computing
        (2**22 + 3, True),  # 16 MiB: prefetched (x, residual), out streamed with no cache fill
    ],
)
def test_large_inputs_prefetched_and_outputs_streamed_keep_the_bits(
    monkeypatch, numel, with_residual
):
    """A thread's part of at least 2 MiB prefetches each next block while computing this one.
    A fresh output (a new mapping, no page mapped yet) is marked for huge pages, mapped a piece
    at a time just ahead of the loop and written through the cache; an output of 16 MiB and more
    whose pages are already mapped is written with non-temporal stores on the SIMD paths (staged
    per block, then streamed out; the last block's 12 bytes with plain stores). Both give the
    reference's bits on every path, on one thread and split over two, as the op's own output
    does."""
    paths = _cpu_kernel.isa_paths()
    x = torch.randn(numel, generator=_gen(5))
    residual = torch.randn_like(x) if with_residual else None
    seed = torch.tensor(_SEEDS["carry"], dtype=torch.int64)
    want = _fused(x, None, residual, None, seed, impl="torch")
    library = _cpu_kernel._library()
    mapped = torch.full_like(x, 7.0)  # every page of it touched: mapped, not fresh
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for path in paths:
                monkeypatch.setitem(_cpu_kernel._state, "isa", _c_build.ISA_CODES[path])
                _assert_bitwise(_fused(x, None, residual, None, seed, impl="cpu"), want)
                args = _cpu_kernel._arguments(index_map_of(x.shape, None), x.dtype, 0, 0.3, count)
                args[_cpu_kernel._ARG_KEY : _cpu_kernel._ARG_KEY + 4] = _SEEDS["carry"]
                mapped.fill_(7.0)
                pointers = (x.data_ptr(), None, residual.data_ptr() if with_residual else None)
                assert library.rt_fused_dropout(*pointers, mapped.data_ptr(), args) == 0
                _assert_bitwise(mapped, want)
                # a new mapping, none of its pages mapped yet: the fresh path (torch's own
                # allocation below 32 MiB may be reused memory)
                fresh = torch.frombuffer(mmap.mmap(-1, x.numel() * 4), dtype=x.dtype)
                assert library.rt_fused_dropout(*pointers, fresh.data_ptr(), args) == 0
                _assert_bitwise(fresh, want)
    finally:
        torch.set_num_threads(threads)


def test_in_place_writes_x_itself_with_the_out_of_place_bits_on_every_path(monkeypatch):
    """``out`` may be x itself (the in-place call): every path, dtype and placement, on one
    thread and on two, from a block to 16 MiB (where an output in mapped memory would be
    streamed out), leaves the reference's bits in x. That the kernel stages each block, so its
    restrict pointers never alias, is not visible in the bits (the kernel before it, which wrote
    x directly, also passes): this pins the contract, not the mechanism."""
    paths = _cpu_kernel.isa_paths()
    library = _cpu_kernel._library()
    seed = _SEEDS["carry"]
    cases = [
        (dtype, shape, placement)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for shape, placement in _PLACEMENTS.values()
    ]
    cases.append((torch.float32, (2**22 + 3,), None))  # 16 MiB: past the streaming threshold
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for dtype, shape, placement in cases:
                x = torch.randn(shape, generator=_gen(7)).to(dtype)
                want = _fused(x, None, None, placement, torch.tensor(seed), impl="torch")
                index_map = index_map_of(x.shape, placement)
                for path in paths:
                    monkeypatch.setitem(_cpu_kernel._state, "isa", _c_build.ISA_CODES[path])
                    args = _cpu_kernel._arguments(index_map, dtype, 0, 0.3, count)
                    args[_cpu_kernel._ARG_KEY : _cpu_kernel._ARG_KEY + 4] = seed
                    written = x.clone()
                    pointer = written.data_ptr()
                    assert library.rt_fused_dropout(pointer, None, None, pointer, args) == 0
                    _assert_bitwise(written, want)
    finally:
        torch.set_num_threads(threads)
        monkeypatch.setitem(_cpu_kernel._state, "isa", 0)


def test_an_instruction_set_this_cpu_lacks_is_refused(monkeypatch):
    """A forced path the CPU cannot run is refused by the kernel, which writes nothing; the
    error names the path, the variable that forces it and the paths this CPU runs."""
    monkeypatch.setitem(_cpu_kernel._state, "isa", 99)
    runs = ", ".join(map(repr, _cpu_kernel.isa_paths()))
    with pytest.raises(
        KernelUnavailableError,
        match=re.escape(
            f"path '99' (RNG_TRACKER_CPU_ISA), which this CPU does not run; it runs {runs}"
        ),
    ):
        dropout(torch.ones(8), 0.5, impl="cpu")


_ISA_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from rng_tracker.kernels import _cpu_kernel, _keyed_fill, dropout
    from rng_tracker.kernels._keyed_fill import keyed_uniform_
    print(_cpu_kernel._state["isa"], _keyed_fill._state["isa"], _cpu_kernel.available())
    x = torch.randn(3000)
    seed = torch.tensor([5, 6, 7, 8])
    want = dropout(x, 0.3, seed=seed, impl="torch")
    print(torch.equal(dropout(x, 0.3, seed=seed, impl="cpu").view(torch.int32), want.view(torch.int32)))
    print(json.dumps(keyed_uniform_(torch.empty(7, 9), seed=1, name="w").view(torch.int32).tolist()))
    """
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter with ``env`` added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("name", ["portable", "auto"])
def test_the_environment_picks_the_instruction_set_path(name):
    """RNG_TRACKER_CPU_ISA (read at import) forces one path on both C kernels ('auto', like
    unset, lets each pick the fastest), and the bits do not change: the compiled dropout equals
    the reference, the keyed fill what this process's fastest path writes."""
    result = _python(_ISA_SCRIPT, RNG_TRACKER_CPU_ISA=name)
    assert result.returncode == 0, result.stderr[-3000:]
    code = _c_build.ISA_CODES[name]
    paths, equal, keyed = result.stdout.splitlines()
    assert paths.split() == [str(code), str(code), "True"]  # built: no fallback to the reference
    assert equal == "True"
    here = keyed_uniform_(torch.empty(7, 9), seed=1, name="w").view(torch.int32).tolist()
    assert json.loads(keyed) == here


_HUGE_PAGES_SCRIPT = textwrap.dedent(
    """
    import torch
    from rng_tracker.kernels import dropout
    from rng_tracker.kernels._keyed_fill import keyed_uniform_


    def huge_kib(t):
        # AnonHugePages of the mappings that hold t's bytes (marking splits its own mapping)
        begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        total, inside = 0, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(v, 16) for v in head.split("-"))
                    inside = low < end and begin < high
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1])
        return total


    torch.set_num_threads(1)
    x = torch.ones(2**24)  # 64 MiB: the outputs below are new mappings (malloc's mmap)
    print(huge_kib(dropout(x, 0.5, impl="cpu")), huge_kib(keyed_uniform_(torch.empty(2**24), seed=1, name="w")))
    """
)


def _transparent_huge_pages() -> str:
    """The system's transparent-huge-page mode (always, madvise, never), or "" where none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return ""


@pytest.mark.skipif(
    _transparent_huge_pages() != "madvise",
    reason="only where transparent huge pages are 'madvise' does asking for them show",
)
@pytest.mark.parametrize("value, asked", [(None, True), ("1", True), ("0", False)])
def test_the_environment_says_whether_new_outputs_get_huge_pages(monkeypatch, value, asked):
    """RNG_TRACKER_CPU_HUGE_PAGES (read at import): unset or "1", both C kernels ask for
    transparent huge pages on a new output's whole 2 MiB pieces, so its mapping holds some;
    "0", they do not, and (THP on request only) it holds none."""
    monkeypatch.delenv("RNG_TRACKER_CPU_HUGE_PAGES", raising=False)
    env = {} if value is None else {"RNG_TRACKER_CPU_HUGE_PAGES": value}
    result = _python(_HUGE_PAGES_SCRIPT, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    dropout_kib, keyed_kib = (int(v) for v in result.stdout.split())
    if asked:
        assert dropout_kib > 0 and keyed_kib > 0
    else:
        assert dropout_kib == keyed_kib == 0


def test_impl_cpu_refuses_other_devices_before_drawing():
    with pytest.raises(KernelUnavailableError, match="impl='cpu'"):
        dropout(torch.randn(8, device="meta"), 0.5, impl="cpu")


_META_FIRST_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    from rng_tracker.kernels import _cpu_kernel, dropout
    from rng_tracker.kernels._keyed_fill import keyed_uniform_

    x = torch.randn(16, 8)
    x[0, :4] = float("nan")
    x = x.to(torch.bfloat16)
    targets = [torch.empty(7, 9, dtype=torch.bfloat16) for _ in range(2)]

    def calls(target):
        generator = torch.Generator().manual_seed(1)
        return [
            dropout(x, 0.5, generator=generator, impl="cpu").view(torch.int16),
            keyed_uniform_(target, seed=1, name="w").view(torch.int16),
        ]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference warns
        with torch.device("meta"):
            inside = calls(targets[0])
    outside = calls(targets[1])
    print(_cpu_kernel.available(), *(torch.equal(a, b) for a, b in zip(inside, outside)))
    """
)


def test_a_process_whose_first_kernel_calls_run_under_a_meta_device_loads_the_kernels():
    """In a fresh process, the first compiled dropout (which loads the kernel) and the first
    keyed fill of a bf16 tensor run inside ``with torch.device("meta")`` on CPU tensors: the
    kernel loads (no fallback warning) and both give the bits of the same calls outside it."""
    result = _python(_META_FIRST_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "True"]


_FAKE_FIRST_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from rng_tracker.kernels import _cpu_kernel, dropout

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference warns
        with FakeTensorMode():
            dropout(torch.empty(16, 8), 0.5, impl="cpu")
        x = torch.randn(16, 8)
        x[0, :4] = float("nan")
        x = x.to(torch.bfloat16)
        out, ref = (
            dropout(x, 0.5, generator=torch.Generator().manual_seed(1), impl=impl)
            for impl in ("cpu", "torch")
        )
    print(_cpu_kernel.available(), torch.equal(out.view(torch.int16), ref.view(torch.int16)))
    """
)


def test_a_process_whose_first_kernel_call_runs_under_fake_tensors_loads_the_kernel():
    """In a fresh process the first compiled dropout runs under FakeTensorMode (a memory
    estimate, say): the kernel's load measures torch's bf16 NaN bits on real tensors, so it
    loads (no fallback warning), and later real calls, NaNs in bf16 included, equal the
    reference bitwise."""
    result = _python(_FAKE_FIRST_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]


_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    from rng_tracker.kernels import _cpu_kernel, dropout
    from rng_tracker.errors import CompiledKernelFallbackWarning

    x = torch.randn(16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [
            dropout(x, 0.5, generator=torch.Generator().manual_seed(s), impl=impl)
            for s, impl in ((1, "cpu"), (2, "auto"))
        ]
    fallbacks = [w for w in caught if issubclass(w.category, CompiledKernelFallbackWarning)]
    for s, out in zip((1, 2), outs):
        ref = dropout(x, 0.5, generator=torch.Generator().manual_seed(s), impl="torch")
        assert torch.equal(out, ref)
    print("compiled" if _cpu_kernel.available() else "reference", len(fallbacks))
    if fallbacks:
        print(fallbacks[0].message)
    """
)


def _run_without_compiler(cache: os.PathLike, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), RNG_TRACKER_CACHE_DIR=str(cache))
    return subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_a_c_compiler_the_reference_runs_after_one_warning(tmp_path):
    """A real missing compiler (CC points nowhere) and an empty cache, in a fresh process:
    impl="cpu" and impl="auto" both run the reference, after one warning between them."""
    result = _run_without_compiler(tmp_path / "empty-cache", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    verdict, message = result.stdout.splitlines()[:2]
    assert verdict == "reference 1"
    assert "C compiler" in message and "no-such-compiler" in message


def _built_library() -> Path:
    """The compiled dropout's library in this process's cache, built here if it was not."""
    assert _cpu_kernel.available()
    return _cpu_kernel._SOURCE.library_path()


def test_a_warm_cache_needs_no_compiler(tmp_path):
    """The library is keyed by source and platform, not by compiler: built once (here, by this
    process), a fresh process with no compiler loads it and runs the compiled kernel, with no
    warning."""
    library = _built_library()
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copyfile(library, cache / library.name)
    result = _run_without_compiler(cache, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled", "0"]
    assert [p.name for p in cache.iterdir()] == [library.name]  # loaded, nothing built beside it


def _run_fallback_script(cache: os.PathLike, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT],
        env=dict(os.environ, RNG_TRACKER_CACHE_DIR=str(cache), **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_broken_cached_library_is_built_anew(tmp_path):
    """A truncated library in the cache (a torn copy into a shared cache) crashed the process
    that loaded it (SIGBUS); one that is empty or not ELF fell back to the reference for every
    process after. Each is now found broken before it is loaded, and built anew in place: a fresh
    process given the truncated one runs the compiled kernel from a whole library."""
    library = _built_library()
    whole = library.read_bytes()
    assert _c_build._intact(library)
    broken = {"truncated": whole[: len(whole) // 2], "empty": b"", "not ELF": b"\0" * len(whole)}
    for name, content in broken.items():
        cache = tmp_path / name.replace(" ", "-")
        cache.mkdir()
        (cache / library.name).write_bytes(content)
        assert not _c_build._intact(cache / library.name), name
    cache = tmp_path / "truncated"
    result = _run_fallback_script(cache)  # one build: the others take the same path to it
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split() == ["compiled", "0"]
    assert (cache / library.name).read_bytes() == whole
    assert [p.name for p in cache.iterdir()] == [library.name]  # no leftovers of the build


_FOREIGN_LIBRARY = "long rt_abi_version(void) { return 0; }\n"


def test_a_foreign_library_in_the_cache_falls_back_with_one_warning(tmp_path):
    """A library under the kernel's name that lacks its functions raised an untyped
    AttributeError on every call; like a library of another ABI it now falls back to the
    reference after one warning that says to delete it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    source = tmp_path / "foreign.c"
    source.write_text(_FOREIGN_LIBRARY)
    target = cache / _cpu_kernel._SOURCE._path(_cpu_kernel._SOURCE._files()).name
    subprocess.run([_c_build._compiler(), "-shared", "-fPIC", str(source), "-o", str(target)])
    result = _run_fallback_script(cache)
    assert result.returncode == 0, result.stderr[-3000:]
    verdict, message = result.stdout.splitlines()[:2]
    assert verdict == "reference 1"
    assert "delete it" in message


_PLANTED_LIBRARY = textwrap.dedent(
    """
    #include <stdio.h>
    __attribute__((constructor)) static void planted(void) {
        FILE *f = fopen("MARKER", "w"); if (f) { fputs("ran", f); fclose(f); }
    }
    """
)


def test_a_temp_cache_dir_others_can_write_is_not_used(tmp_path):
    """The temp-dir fallback has a predictable name: anyone could make it first and put a library
    there, which was loaded (their code run as this user). A directory this user does not own
    alone (here: writable by all) is passed over for one of the process's own."""
    temp = tmp_path / "tmp"
    planted_dir = temp / f"rng_tracker-{os.getuid()}"
    planted_dir.mkdir(parents=True)
    planted_dir.chmod(0o777)
    source = tmp_path / "planted.c"
    marker = tmp_path / "marker"
    source.write_text(_PLANTED_LIBRARY.replace("MARKER", str(marker)))
    for kernel in (_cpu_kernel, _keyed_fill):
        name = kernel._SOURCE._path(kernel._SOURCE._files()).name
        subprocess.run(
            [_c_build._compiler(), "-shared", "-fPIC", str(source), "-o", str(planted_dir / name)]
        )
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RNG_TRACKER_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(blocker), TMPDIR=str(temp))
    result = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled", "0"]
    assert not marker.exists()


def test_a_compiler_that_hangs_is_given_up_on(tmp_path, monkeypatch):
    """The build waited for the compiler without a limit, so a hung one hung the first kernel
    call; it now times out with an error the callers fall back on (one warning)."""
    hanging = tmp_path / "cc"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setattr(_c_build, "_BUILD_SECONDS", 1)
    files = _cpu_kernel._SOURCE._files()
    with pytest.raises(subprocess.TimeoutExpired):  # a SubprocessError: one of BUILD_ERRORS
        _cpu_kernel._SOURCE._build(tmp_path / "cache" / "lib.so", files)


def _library_paths() -> list:
    return [_cpu_kernel._SOURCE.library_path(), _keyed_fill._SOURCE.library_path()]


def test_the_cache_key_covers_the_headers_the_sources_include(monkeypatch):
    """Both C sources include the shared Philox headers: each library's files (copied next to
    its source to build it, and hashed into its cache key) are its source and every header it
    includes, through other headers too, so an edited header is never answered by a library
    built from the old one."""
    kernels_dir = os.path.dirname(_cpu_kernel.__file__)
    for source in (_cpu_kernel._SOURCE, _keyed_fill._SOURCE):
        files = source._files()
        included = {source.source}
        for name in files:
            with open(os.path.join(kernels_dir, name)) as text:
                included |= set(re.findall(r'^#include "([^"]+)"', text.read(), re.MULTILINE))
        assert set(files) == included
        assert {"cpu_isa.h", "philox4x32_simd.h", "fresh_pages.h"} <= included  # via headers too
    before = _library_paths()
    assert len(set(before)) == 2
    assert _library_paths() == before  # the key is a pure function of the files
    read = _c_build._read
    edited = {"philox4x32.h": read("philox4x32.h") + b"\n/* edited */\n"}
    monkeypatch.setattr(_c_build, "_read", lambda name: edited.get(name) or read(name))
    after = _library_paths()
    assert all(b != a for b, a in zip(before, after)), (before, after)


_KNOB_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from rng_tracker.kernels import dropout

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    for impl in ("auto", "cpu"):
        with Names() as seen:
            dropout(torch.randn(8, 8), 0.5, impl=impl)
        print(impl, [n for n in seen.names if n.startswith("rng_tracker.")])
    """
)


@pytest.mark.parametrize(
    ("value", "auto_op"),
    [
        (None, "fused_dropout_cpu"),
        ("compiled", "fused_dropout_cpu"),
        ("reference", "fused_dropout"),
    ],
)
def test_the_environment_opts_auto_out_of_the_compiled_kernel(value, auto_op):
    """RNG_TRACKER_CPU_KERNEL=reference makes impl="auto" run the reference op in a process;
    impl="cpu" still runs the compiled kernel; an unknown value is an error naming both."""
    env = {k: v for k, v in os.environ.items() if k != _dispatch.CPU_KERNEL_ENV}
    if value is not None:
        env[_dispatch.CPU_KERNEL_ENV] = value
    result = subprocess.run(
        [sys.executable, "-c", _KNOB_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"auto ['rng_tracker.{auto_op}.default']",
        "cpu ['rng_tracker.fused_dropout_cpu.default']",
    ]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RNG_TRACKER_CPU_ISA", "sse9", "RNG_TRACKER_CPU_ISA='sse9'; set it to one of 'auto'"),
        ("RNG_TRACKER_CPU_HUGE_PAGES", "yes", "RNG_TRACKER_CPU_HUGE_PAGES='yes'; set it to '1'"),
        (_dispatch.CPU_KERNEL_ENV, "fast", "'compiled'"),
    ],
)
def test_a_bad_kernel_environment_value_is_an_error_at_import(variable, value, message):
    """The kernels' environment switches are read at import: a value they do not take stops
    the import with a KernelInputError that names the variable's values."""
    result = _python("import rng_tracker.kernels", **{variable: value})
    assert result.returncode != 0
    assert "KernelInputError" in result.stderr and message in result.stderr


def test_an_unwritable_home_cache_falls_back_to_the_temp_dir(tmp_path):
    """Where ~/.cache cannot be created (here: XDG_CACHE_HOME is a file), the kernel is built
    and cached under the temp dir instead of falling back to the reference."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RNG_TRACKER_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(blocker), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rng_tracker.kernels import _cpu_kernel as c; "
            "print(c.available(), c._SOURCE.library_path())",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    available, path = result.stdout.split()
    assert available == "True", result.stderr[-3000:]
    assert path.startswith(str(tmp_path / "tmp")) and os.path.exists(path)
