"""Public fused dropout: ``dropout`` and ``bias_dropout_add``, differentiable and mask-free.

The Philox key and counter base come from the default generator of x's device (or
``generator``), so tracker forks, checkpoint replays and ``torch.manual_seed`` govern
these kernels exactly as they govern ``torch.nn.functional.dropout``. Or they come from an
explicit ``seed`` tensor [key, base, c2, c3] (keyed randomness), and nothing is drawn.
"""

from __future__ import annotations

import numbers
from typing import Literal

import torch

from rng_tracker._device_rng import default_generator
from rng_tracker.errors import KernelInputError, KernelInputTypeError, KernelUnavailableError
from rng_tracker.kernels._cpu_kernel import (
    auto_uses_compiled,
    compiled_cpu_dropout,
    fused_dropout_cpu_op,
    may_skip_dispatch,
)
from rng_tracker.kernels._index_map import IndexMap, ShardArg, index_map_of
from rng_tracker.kernels._ops import fused_dropout_op, fused_dropout_triton_op
from rng_tracker.kernels._rng_source import drawn_seed, drawn_words, seed_tensor
from rng_tracker.kernels._triton_kernel import MAX_DIVISIONS, TRITON_IMPORT_ERROR, triton_runs_on

Impl = Literal["auto", "triton", "cpu", "torch"]
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_IMPLS = ("auto", "triton", "cpu", "torch")
Words = tuple[int, int, int, int]


def check_p(p: object) -> float:
    if type(p) is float and 0.0 <= p <= 1.0:  # the usual case, without the ABC check
        return p
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise KernelInputTypeError(f"p must be a float, got {type(p).__name__} {p!r}")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise KernelInputError(f"dropout probability p must be in [0, 1], got {p}")
    return p


