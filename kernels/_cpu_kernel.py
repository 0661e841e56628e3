"""Fused dropout on CPU as compiled C, bitwise equal to the plain-torch reference.

The reference spends ten rounds of separate int64 tensor ops, each a full pass over memory.
``cpu_dropout.c`` (next to this file) does the same arithmetic in one pass: per block of 1024
elements, Philox4x32-10 of the block's counters (AVX2 intrinsics where the CPU has AVX2, a
portable loop elsewhere: :func:`isa_paths`), then ``residual + keep * (x + bias) * scale`` in
fp32, rounded once to x's dtype. Large tensors are split over ``torch.get_num_threads()``
threads; outputs beyond the caches are streamed out with non-temporal stores.

It is built once per machine with the system C compiler (``CC``, else cc, gcc or clang;
about 1 s), cached on disk, and loaded with ctypes: no torch headers, no tracing, a few
microseconds per call. Why not Inductor or AOTInductor: docs/decisions.md. Where it cannot
be built (no C compiler) the reference runs instead, after one
:class:`CompiledKernelFallbackWarning`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from rng_tracker._torch_private import (
    dispatch_mode_depth,
    functorch_transforms_active,
    profiler_enabled,
)
from rng_tracker.errors import KernelInputError, KernelUnavailableError
from rng_tracker.kernels._c_build import CSource, load_once
from rng_tracker.kernels._index_map import IndexMap
from rng_tracker.kernels._ops import (
    _fake,
    _index_map,
    _make_backward,
    _setup_context,
    dropout_backward,
    save_for_dropout_backward,
)
from rng_tracker.kernels.reference import fused_dropout_reference, keep_scale, keep_threshold

_MAX_DIMS = 64  # RT_MAX_DIMS of cpu_dropout.c
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FLAGS = (
    # -O2 plus the vectoriser: as fast here as -O3, and builds in a third of the time.
    "-O2",
    "-ftree-vectorize",
    "-std=c11",
    "-shared",
    "-fPIC",
    "-pthread",
    # Bit-exactness: no fused multiply-add, no reassociation or other unsafe math.
    "-ffp-contract=off",
    "-fno-fast-math",
)
_SOURCE = CSource(
    "cpu_dropout.c",
    _FLAGS,
    libraries=(),
    abi_function="rt_abi_version",
    abi_version=2,  # RT_ABI_VERSION of cpu_dropout.c
)
# The instruction-set paths of cpu_dropout.c (RT_ISA_*): 0 lets the kernel pick the fastest
# this CPU runs; the others force one (tests compare every path bitwise).
ISA_CODES = {"auto": 0, "portable": 1, "avx2": 2}
# Below this many elements per thread, one more thread costs more (a thread start, and on a
# loaded machine a wait for it to be scheduled) than it saves.
_MIN_NUMEL_PER_THREAD = 2**17


class CompiledKernelFallbackWarning(UserWarning):
    """The compiled CPU dropout kernel cannot be built here; the plain-torch reference runs."""


_lock = threading.Lock()
_state: dict[str, object] = {"library": None, "failed": None, "bf16_nan": 0xFFFF, "isa": 0}


def kernel_library_path() -> Path:
    """Where the compiled kernel for this source (and its headers) and platform lives (or will).

    The compiler is not part of the key: the library is plain C with a fixed ABI, so one
    built elsewhere (a shared cache) runs here without a compiler.
    """
    return _SOURCE.library_path()


def _load() -> ctypes.CDLL:
    _state["bf16_nan"] = _bf16_nan_bits()
    library = _SOURCE.load()
    library.rt_fused_dropout.restype = ctypes.c_int64
    # x, bias, residual, out, then every scalar and the index map in one int64 array
    library.rt_fused_dropout.argtypes = [*(ctypes.c_void_p,) * 4, ctypes.POINTER(ctypes.c_int64)]
    library.rt_isa_supported.restype = ctypes.c_int64
    library.rt_isa_supported.argtypes = [ctypes.c_int64]
    library.rt_isa_best.restype = ctypes.c_int64
    return library


def isa_paths() -> list[str]:
    """The instruction-set paths of the compiled kernel this CPU runs, fastest last (e.g.
    ``["portable", "avx2"]``); empty where the kernel cannot be built."""
    library = _library()
    if library is None:
        return []
    return [name for name, code in ISA_CODES.items() if code and library.rt_isa_supported(code)]


def _bf16_nan_bits() -> int:
    # torch's fp32 -> bf16 cast of NaN differs across builds (0xFFFF from the x86 vector
    # path, 0x7FC0 from the scalar one): the kernel writes this build's.
    return torch.tensor([float("nan")] * 16).to(torch.bfloat16).view(torch.int16)[0].item() & 0xFFFF


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None (after one warning) where it cannot be."""
    error = load_once(_state, _lock, _load)
    if error is not None:
        warnings.warn(
            "rng_tracker: the compiled CPU dropout kernel cannot be built here "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "running the plain-torch reference instead (same masks, slower). Install a C "
            "compiler (cc, gcc or clang, or set CC) to use the compiled kernel, or pass "
            "impl='torch' to silence this.",
            CompiledKernelFallbackWarning,
            stacklevel=4,
        )
    return _state["library"]  # type: ignore[return-value]


