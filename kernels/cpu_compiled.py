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

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rng_tracker.kernels.philox import (
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
    _mulhilo,
)
from rng_tracker.kernels.reference import fused_dropout_reference, keep_threshold
from rng_tracker.kernels.shard import Layout

__all__ = [
    "CompiledKernelFallbackWarning",
    "compiled_cpu_available",
    "fused_dropout_compiled",
]

_MASK32 = 0xFFFFFFFF
# Inductor's C++ flags that could change bits: keep FP contraction and unsafe math off even
# where the environment turned them on (TORCHINDUCTOR_CPP_ENABLE_*).
_INDUCTOR_OPTIONS = {
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
}


class CompiledKernelFallbackWarning(UserWarning):
    """The compiled CPU dropout kernel cannot be built here; the plain-torch reference runs."""


def _philox_words(
    seed: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 words at counter (lo32(base + c), hi32(base + c), c2, c3); int64 holding uint32."""
    key, base = seed[0], seed[1]  # 0-dim int64
    k0 = key & _MASK32
    k1 = (key >> 32) & _MASK32  # arithmetic shift, then masked: the key's high word
    c = base + c
    c0 = c & _MASK32
    c1 = (c >> 32) & _MASK32
    if seed.shape[0] == 4:  # explicit seed [key, base, c2, c3]
        c2 = (seed[2] & _MASK32).expand_as(c)
        c3 = (seed[3] & _MASK32).expand_as(c)
    else:
        c2 = torch.zeros_like(c)
        c3 = c2
    for round_index in range(10):
        if round_index:
            k0 = (k0 + PHILOX_KEY_A) & _MASK32
            k1 = (k1 + PHILOX_KEY_B) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_ROUND_A, c0)
        hi1, lo1 = _mulhilo(PHILOX_ROUND_B, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _global_index(local: torch.Tensor, index_map: torch.Tensor) -> torch.Tensor:
    """Global flat index of local flat index ``local`` under index_map [row, gap, offset]."""
    row, gap, offset = index_map[0], index_map[1], index_map[2]
    return local + torch.div(local, row, rounding_mode="floor") * gap + offset


def _pack(keeps: list[torch.Tensor]) -> torch.Tensor:
    bits = keeps[0].to(torch.uint8)
    for j in (1, 2, 3):
        bits = bits | (keeps[j].to(torch.uint8) << j)
    return bits


def _keep_bits_contiguous(
    seed: torch.Tensor, params: torch.Tensor, groups: int
) -> torch.Tensor:
    """(groups,) uint8 keep bits where local element l has global index l + offset, offset % 4 == 0."""
    threshold, offset = params[0], params[3]
    first = torch.arange(groups, dtype=torch.int64) * 4 + offset  # (groups,) global index of lane 0
    words = _philox_words(seed, first >> 2)
    return _pack([w >= threshold for w in words])


def _keep_bits_aligned(seed: torch.Tensor, params: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) uint8 keep bits where every group of 4 local elements is a group of 4 global ones."""
    threshold = params[0]
    first = _global_index(torch.arange(groups, dtype=torch.int64) * 4, params[1:])  # (groups,)
    words = _philox_words(seed, first >> 2)
    return _pack([w >= threshold for w in words])


def _keep_bits_any(seed: torch.Tensor, params: torch.Tensor, groups: int) -> torch.Tensor:
    """(groups,) uint8 keep bits for any index map: one Philox call per element."""
    threshold = params[0]
    g = _global_index(torch.arange(groups * 4, dtype=torch.int64), params[1:])  # (4 groups,)
    w0, w1, w2, w3 = _philox_words(seed, g >> 2)
    lane = g & 3
    word = torch.where(lane == 0, w0, torch.where(lane == 1, w1, torch.where(lane == 2, w2, w3)))
    keep = (word >= threshold).view(groups, 4)
    return _pack([keep[:, j] for j in range(4)])


def _keep(bits: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return ((bits[local >> 2] >> (local & 3)) & 1) != 0


def _apply_dropout(x: torch.Tensor, bits: torch.Tensor, scale: float) -> torch.Tensor:
    # x: (N,)
    local = torch.arange(x.shape[0], dtype=torch.int64)
    value = torch.where(_keep(bits, local), x.float() * scale, 0.0)
    return value.to(x.dtype)


def _apply_residual(
    x: torch.Tensor, bits: torch.Tensor, residual: torch.Tensor, scale: float
) -> torch.Tensor:
    # x, residual: (N,)
    local = torch.arange(x.shape[0], dtype=torch.int64)
    value = torch.where(_keep(bits, local), x.float() * scale, 0.0)
    return (residual.float() + value).to(x.dtype)


def _apply_bias_residual(
    x: torch.Tensor, bits: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float
) -> torch.Tensor:
    # x, residual: (rows, hidden); bias: (hidden,)
    rows, hidden = x.shape
    local = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * hidden + torch.arange(
        hidden, dtype=torch.int64
    )  # (rows, hidden)
    value = torch.where(_keep(bits, local), (x.float() + bias.float()) * scale, 0.0)
    return (residual.float() + value).to(x.dtype)


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
_state: dict[str, Any] = {"failed": None}
_lock = threading.Lock()


def _get(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    compiled = _compiled.get(fn.__name__)
    if compiled is None:
        with _lock:
            compiled = _compiled.get(fn.__name__)
            if compiled is None:
                compiled = torch.compile(
                    fn, dynamic=True, fullgraph=True, options=dict(_INDUCTOR_OPTIONS)
                )
                _compiled[fn.__name__] = compiled
    return compiled


def compiled_cpu_available() -> bool:
    """False once compiling failed in this process (then the reference runs)."""
    return _state["failed"] is None


def _scale(p: float) -> float:
    # The reference's fp32 scale, as a Python float that converts to fp32 exactly.
    return torch.tensor(1.0 / (1.0 - p) if p < 1 else 0.0, dtype=torch.float32).item()


def _run_compiled(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    layout: Layout,
) -> torch.Tensor:
    n = layout.numel
    if layout.gap == 0 and layout.offset % 4 == 0:
        keep_bits = _keep_bits_contiguous
    elif layout.aligned:
        keep_bits = _keep_bits_aligned
    else:
        keep_bits = _keep_bits_any
    params = torch.tensor(
        [keep_threshold(p), layout.row, layout.gap, layout.offset], dtype=torch.int64
    )
    # One spare group keeps the size >= 2, so no size is specialised to 1 (a recompile).
    bits = _get(keep_bits)(seed, params, (n + 3) // 4 + 1)
    scale = _scale(p)
    if bias is not None:
        assert residual is not None  # bias_dropout_add always has a residual
        hidden = bias.numel()
        out = _get(_apply_bias_residual)(
            x.view(-1, hidden), bits, bias.contiguous(), residual.reshape(-1, hidden), scale
        )
    elif residual is not None:
        out = _get(_apply_residual)(x.view(-1), bits, residual.reshape(-1), scale)
    else:
        out = _get(_apply_dropout)(x.view(-1), bits, scale)
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
    if layout.numel < 2 or bias is not None and bias.numel() < 2 or not compiled_cpu_available():
        # A size of 0 or 1 would compile a specialised kernel; the reference is cheap there.
        return fused_dropout_reference(x, bias, residual, seed, p, layout)
    try:
        return _run_compiled(x, bias, residual, seed, p, layout)
    except Exception as error:  # noqa: BLE001 - any compiler failure means: run the reference
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
