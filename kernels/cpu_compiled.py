"""Fused dropout on CPU as Inductor-compiled C++, bitwise equal to the plain-torch reference.

The reference spends ten rounds of separate int64 tensor ops, each a full pass over memory.
Here the same arithmetic is compiled by ``torch.compile`` (Inductor's C++ backend, dynamic
shapes, its on-disk cache) into two loops:

- keep bits: Philox4x32-10 once per group of 4 elements, with the reference's int64 word
  arithmetic, packed into one byte per group (bit j set: element 4q + j is kept): N/4 bytes;
- apply: ``residual + keep * (x + bias) * scale`` in fp32, rounded once to x's dtype.

The first depends on neither dtype nor op variant, so its large kernel compiles once per
layout kind; the second is small. Where Inductor cannot compile (no C++ compiler) the
reference runs instead, after one :class:`CompiledKernelFallbackWarning`.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rng_tracker.kernels.ops import (
    _fake,
    _layout,
    _make_backward,
    _setup_context,
    fused_dropout_op,
)
from rng_tracker.kernels.philox import PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUND_A, PHILOX_ROUND_B
from rng_tracker.kernels.reference import fused_dropout_reference, keep_threshold
from rng_tracker.kernels.shard import Layout

__all__ = [
    "AUTO_REFERENCE_SECONDS",
    "CompiledKernelFallbackWarning",
    "auto_uses_compiled",
    "compiled_cpu_available",
    "fused_dropout_compiled",
    "fused_dropout_cpu_op",
    "timed_reference_op",
]

_MASK32 = 0xFFFFFFFF
# Element j of a group is byte j in memory of the group's int32: low byte first on little-endian.
_LANE_ORDER = (0, 1, 2, 3) if sys.byteorder == "little" else (3, 2, 1, 0)
_INDUCTOR_OPTIONS = {
    # C++ flags that could change bits: FP contraction and unsafe math stay off even where
    # the environment turned them on (TORCHINDUCTOR_CPP_ENABLE_*).
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
    # Always emit an OpenMP loop: with dynamic shapes Inductor otherwise decides from the
    # first call's size, and a small first call would leave every later one on one thread.
    "cpp.dynamic_threads": True,
}


class CompiledKernelFallbackWarning(UserWarning):
    """The compiled CPU dropout kernel cannot be built here; the plain-torch reference runs."""


# The round multipliers minus 2**32: negative, of magnitude below 2**30, so their product
# with a 32-bit word fits int64 exactly (no overflow, no 16-bit split).
_ROUND_A_LOW = PHILOX_ROUND_A - 2**32
_ROUND_B_LOW = PHILOX_ROUND_B - 2**32


def _mulhilo(a_low: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of (a_low + 2**32) * b, for 0 <= b < 2**32.

    a_low * b = H * 2**32 + L with L = its low 32 bits (two's complement) and H its floor
    quotient, so the full product is (H + b) * 2**32 + L, and 0 <= H + b < 2**32.
    """
    product = a_low * b  # |product| < 2**62
    return (product >> 32) + b, product & _MASK32


# params: one int64 tensor per call, read by the compiled graphs (never baked into them).
_THRESHOLD, _BASE, _C2, _C3 = 0, 1, 2, 3
_ROUND_KEYS = 4  # k0 of rounds 0..9, then k1 of rounds 0..9
_INDEX_MAP = _ROUND_KEYS + 20  # offset, last, inner_1, gap_1, ...


def _params(seed: torch.Tensor, p: float, layout: Layout) -> torch.Tensor:
    """[threshold, base, c2, c3, the 20 round keys, the index map] from the seed [key, base, c2, c3].

    The key schedule is a function of the key alone, so it is computed here once per call
    rather than traced into the graph.
    """
    key, base, c2, c3 = seed.tolist()
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    round_keys = [(k0 + r * PHILOX_KEY_A) & _MASK32 for r in range(10)]
    round_keys += [(k1 + r * PHILOX_KEY_B) & _MASK32 for r in range(10)]
    last, terms = layout.divisions()
    index_map = [layout.offset, last, *(v for term in terms for v in term)]
    return torch.tensor(
        [keep_threshold(p), base, c2 & _MASK32, c3 & _MASK32, *round_keys, *index_map],
        dtype=torch.int64,
    )


