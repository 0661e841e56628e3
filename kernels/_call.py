"""One fused dropout call as every kernel path receives it.

``residual + keep * (x + bias) * scale``, where the mask is the one of x's place in the logical
tensor. The public functions validate the call once (tensors, p, the index map); the dispatcher
and the kernels read it as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rng_tracker.kernels._index_map import IndexMap, permuted


class DropoutCall(NamedTuple):
    """The tensors, p and index map of one call (a tuple: made in well under a microsecond)."""

    x: torch.Tensor  # (any shape)
    bias: torch.Tensor | None  # (x.shape[-1],), or None
    residual: torch.Tensor | None  # x.shape, or None
    p: float  # in [0, 1]
    index_map: IndexMap  # where x sits in the logical tensor


_new_tuple = tuple.__new__


def dropout_call(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    p: float,
    index_map: IndexMap,
) -> DropoutCall:
    """``DropoutCall(x, bias, residual, p, index_map)`` without NamedTuple's Python-level
    ``__new__`` (a third of its cost: this runs on every call)."""
    return _new_tuple(DropoutCall, (x, bias, residual, p, index_map))


def in_memory_order(call: DropoutCall) -> tuple[DropoutCall, list[int]] | None:
    """``call`` on x's dims in memory order (a contiguous view of a dense x: channels_last, a
    transpose), each element keeping its global index, with the order that puts the output's
    dims back: the output then has x's memory format, as torch's dropout keeps it. None where
    x is not dense, or its last dim (the bias's) would not stay innermost."""
    x = call.x
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    view = x.permute(order)
    if not view.is_contiguous() or (call.bias is not None and order[-1] != x.dim() - 1):
        return None
    index_map = permuted(call.index_map, x.shape, order)
    if index_map is None:
        return None
    residual = None if call.residual is None else call.residual.permute(order)
    back = sorted(range(x.dim()), key=order.__getitem__)
    return call._replace(x=view, residual=residual, index_map=index_map), back
