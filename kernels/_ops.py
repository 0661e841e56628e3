"""torch.library registration of fused dropout: reference and Triton ops, fakes, autograd.

Both ops compute ``residual + keep * (x + bias) / (1 - p)`` (bias and residual optional)
with the mask of the seed tensor [key, base, c2, c3] and the index map (offset, dims flattened as
[extent0, stride0, ...], logical numel) of ``shard.IndexMap``. Backward applies the same op to the
incoming gradient (same seed, no bias, no residual): the mask is regenerated, and the
only thing saved is the 32-byte seed tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rng_tracker.kernels._index_map import IndexMap
from rng_tracker.kernels._triton_kernel import HAS_TRITON, fused_dropout_triton
from rng_tracker.kernels.reference import fused_dropout_reference


def _index_map(offset: int, dims: list[int], logical_numel: int) -> IndexMap:
    return IndexMap(
        offset=offset, dims=tuple(zip(dims[::2], dims[1::2])), logical_numel=logical_numel
    )


@torch.library.custom_op("rng_tracker::fused_dropout", mutates_args=())
def fused_dropout_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    offset: int,
    dims: list[int],
    logical_numel: int,
) -> torch.Tensor:
    """Fused dropout, reference path (plain torch, any device)."""
    return fused_dropout_reference(
        x.contiguous(), bias, residual, seed, p, _index_map(offset, dims, logical_numel)
    )


def _fake(x: torch.Tensor, *_: object) -> torch.Tensor:
    # Output metadata depends on x alone; the op's schema comes from the registered function.
    return torch.empty_like(x, memory_format=torch.contiguous_format)


fused_dropout_op.register_fake(_fake)

if HAS_TRITON:

    @torch.library.triton_op("rng_tracker::fused_dropout_triton", mutates_args=())
    def fused_dropout_triton_op(
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        seed: torch.Tensor,
        p: float,
        offset: int,
        dims: list[int],
        logical_numel: int,
    ) -> torch.Tensor:
        """Fused dropout, Triton kernel (traceable by torch.compile through wrap_triton)."""
        return fused_dropout_triton(
            x,
            bias,
            residual,
            seed,
            p,
            _index_map(offset, dims, logical_numel),
            launch=torch.library.wrap_triton,
        )

else:  # pragma: no cover - exercised only where triton is absent
    fused_dropout_triton_op = None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _x, bias, _residual, seed, p, offset, dims, logical_numel = inputs
    save_for_dropout_backward(ctx, bias, seed)
    ctx.params = (p, offset, dims, logical_numel)


def save_for_dropout_backward(ctx: Any, bias: torch.Tensor | None, seed: torch.Tensor) -> None:
    """Keep what ``dropout_backward`` reads: the seed tensor, and the bias's dtype and size."""
    ctx.save_for_backward(seed)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.bias_numel = None if bias is None else bias.numel()


def dropout_backward(
    ctx: Any, grad: torch.Tensor, regenerate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of (x, bias, residual); ``regenerate(grad, seed)`` applies the forward's mask.

    ``ctx`` holds the seed (saved), ``bias_dtype`` and ``bias_numel`` (``_setup_context``).
    """
    (seed,) = ctx.saved_tensors
    needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
    grad_x = grad_bias = None
    if needs_x or needs_bias:
        grad_x = regenerate(grad.contiguous(), seed)
    if needs_bias:
        rows = grad_x.reshape(-1, ctx.bias_numel) if ctx.bias_numel else grad_x.new_zeros(0, 0)
        # Accumulate in fp32 without materialising an fp32 copy of grad_x.
        grad_bias = rows.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_bias, grad if needs_residual else None


def _make_backward(op: Any):
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grads = dropout_backward(ctx, grad, lambda g, seed: op(g, None, None, seed, *ctx.params))
        return *grads, None, None, None, None, None

    return backward


fused_dropout_op.register_autograd(_make_backward(fused_dropout_op), setup_context=_setup_context)
if fused_dropout_triton_op is not None:
    fused_dropout_triton_op.register_autograd(
        _make_backward(fused_dropout_triton_op), setup_context=_setup_context
    )
