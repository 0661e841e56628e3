"""Public fused dropout: ``dropout`` and ``bias_dropout_add``, differentiable and mask-free.

The Philox key and counter base come from the default generator of x's device (or
``generator``), so tracker forks, checkpoint replays and ``torch.manual_seed`` govern
these kernels exactly as they govern ``torch.nn.functional.dropout``. Or they come from an
explicit ``seed`` tensor [key, base, c2, c3] (keyed randomness), and nothing is drawn.
"""

from __future__ import annotations

import torch

from rng_tracker._validate import checked_flag
from rng_tracker.errors import KernelInPlaceError, KernelInputError, KernelInputTypeError
from rng_tracker.kernels._call import check_tensor, dropout_call
from rng_tracker.kernels._dispatch import IMPLS, Impl, run, unknown_impl
from rng_tracker.kernels._index_map import ShardArg, index_map_of
from rng_tracker.kernels._rng_source import Words, check_generator
from rng_tracker.kernels.reference import check_p, check_seed_shape, read_seed_words


def _in_one_dtype(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Megatron's dtypes for bias-dropout-add: where x's dtype is not the residual's (a fp32
    residual stream under bf16 activations), x and bias in the residual's; else x + bias
    promotes, as in torch."""
    if x.dtype != residual.dtype:
        return x.to(residual.dtype), None if bias is None else bias.to(residual.dtype), residual
    if bias is not None and bias.dtype != x.dtype:
        dtype = torch.promote_types(x.dtype, bias.dtype)
        return x.to(dtype), bias.to(dtype), residual.to(dtype)
    return x, bias, residual


def _check_training(training: object) -> None:
    if type(training) is not bool:  # the usual case costs one type check
        checked_flag(training, "training", type_error=KernelInputTypeError)


def elements_share_memory(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location (a dim of stride 0, an expand):
    the overlap torch refuses to write in place."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def check_writable_in_place(x: torch.Tensor) -> None:
    """Refuse, before anything is drawn, a tensor torch would not let an in-place dropout write
    (torch finds out after drawing the mask, its generator advanced). Under torch.compile the
    compiler checks the write itself."""
    if torch.compiler.is_compiling():
        return
    base = x._base if x._is_view() else None
    if torch.is_grad_enabled() and x.requires_grad and x.is_leaf:
        problem = "x is a leaf tensor that requires grad: autograd needs its values"
    elif torch.is_grad_enabled() and base is not None and base.requires_grad and base.is_leaf:
        problem = "x is a view of a leaf tensor that requires grad: autograd needs its values"
    elif x.is_inference() and not torch.is_inference_mode_enabled():
        problem = "x is an inference tensor, written only inside torch.inference_mode()"
    elif elements_share_memory(x):
        problem = f"elements of x share memory (stride 0 in {tuple(x.stride())}: an expand)"
    else:
        return
    raise KernelInPlaceError(
        f"dropout(inplace=True) cannot overwrite x: {problem}; pass inplace=False, or a clone"
    )


def _check_skipped_call(generator: object, impl: object) -> None:
    """What a call that draws nothing (training=False or p == 0) does not reach: impl, then the
    generator's type, checked in the order a call that runs checks them (route, then draw)."""
    if impl not in IMPLS:
        raise unknown_impl(impl)
    if generator is not None:
        check_generator(generator)


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
    check_seed_shape(seed)
    if seed.device.type == "meta" and x.device.type != "meta":
        raise KernelInputError("seed is on the meta device; it must hold real values")
    return seed, read_seed_words(seed)


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    shard: ShardArg | None = None,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Dropout whose mask is a pure function of (key, counter base, global index).

    Called as ``torch.nn.functional.dropout(x, p, training, inplace)``: ``inplace=True``
    writes the result into x and returns x. In eager code on a contiguous x the compiled CPU
    kernel and the Triton kernel write x itself, making no output tensor; elsewhere (the
    reference, under torch.compile or a dispatch mode, a strided x) the output is made and
    copied in: the same bits. A tensor torch will not write in place (a leaf that requires
    grad, an expand, ...) raises ``KernelInPlaceError`` before anything is drawn.

    ``shard`` places x in the logical tensor (``Chunk``, ``Region`` or a general
    ``IndexMap``), so the shards of all ranks draw exactly the unsharded tensor's mask, and
    the generator advances by the logical element count on every rank. p == 0,
    ``training=False`` or a logical tensor of no elements returns x and draws nothing, as torch.

    ``seed`` (keyed randomness): an int64 tensor [key, base, c2, c3] on any device; then
    nothing is drawn from any generator (``generator`` must be None) and element g uses
    Philox key (lo32, hi32 of key) at counter (lo32(c), hi32(c), c2, c3), c = base + g // 4
    (mod 2**64). c2 and c3 must be in [0, 2**32): checked for a CPU seed; a seed on a device
    is not read on the host (no sync), and there only their low 32 bits count. A seed on x's
    device is used in place (Triton reads a strided view, e.g. a column of a seed table,
    through a copy), so a CUDA graph may capture the call. Backward saves the seed tensor
    itself: modify it in place before backward and autograd reports it.
    """
    check_tensor("x", x)
    p = check_p(p)
    index_map = index_map_of(x.shape, shard)  # validates the shard before anything is drawn
    seed, words = _check_seed(seed, generator, x)
    _check_training(training)
    if type(inplace) is not bool:
        inplace = checked_flag(inplace, "inplace", type_error=KernelInputTypeError)
    if not training or p == 0.0 or index_map.logical_numel == 0:
        _check_skipped_call(generator, impl)
        return x
    if inplace:
        check_writable_in_place(x)
    return run(dropout_call(x, None, None, p, index_map), impl, generator, seed, words, inplace)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    *,
    shard: ShardArg | None = None,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` in one pass; bias has shape (x.shape[-1],) or is None.

    ``training`` may come fifth by position, as in Megatron-LM's and ColossalAI's
    ``bias_dropout_add(x, bias, residual, prob, training)``, so their calls run unchanged.

    Dtypes as Megatron's: where x's is not the residual's, x and bias are taken in the
    residual's (an fp32 residual stream under bf16 activations); else x + bias promotes."""
    check_tensor("x", x)
    check_tensor("residual", residual, like=x)
    if residual.shape != x.shape:
        raise KernelInputError(
            f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, like=x)
        if x.dim() == 0 or bias.shape != x.shape[-1:]:
            raise KernelInputError(
                f"bias must have shape {tuple(x.shape[-1:])} (the last dim of x), got {tuple(bias.shape)}"
            )
    p = check_p(p)
    index_map = index_map_of(x.shape, shard)
    seed, words = _check_seed(seed, generator, x)
    _check_training(training)
    x, bias, residual = _in_one_dtype(x, bias, residual)
    if not training or p == 0.0 or index_map.logical_numel == 0:
        _check_skipped_call(generator, impl)
        return residual + (x if bias is None else x + bias)
    return run(dropout_call(x, bias, residual, p, index_map), impl, generator, seed, words)
