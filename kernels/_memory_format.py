"""How a fused dropout call keeps x's memory format, as torch's dropout does.

The kernels compute row-major. A dense x stored in another order (channels_last, a transpose)
gets an output with its strides: the call runs on the contiguous view of x's memory order with
the index map permuted alike, each element keeping its global index, and the output is permuted
back. No copy is made, but where x's innermost memory dim is not its last, four consecutive
elements in memory are not one Philox group: one Philox call per element instead of per four.
Where the permuted map would need more dims than the kernels place, or x's last dim (the
bias's) would not stay innermost, the call runs row-major on a contiguous copy, written into
``empty_like(x)``.
"""

from __future__ import annotations

import torch

from rng_tracker.kernels._call import DropoutCall
from rng_tracker.kernels._index_map import permuted
from rng_tracker.kernels._triton_kernel import MAX_DIVISIONS


def memory_order(x: torch.Tensor) -> list[int] | None:
    """x's dims from the largest stride to the smallest, where that permutation of x is
    contiguous (x is dense); None where x is not dense."""
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    return order if x.permute(order).is_contiguous() else None


def in_memory_order(call: DropoutCall, order: list[int]) -> tuple[DropoutCall, list[int]] | None:
    """``call`` on x permuted to its memory ``order`` (contiguous), the map permuted alike, and
    the order that puts the output's dims back; None where that map needs more dims than every
    kernel places (and than the row-major map), or x's last dim (the bias's) would not stay
    innermost."""
    x = call.x
    if call.bias is not None and order[-1] != x.dim() - 1:
        return None
    index_map = permuted(call.index_map, x.shape, order)
    if index_map is None or len(index_map.dims) > max(len(call.index_map.dims), MAX_DIVISIONS + 1):
        return None
    residual = None if call.residual is None else call.residual.permute(order)
    back = sorted(range(x.dim()), key=order.__getitem__)
    return call._replace(x=x.permute(order), residual=residual, index_map=index_map), back
