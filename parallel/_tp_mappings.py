"""Autograd-aware collectives of tensor and sequence parallelism.

Each is a pair (forward op, backward op) that keeps gradients exact:

| function | forward | backward |
| --- | --- | --- |
| ``copy_to_tp`` | identity | all-reduce |
| ``reduce_from_tp`` | all-reduce | identity |
| ``gather_from_tp`` | all-gather along ``dim`` | keep own chunk |
| ``scatter_to_tp`` | keep own chunk | all-gather |
| ``gather_from_sp`` | all-gather along ``dim`` | reduce-scatter |
| ``reduce_scatter_to_sp`` | reduce-scatter | all-gather |

``group=None`` means no tensor parallelism (a group of one: each returns x), as the layers and
``tp_rank_and_size`` read it; not torch.distributed's "the default group", which would reduce
over the data-parallel ranks too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker._collective import all_gather_cat
from rng_tracker._validate import checked_dim, shown_value
from rng_tracker.errors import ArgumentTypeError, ParallelConfigError, ParallelConfigTypeError


def checked_group(group: object) -> dist.ProcessGroup | None:
    """``group`` itself if it is a process group or None, else :class:`ParallelConfigTypeError`
    (torch would fail later, untyped, or take a name for the default group)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ParallelConfigTypeError(
            f"group must be a torch.distributed ProcessGroup (the TP group) or None, got "
            f"{type(group).__name__} {group!r}"
        )
    return group


def tp_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in the TP group ``group`` (None: no TP, so (0, 1))."""
    if checked_group(group) is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# Every collective below has the signature (tensor, group, dim) -> tensor.


def _identity(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return all_gather_cat(x, group, dim)


def _own_chunk(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ParallelConfigError(
            f"dim {dim} of size {x.shape[dim]} does not divide by the group size {size}"
        )
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    # gloo has no reduce_scatter; all-reduce then keep the own chunk is exact and portable.
    return _own_chunk(_all_reduce(x, group), group, dim)


Collective = Callable[[torch.Tensor, dist.ProcessGroup, int], torch.Tensor]


class _Conjugate(torch.autograd.Function):
    """Forward applies one collective; backward applies its adjoint to the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: dist.ProcessGroup,
        dim: int,
        forward_op: Collective,
        backward_op: Collective,
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.backward_op = group, dim, backward_op
        return forward_op(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.backward_op(grad, ctx.group, ctx.dim), None, None, None, None


def _mapped(
    x: object,
    group: object,
    dim: object,
    forward_op: Collective,
    backward_op: Collective,
) -> torch.Tensor:
    """``forward_op`` on x (``backward_op`` on its gradient) after every argument is checked, so
    a bad one raises on every rank before any collective; ``group=None`` (no TP) returns x.
    ``dim`` None: the mapping has none."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x must be a torch.Tensor, got {shown_value(x)}")
    group = checked_group(group)
    if dim is not None:
        dim = checked_dim(
            dim, "dim", x.shape, type_error=ParallelConfigTypeError, value_error=ParallelConfigError
        )
    if group is None:
        return x
    return _Conjugate.apply(x, group, dim or 0, forward_op, backward_op)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity; backward all-reduces the grad."""
    return _mapped(x, group, None, _identity, _all_reduce)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by summing partial results over the group."""
    return _mapped(x, group, None, _all_reduce, _identity)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' shards along ``dim``."""
    return _mapped(x, group, dim, _all_gather, _own_chunk)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's shard of a replicated tensor along ``dim``."""
    return _mapped(x, group, dim, _own_chunk, _all_gather)


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel all-gather (backward: reduce-scatter)."""
    return _mapped(x, group, dim, _all_gather, _reduce_scatter)


def reduce_scatter_to_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0
) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk (backward: all-gather)."""
    return _mapped(x, group, dim, _reduce_scatter, _all_gather)
