"""The tensor- and sequence-parallel mappings (rng_tracker.parallel._tp_mappings): each is exact
with its adjoint in backward, ``group=None`` means no tensor parallelism (a group of one, as the
layers and ``tp_rank_and_size`` read it), and bad arguments are refused on every rank before any
collective runs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rng_tracker.errors import (
    ArgumentTypeError,
    ParallelConfigError,
    ParallelConfigTypeError,
    RNGTrackerError,
)
from rng_tracker.parallel import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)

_WITH_DIM = (gather_from_tp, scatter_to_tp, gather_from_sp, reduce_scatter_to_sp)
_MAPPINGS = (copy_to_tp, reduce_from_tp, *_WITH_DIM)


@pytest.mark.distributed(world_size=2)
def test_no_group_is_no_tensor_parallelism_on_a_data_parallel_world(rank: int) -> None:
    """Two data-parallel ranks, no TP: ``group=None`` returns x and passes the gradient through
    (it summed over the world: reduce_from_tp gave 2 * x, gather_from_tp twice the rows)."""
    for mapping in _MAPPINGS:
        x = torch.arange(4.0).reshape(2, 2).add(rank).requires_grad_()
        y = mapping(x, None)
        assert torch.equal(y, x), mapping.__name__
        (y * 3).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 3.0)), mapping.__name__


@pytest.mark.distributed(world_size=2)
def test_each_mapping_and_its_adjoint_on_two_ranks(rank: int) -> None:
    group = dist.new_group([0, 1])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).add(10 * rank).requires_grad_()
    y = reduce_from_tp(x, group)
    assert torch.equal(y, torch.tensor([[12.0, 14.0], [16.0, 18.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 2))
    x.grad = None
    copy_to_tp(x, group).sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones(2, 2))
    x.grad = None
    gathered = gather_from_tp(x, group, dim=-1)
    assert gathered.shape == (2, 4)
    assert torch.equal(gathered[:, 2 * rank : 2 * rank + 2], x.detach())
    (gathered * torch.arange(4.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0)[2 * rank : 2 * rank + 2].expand(2, 2))
    x.grad = None
    own = scatter_to_tp(x, group, dim=0)
    assert torch.equal(own, x.detach()[rank : rank + 1])


@pytest.mark.distributed(world_size=2)
def test_bad_arguments_are_refused_on_every_rank_before_a_collective(rank: int) -> None:
    group = dist.new_group([0, 1])
    x = torch.ones(2, 2)
    refused = []
    for mapping in _MAPPINGS:
        with pytest.raises(ArgumentTypeError, match=r"x must be a torch\.Tensor") as info:
            mapping([1.0, 2.0], group)
        refused.append((info.value, TypeError))
        with pytest.raises(ParallelConfigTypeError, match="ProcessGroup") as info:
            mapping(x, "tp")
        refused.append((info.value, TypeError))
    for mapping in _WITH_DIM:
        with pytest.raises(ParallelConfigError, match="dim=7 is not a dim of x") as info:
            mapping(x, group, dim=7)
        refused.append((info.value, ValueError))
        with pytest.raises(ParallelConfigTypeError, match="dim") as info:
            mapping(x, group, dim="a")
        refused.append((info.value, TypeError))
        with pytest.raises(ParallelConfigError, match="dim=2 is not a dim of x") as info:
            mapping(x, None, dim=2)  # checked without a group too
        refused.append((info.value, ValueError))
    for error, builtin in refused:
        assert isinstance(error, RNGTrackerError) and isinstance(error, builtin), error
    dist.barrier(group)  # every rank got here: nothing above ran a collective