CPU_KERNEL_ENV = "RNG_TRACKER_CPU_KERNEL"


def _cpu_kernel_choice() -> str:
    choice = os.environ.get(CPU_KERNEL_ENV, "compiled")
    if choice not in ("compiled", "reference"):
        raise KernelInputError(
            f"{CPU_KERNEL_ENV}={choice!r}; set it to 'compiled' (the default) or 'reference'"
        )
    return choice


_AUTO_CHOICE = _cpu_kernel_choice()  # read once, at import


def auto_uses_compiled() -> bool:
    """Whether impl="auto" on CPU runs the compiled kernel: where it builds, unless
    ``RNG_TRACKER_CPU_KERNEL=reference`` was set when rng_tracker.kernels was imported (a
    process-wide opt-out: debugging, timing against the reference)."""
    if _AUTO_CHOICE == "reference":
        return False
    return torch.compiler.is_compiling() or compiled_cpu_available()


def compiled_cpu_available() -> bool:
    """Whether the compiled kernel runs here (builds it on first call; False after a failure)."""
    return _library() is not None


@functools.lru_cache(maxsize=64)
def _p_words(p: float) -> tuple[int, int]:
    """(keep threshold, fp32 bits of the scale) of ``p``: computed once per p."""
    return keep_threshold(p), struct.unpack("<I", struct.pack("<f", keep_scale(p)))[0]


_ARG_KEY = 4  # the slot of the key in the kernel's argument array; base, c2, c3 follow
_MAX_TEMPLATES = 4096
# (index map, dtype, bias size, p, threads, ISA) -> the kernel's argument array with zero seed
# words: a call copies it (one memcpy) and writes its 4 words, instead of converting ~17
# Python ints to C. Written whole or not at all, so threads may share it.
_TEMPLATES: dict[tuple, Any] = {}


def _arguments(
    index_map: IndexMap, dtype: torch.dtype, bias_numel: int, p: float, threads: int
) -> Any:
    key = (index_map, dtype, bias_numel, p, threads, _state["isa"])
    template = _TEMPLATES.get(key)
    if template is None:
        threshold, scale_bits = _p_words(p)
        flat_map = index_map.flat() or [1, 1]  # one element merges to no dims: one of extent 1
        values = (
            _DTYPE_CODES[dtype],
            index_map.numel,
            bias_numel,
            index_map.aligned,
            0,  # key, base, c2, c3: written per call
            0,
            0,
            0,
            threshold,
            scale_bits,
            _state["bf16_nan"],
            threads,
            _state["isa"],
            len(flat_map) // 2,
            index_map.offset,
            *flat_map,
        )
        template = (ctypes.c_int64 * len(values))(*values)
        if len(_TEMPLATES) < _MAX_TEMPLATES:
            _TEMPLATES[key] = template
    return type(template).from_buffer_copy(template)