def _check_tensor(name: str, t: object, like: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelInputTypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise KernelInputError(
            f"{name} has dtype {t.dtype}; fused dropout supports fp32, fp16 and bf16"
        )
    if like is not None and (t.device != like.device or t.dtype != like.dtype):
        raise KernelInputError(
            f"{name} is {t.dtype} on {t.device} but x is {like.dtype} on {like.device}; "
            "move/cast it to match x"
        )
    return t


def _path(x: torch.Tensor, impl: object, index_map: IndexMap) -> str:
    """The one decision of which kernel runs a call: "triton", "cpu" (the compiled C kernel;
    its op warns once and runs the reference where it cannot be built) or "reference"."""
    if impl not in _IMPLS:
        raise KernelInputError(f"impl must be 'auto', 'triton', 'cpu' or 'torch', got {impl!r}")
    on_cpu = x.device.type == "cpu"
    if impl == "cpu":
        if not on_cpu:
            raise KernelUnavailableError(
                f"impl='cpu' runs the compiled CPU kernel, but x is on {x.device}; use impl='auto'"
            )
        return "cpu"
    if impl == "torch":
        return "reference"
    if impl == "auto" and on_cpu:  # Triton runs CPU tensors only when asked (the interpreter)
        return "cpu" if auto_uses_compiled() else "reference"
    runs = triton_runs_on(x.device) and fused_dropout_triton_op is not None
    if impl == "triton" and not runs:
        why = f" (importing triton failed: {TRITON_IMPORT_ERROR})" if TRITON_IMPORT_ERROR else ""
        raise KernelUnavailableError(
            f"impl='triton' cannot run for a tensor on {x.device} here{why}: it needs triton and a "
            "CUDA device (or TRITON_INTERPRET=1 for CPU tensors); use impl='torch' or 'auto'"
        )
    placeable = len(index_map.dims) <= MAX_DIVISIONS + 1
    if impl == "triton":
        if not placeable:
            raise KernelUnavailableError(
                f"impl='triton' places index maps of up to {MAX_DIVISIONS + 1} merged dims; this "
                f"shard has {len(index_map.dims)} ({index_map.dims}); use impl='torch' or 'auto'"
            )
        return "triton"
    # auto off CPU: Triton on a GPU, the reference elsewhere (and for maps it cannot place).
    return "triton" if runs and x.device.type == "cuda" and placeable else "reference"


_OPS = {
    "triton": fused_dropout_triton_op,
    "cpu": fused_dropout_cpu_op,
    "reference": fused_dropout_op,
}


def _check_seed(
    seed: object, generator: torch.Generator | None, x: torch.Tensor
) -> tuple[torch.Tensor | None, Words | None]:
    """Validate an explicit seed tensor without reading a device tensor (no host sync); return
    it with its words where they were read (a CPU seed, outside torch.compile)."""
    if seed is None:
        return None, None
    if not isinstance(seed, torch.Tensor):
        raise KernelInputTypeError(
            f"seed must be an int64 tensor or None, got {type(seed).__name__}"
        )
    if generator is not None:
        raise KernelInputError(
            "pass seed= or generator=, not both: with a seed tensor nothing is drawn from a generator"
        )
    if seed.dtype != torch.int64 or seed.shape != (4,):
        raise KernelInputError(
            f"seed must be an int64 tensor of 4 words [key, base, c2, c3], got {seed.dtype} of "
            f"shape {tuple(seed.shape)}"
        )
    if seed.device.type == "meta" and x.device.type != "meta":
        raise KernelInputError("seed is on the meta device; it must hold real values")
    words = None
    if seed.device.type == "cpu" and not torch.compiler.is_compiling():  # free to read: no sync
        words = tuple(seed.tolist())
        if not all(0 <= w < 2**32 for w in words[2:]):
            raise KernelInputError(
                f"seed words c2 and c3 must be in [0, 2**32), got {words[2]} and {words[3]}"
            )
    return seed, words


def _fused(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    p: float,
    index_map: IndexMap,
    generator: torch.Generator | None,
    seed: torch.Tensor | None,
    words: Words | None,
    impl: Impl,
) -> torch.Tensor:
    path = _path(x, impl, index_map)
    if path == "cpu" and may_skip_dispatch(x):
        # eager on CPU: straight to the kernel, with the seed words as ints (converted once)
        if seed is None:
            words = _drawn_words(x, p, index_map, generator)
        elif words is None:  # a seed on another device: brought here and read once
            seed = seed.to(x.device)
            words = tuple(seed.tolist())
        return compiled_cpu_dropout(x, bias, residual, seed, words, p, index_map)
    if seed is not None:  # keyed: nothing is drawn, so a CUDA graph may capture the call
        seed = seed.to(x.device, non_blocking=True)
    else:
        seed = _draw_seed(x, p, index_map, generator, path == "triton")
    return _OPS[path](
        x, bias, residual, seed, p, index_map.offset, index_map.flat(), index_map.logical_numel
    )


def _draw_seed(
    x: torch.Tensor,
    p: float,
    index_map: IndexMap,
    generator: torch.Generator | None,
    use_triton: bool,
) -> torch.Tensor:
    """The seed words of one generator-driven call, taken from ``generator`` (or x's device's)."""
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise KernelUnavailableError(
            "fused dropout cannot be captured in a CUDA graph: its Philox key and counter base "
            "are read from the generator on the host, so every replay would reuse the captured "
            "mask; call it outside the capture (or use torch.compile, which feeds a fresh seed "
            "tensor to each replay)"
        )
    device = x.device if use_triton else torch.device("cpu")
    if p == 1.0:  # nothing is kept: no randomness is needed, the generator stays put
        return seed_tensor(0, 0, device)
    generator = generator if generator is not None else default_generator(x.device)
    if not isinstance(generator, torch.Generator):
        raise KernelInputTypeError(
            f"generator must be a torch.Generator, got {type(generator).__name__}"
        )
    return drawn_seed(generator, index_map.logical_numel, device)


def _drawn_words(
    x: torch.Tensor, p: float, index_map: IndexMap, generator: torch.Generator | None
) -> Words:
    """``_draw_seed``'s words as ints, for an eager call on CPU (no tensor made)."""
    if p == 1.0:  # nothing is kept: no randomness is needed, the generator stays put
        return (0, 0, 0, 0)
    if generator is None:
        generator = torch.default_generator
    elif not isinstance(generator, torch.Generator):
        raise KernelInputTypeError(
            f"generator must be a torch.Generator, got {type(generator).__name__}"
        )
    return drawn_words(generator, index_map.logical_numel)


def dropout(
    x: torch.Tensor,
    p: float,
    *,
    training: bool = True,
    shard: ShardArg | None = None,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Dropout whose mask is a pure function of (key, counter base, global index).

    ``shard`` places x in the logical tensor (``Chunk``, ``Region`` or a general
    ``IndexMap``), so the shards of all ranks draw exactly the unsharded tensor's mask, and
    the generator advances by the logical element count on every rank. p == 0 or
    ``training=False`` returns x and draws nothing.

    ``seed`` (keyed randomness): an int64 tensor [key, base, c2, c3] on any device; then
    nothing is drawn from any generator (``generator`` must be None) and element g uses
    Philox key (lo32, hi32 of key) at counter (lo32(c), hi32(c), c2, c3), c = base + g // 4
    (mod 2**64). c2 and c3 must be in [0, 2**32): checked for a CPU seed; a seed on a device
    is not read on the host (no sync), and there only their low 32 bits count. A seed on x's
    device is used in place, so a CUDA graph may capture the call. Backward saves the seed
    tensor itself: modify it in place before backward and autograd reports it.
    """
    _check_tensor("x", x)
    p = check_p(p)
    index_map = index_map_of(x.shape, shard)  # validates the shard before anything is drawn
    seed, words = _check_seed(seed, generator, x)
    if not training or p == 0.0:
        return x
    return _fused(x, None, None, p, index_map, generator, seed, words, impl)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    *,
    training: bool = True,
    shard: ShardArg | None = None,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` in one pass; bias has shape (x.shape[-1],) or is None."""
    _check_tensor("x", x)
    _check_tensor("residual", residual, like=x)
    if residual.shape != x.shape:
        raise KernelInputError(
            f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}"
        )
    if bias is not None:
        _check_tensor("bias", bias, like=x)
        if x.dim() == 0 or bias.shape != x.shape[-1:]:
            raise KernelInputError(
                f"bias must have shape {tuple(x.shape[-1:])} (the last dim of x), got {tuple(bias.shape)}"
            )
    p = check_p(p)
    index_map = index_map_of(x.shape, shard)
    seed, words = _check_seed(seed, generator, x)
    if not training or p == 0.0:
        return residual + (x if bias is None else x + bias)
    return _fused(x, bias, residual, p, index_map, generator, seed, words, impl)
