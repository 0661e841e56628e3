"""Fused dropout on CPU as compiled C, bitwise equal to the plain-torch reference.

The reference spends ten rounds of separate int64 tensor ops, each a full pass over memory.
``cpu_dropout.c`` (next to this file) does the same arithmetic in one pass: per block of 1024
elements, Philox4x32-10 of the block's counters (AVX-512 or AVX2 intrinsics where the CPU has
them, a portable loop elsewhere: :func:`isa_paths`), then ``residual + keep * (x + bias) *
scale`` in fp32, rounded once to x's dtype. Large tensors are split over
``torch.get_num_threads()`` threads; a new output's pages are mapped just ahead of the loop (as
huge pages where the OS grants them), and a large output in reused memory is streamed out with
non-temporal stores.

It is built once per machine with the system C compiler (``CC``, else cc, gcc or clang;
about 1 s), cached on disk, and loaded with ctypes: no torch headers, no tracing, a few
microseconds per call. Why not Inductor or AOTInductor: docs/decisions.md. Where it cannot
be built (no C compiler), :func:`available` says so after one
:class:`~rng_tracker.errors.CompiledKernelFallbackWarning`, and the dispatcher runs the
reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import warnings
from typing import Any

import torch

from rng_tracker._torch_private import disable_current_dispatch_modes
from rng_tracker.errors import CompiledKernelFallbackWarning, KernelUnavailableError
from rng_tracker.kernels._c_build import (
    FLAGS,
    ISA,
    CSource,
    load_once,
    unsupported_isa,
)
from rng_tracker.kernels._c_build import isa_paths as isa_paths_of
from rng_tracker.kernels._call import DropoutCall
from rng_tracker.kernels._index_map import IndexMap
from rng_tracker.kernels.reference import keep_scale_unchecked, keep_threshold_unchecked

MAX_DIMS = 64  # RT_MAX_DIMS of cpu_dropout.c: the merged dims of an index map it places
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SOURCE = CSource(
    "cpu_dropout.c",
    FLAGS,
    libraries=(),
    abi_function="rt_abi_version",
    abi_version=2,  # RT_ABI_VERSION of cpu_dropout.c
    maps_fresh_pages=True,
)
# Below this many elements per thread, one more thread costs more (a thread start, and on a
# loaded machine a wait for it to be scheduled) than it saves.
_MIN_NUMEL_PER_THREAD = 2**17

_lock = threading.Lock()
# "isa": the instruction-set path (ISA_CODES; 0 picks the fastest), from RNG_TRACKER_CPU_ISA
_state: dict[str, object] = {
    "library": None,
    "failed": None,
    "bf16_nan": 0xFFFF,
    "isa": ISA,
}


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
    return isa_paths_of(library.rt_isa_supported)


def _bf16_nan_bits() -> int:
    # torch's fp32 -> bf16 cast of NaN differs across builds (0xFFFF from the x86 vector
    # path, 0x7FC0 from the scalar one): the kernel writes this build's. Measured on real
    # tensors even when the first call runs under fake tensors or a tracer, which would trace it.
    with disable_current_dispatch_modes():
        nan = torch.tensor([float("nan")] * 16, device="cpu")
        return nan.to(torch.bfloat16).view(torch.int16)[0].item() & 0xFFFF


def available() -> bool:
    """Whether the compiled kernel runs here: built (or loaded from the cache) on the first call;
    where it cannot be, False after one :class:`CompiledKernelFallbackWarning`."""
    error = load_once(_state, _lock, _load)
    if error is not None:
        warnings.warn(
            "rng_tracker: the compiled CPU dropout kernel cannot be built here "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "running the plain-torch reference instead (same masks, slower). Install a C "
            "compiler (cc, gcc or clang, or set CC) to use the compiled kernel, or pass "
            "impl='torch' to silence this.",
            CompiledKernelFallbackWarning,
            stacklevel=6,  # the caller of dropout / bias_dropout_add, through the dispatcher
        )
    return _state["library"] is not None


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None where it cannot be."""
    return _state["library"] if available() else None  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _p_words(p: float) -> tuple[int, int]:
    """(keep threshold, fp32 bits of the scale) of ``p``: computed once per p."""
    return keep_threshold_unchecked(p), struct.unpack(
        "<I", struct.pack("<f", keep_scale_unchecked(p))
    )[0]


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


def fused_dropout_compiled(
    call: DropoutCall, words: tuple[int, int, int, int], in_place: bool = False
) -> torch.Tensor:
    """``fused_dropout_reference``'s result from the compiled kernel, for the seed ``words``
    (key, base, c2, c3 as int64 values); ``in_place``: written over x (contiguous), which is
    returned. The dispatcher sends only calls it runs (CPU tensors, an index map of at most
    :data:`MAX_DIMS` merged dims, a bias only with a residual); others, and a kernel that cannot
    be built, raise :class:`KernelUnavailableError`."""
    library = _state["library"]
    if library is None:
        library = _library()
        if library is None:
            raise KernelUnavailableError(
                f"the compiled CPU dropout kernel cannot be built here ({_state['failed']}); "
                "run rng_tracker.kernels.dropout (impl='auto' runs the reference then) or "
                "torch.ops.rng_tracker.fused_dropout"
            )
    x, bias, residual, p, index_map = call
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    out = x if in_place else torch.empty_like(x, memory_format=torch.contiguous_format)
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
    if status == -2:
        raise unsupported_isa(
            "the compiled CPU dropout kernel", _state["isa"], library.rt_isa_supported
        )
    if status != 0:
        raise KernelUnavailableError(
            f"the compiled CPU dropout kernel refused its arguments (dtype {x.dtype}, "
            f"{numel} elements, {len(index_map.dims)} dims, bias {bias is not None}, residual "
            f"{residual is not None}); use impl='torch'"
        )
    return out