def run_compiled(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    words: tuple[int, int, int, int],
    p: float,
    index_map: IndexMap,
) -> torch.Tensor | None:
    """The compiled kernel's output for the seed ``words`` (key, base, c2, c3 as int64 values),
    or None where it cannot run this call (no library, an index map of more than 64 dims, a
    bias without a residual): then the caller runs the reference."""
    library = _state["library"]
    if library is None:
        library = _library()
        if library is None:
            return None
    if len(index_map.dims) > _MAX_DIMS or (bias is not None and residual is None):
        return None
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    numel = index_map.numel
    threads = 1
    if numel >= 2 * _MIN_NUMEL_PER_THREAD:
        threads = max(1, min(torch.get_num_threads(), numel // _MIN_NUMEL_PER_THREAD))
    args = _arguments(index_map, x.dtype, 0 if bias is None else bias.numel(), p, threads)
    args[_ARG_KEY : _ARG_KEY + 4] = words
    status = library.rt_fused_dropout(
        x.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
        args,
    )
    if status != 0:
        raise KernelUnavailableError(
            f"the compiled CPU dropout kernel refused its arguments (dtype {x.dtype}, "
            f"{numel} elements, {len(index_map.dims)} dims); use impl='torch'"
        )
    return out


def fused_dropout_compiled(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    index_map: IndexMap,
) -> torch.Tensor:
    """``fused_dropout_reference``'s result from the compiled kernel (CPU tensors)."""
    out = run_compiled(x, bias, residual, tuple(seed.tolist()), p, index_map)
    if out is None:
        return fused_dropout_reference(x.contiguous(), bias, residual, seed, p, index_map)
    return out


@torch.library.custom_op("rng_tracker::fused_dropout_cpu", mutates_args=(), device_types="cpu")
def fused_dropout_cpu_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    offset: int,
    dims: list[int],
    logical_numel: int,
) -> torch.Tensor:
    """Fused dropout, compiled CPU kernel (the reference where no C compiler runs)."""
    return fused_dropout_compiled(
        x, bias, residual, seed, p, _index_map(offset, dims, logical_numel)
    )


fused_dropout_cpu_op.register_fake(_fake)
fused_dropout_cpu_op.register_autograd(
    _make_backward(fused_dropout_cpu_op), setup_context=_setup_context
)


def may_skip_dispatch(x: torch.Tensor) -> bool:
    """Whether an eager call may run the kernel without the op dispatcher (about 50 us less per
    call): nothing traces or intercepts ops (torch.compile, export, make_fx, torch.jit.trace,
    fake tensors, dispatch modes, functorch transforms), so the op would only forward to the
    kernel."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and dispatch_mode_depth() == 0
        and functorch_transforms_active() is False
    )


def _run(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor | None,
    words: tuple[int, int, int, int],
    p: float,
    index_map: IndexMap,
) -> torch.Tensor:
    """``run_compiled``, or the reference where it cannot run; named as the op it stands in for
    in a profiler's trace (only while a profiler runs: the name costs microseconds)."""
    if profiler_enabled():
        with torch.profiler.record_function("rng_tracker::fused_dropout_cpu"):
            out = run_compiled(x, bias, residual, words, p, index_map)
    else:
        out = run_compiled(x, bias, residual, words, p, index_map)
    if out is None:
        if seed is None:
            seed = _seed_of(words)
        return fused_dropout_reference(x.contiguous(), bias, residual, seed, p, index_map)
    return out


class _CompiledCpuDropout(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        seed: torch.Tensor,
        params: tuple[tuple[int, int, int, int], float, IndexMap],
    ) -> torch.Tensor:
        save_for_dropout_backward(ctx, bias, seed)
        ctx.params = params
        return _run(x, bias, residual, seed, *params)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        words, p, index_map = ctx.params

        def regenerate(g: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
            # ctx.saved_tensors (read by dropout_backward) has checked that the seed is unchanged
            if may_skip_dispatch(g):
                return _run(g, None, None, seed, words, p, index_map)
            return fused_dropout_cpu_op(
                g, None, None, seed, p, index_map.offset, index_map.flat(), index_map.logical_numel
            )

        return *dropout_backward(ctx, grad, regenerate), None, None


_WORDS = ctypes.c_int64 * 4


def _seed_of(words: tuple[int, int, int, int]) -> torch.Tensor:
    """The seed tensor [key, base, c2, c3] of ``words`` (a memcpy: faster than torch.tensor)."""
    seed = torch.empty(4, dtype=torch.int64)
    ctypes.memmove(seed.data_ptr(), _WORDS(*words), 32)
    return seed


def compiled_cpu_dropout(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor | None,
    words: tuple[int, int, int, int],
    p: float,
    index_map: IndexMap,
) -> torch.Tensor:
    """``fused_dropout_cpu_op``'s result and gradients for eager callers ``may_skip_dispatch``
    allows, from the seed ``words`` (and the seed tensor they came from, if any). Without
    autograd (no input needs a gradient) it is one kernel call, and no seed tensor is made."""
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):
        if seed is None:
            seed = _seed_of(words)
        return _CompiledCpuDropout.apply(x, bias, residual, seed, (words, p, index_map))
    return _run(x, bias, residual, seed, words, p, index_map)