def _philox_words(
    params: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 words at counter (lo32(base + c), hi32(base + c), c2, c3).

    Words are int64 tensors holding uint32 values, as in the reference.
    """
    c = params[_BASE] + c
    c0 = c & _MASK32
    c1 = (c >> 32) & _MASK32
    c2 = params[_C2].expand_as(c)
    c3 = params[_C3].expand_as(c)
    for r in range(10):
        hi0, lo0 = _mulhilo(_ROUND_A_LOW, c0)
        hi1, lo1 = _mulhilo(_ROUND_B_LOW, c2)
        k0, k1 = params[_ROUND_KEYS + r], params[_ROUND_KEYS + 10 + r]
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _global_index(local: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Global flat index of ``local`` under Layout.divisions() as packed by ``_params``.

    g = offset + local * last + sum_d (local // inner_d) * gap_d; the number of terms is
    static (one graph per count).
    """
    g = local * params[_INDEX_MAP + 1] + params[_INDEX_MAP]
    for term in range((params.shape[0] - _INDEX_MAP - 2) // 2):
        inner, gap = params[_INDEX_MAP + 2 + 2 * term], params[_INDEX_MAP + 3 + 2 * term]
        g = g + torch.div(local, inner, rounding_mode="floor") * gap
    return g


def _pack(keeps: list[torch.Tensor]) -> torch.Tensor:
    """One int32 per group whose bytes, in memory order, are the 4 elements' keep flags."""
    packed = keeps[_LANE_ORDER[0]].to(torch.int32)
    for byte in (1, 2, 3):
        packed = packed | (keeps[_LANE_ORDER[byte]].to(torch.int32) << (8 * byte))
    return packed


def _keep_bits_aligned(params: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) int32 keep flags where every group of 4 local elements is 4 consecutive global ones."""
    first = _global_index(torch.arange(groups, dtype=torch.int64) * 4, params)  # (groups,)
    words = _philox_words(params, first >> 2)
    return _pack([w >= params[_THRESHOLD] for w in words])


def _keep_bits_any(params: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) int32 keep flags for any index map: one Philox call per element."""
    g = _global_index(torch.arange(groups * 4, dtype=torch.int64), params)  # (4 * groups,)
    w0, w1, w2, w3 = _philox_words(params, g >> 2)
    lane = g & 3
    word = torch.where(lane == 0, w0, torch.where(lane == 1, w1, torch.where(lane == 2, w2, w3)))
    keep = (word >= params[_THRESHOLD]).view(groups, 4)
    return _pack([keep[:, j] for j in range(4)])


def _apply_dropout(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    # x, keep: (N,)
    return torch.where(keep != 0, x.float() * scale, 0.0).to(x.dtype)


def _apply_residual(
    x: torch.Tensor, keep: torch.Tensor, residual: torch.Tensor, scale: float
) -> torch.Tensor:
    # x, keep, residual: (N,)
    value = torch.where(keep != 0, x.float() * scale, 0.0)
    return (residual.float() + value).to(x.dtype)


def _apply_bias_residual(
    x: torch.Tensor, keep: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float
) -> torch.Tensor:
    # x, keep, residual: (rows, hidden); bias: (hidden,)
    value = torch.where(keep != 0, (x.float() + bias.float()) * scale, 0.0)
    return (residual.float() + value).to(x.dtype)


# Below this many elements the loops run on one thread: an OpenMP region costs a wake-up and a
# barrier, and on a loaded machine the barrier waits for a descheduled thread (measured on the
# 2-core machine at 2^16 elements: 0.9 ms on one thread, 89 ms on two).
_PARALLEL_MIN_NUMEL = 2**18

# impl="auto" runs the reference until this process has spent this much CPU time in it (the
# calling thread's), then compiles: a fresh process pays seconds to import and trace
# torch.compile's machinery, which short runs with small tensors (tests, spawned ranks) never
# earn back. Masks are equal either way.
AUTO_REFERENCE_SECONDS = 2.0

_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_state: dict[str, Any] = {"failed": None, "reference_seconds": 0.0}
_lock = threading.Lock()


def _get(fn: Callable[..., torch.Tensor], *, scalar: bool = False) -> Callable[..., torch.Tensor]:
    compiled = _compiled.get(fn.__name__)
    if compiled is None:
        with _lock:
            compiled = _compiled.get(fn.__name__)
            if compiled is None:
                options = dict(_INDUCTOR_OPTIONS)
                if scalar:
                    # AVX2 has no 64-bit multiply: Inductor's vector code emulates it lane by
                    # lane, and scalar code (one imul, four ALUs) runs Philox faster.
                    options["cpp.simdlen"] = 1
                compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
                _compiled[fn.__name__] = compiled
    return compiled


def compiled_cpu_available() -> bool:
    """False once compiling failed in this process (then the reference runs)."""
    return _state["failed"] is None


def auto_uses_compiled() -> bool:
    """Whether impl="auto" runs the compiled kernel now (see ``AUTO_REFERENCE_SECONDS``)."""
    return compiled_cpu_available() and (
        torch.compiler.is_compiling() or _state["reference_seconds"] >= AUTO_REFERENCE_SECONDS
    )


def timed_reference_op(*args: Any) -> torch.Tensor:
    """The reference op, its forward time counted towards switching impl="auto" to compiled."""
    start = time.thread_time()  # CPU time: other processes' load does not advance it
    out = fused_dropout_op(*args)
    _state["reference_seconds"] += time.thread_time() - start
    return out


def _scale(p: float) -> float:
    # The reference's fp32 scale, as a Python float that converts to fp32 exactly.
    return torch.tensor(1.0 / (1.0 - p) if p < 1 else 0.0, dtype=torch.float32).item()


def _alias(t: torch.Tensor, *shape: int) -> torch.Tensor:
    # A reshaped alias that is not a view: Dynamo guards on a view's base, whose rank changes
    # with the caller's shape, and would recompile for each rank.
    return t.view(shape).detach()


def _run_compiled(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    layout: Layout,
) -> torch.Tensor:
    n = layout.numel
    keep_bits = _keep_bits_aligned if layout.aligned else _keep_bits_any
    params = _params(seed, p, layout)
    # One spare group keeps the size >= 2, so no size is specialised to 1 (a recompile).
    packed = _get(keep_bits, scalar=True)(params, (n + 3) // 4 + 1)  # (groups,) int32
    # (N,) 1.0 kept / 0.0 dropped: torch's own uint8->fp32 cast is one vector pass, while an
    # Inductor loop reading byte flags next to fp32 lanes assembles its mask lane by lane.
    keep = packed.view(torch.uint8)[:n].float()
    scale = _scale(p)
    if bias is not None:
        assert residual is not None  # bias_dropout_add always has a residual
        hidden = bias.numel()
        out = _get(_apply_bias_residual)(
            _alias(x, -1, hidden),
            keep.view(-1, hidden),
            _alias(bias, hidden),
            _alias(residual, -1, hidden),
            scale,
        )
    elif residual is not None:
        out = _get(_apply_residual)(_alias(x, -1), keep, _alias(residual, -1), scale)
    else:
        out = _get(_apply_dropout)(_alias(x, -1), keep, scale)
    return out.view(x.shape)


def fused_dropout_compiled(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    layout: Layout,
) -> torch.Tensor:
    """``fused_dropout_reference``'s result from compiled C++ (contiguous CPU x)."""
    if (
        layout.numel < 2
        or (bias is not None and (bias.numel() < 2 or residual is None))
        or not compiled_cpu_available()
    ):
        # A size of 0 or 1 would compile a specialised kernel; the reference is cheap there.
        # The compiled loops fuse a bias only with a residual (all bias_dropout_add sends).
        return fused_dropout_reference(x, bias, residual, seed, p, layout)
    threads = torch.get_num_threads()
    serial = layout.numel < _PARALLEL_MIN_NUMEL and threads > 1
    try:
        if serial:
            torch.set_num_threads(1)
        return _run_compiled(x, bias, residual, seed, p, layout)
    except Exception as error:
        if not _is_compiler_failure(error):
            raise
        _state["failed"] = error
        warnings.warn(
            "rng_tracker: the compiled CPU dropout kernel cannot be built here "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "running the plain-torch reference instead (same masks, slower). Install a C++ "
            "compiler (g++, or set CXX) to use the compiled kernel, or pass impl='torch' to "
            "silence this.",
            CompiledKernelFallbackWarning,
            stacklevel=2,
        )
        return fused_dropout_reference(x, bias, residual, seed, p, layout)
    finally:
        if serial:
            torch.set_num_threads(threads)


def _is_compiler_failure(error: BaseException) -> bool:
    """Whether ``error`` came out of Inductor building C++ (not a bad input or a bug of ours)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (BackendCompilerFailed, CppCompileError, InvalidCxxCompiler)):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__
    return False


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
    """Fused dropout, compiled CPU kernel (the reference where no C++ compiler runs)."""
    return fused_dropout_compiled(
        x.contiguous(),
        None if bias is None else bias.contiguous(),
        None if residual is None else residual.contiguous(),
        seed,
        p,
        _layout(offset, dims, logical_numel),
    )


fused_dropout_cpu_op.register_fake(_fake)
fused_dropout_cpu_op.register_autograd(
    _make_backward(fused_dropout_cpu_op), setup_context=_setup_context
)
