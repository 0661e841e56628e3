"""Layout-invariant random ops on DTensors (rng_tracker.parallel.dtensor).

Invariant: for any mesh and placements, the gathered result of an op on a DTensor equals
bitwise the same op on the full tensor from the same generator state, and every rank's
generator ends where the full op leaves it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from rng_tracker.errors import DTensorPlacementError
from rng_tracker.parallel._placement import local_index

# --- pure part: placements + mesh + global shape -> this rank's index lists -----------

_PURE_PLACEMENTS = [Shard(0), Shard(1), Shard(2), Replicate(), _StridedShard(0, split_factor=2)]


def _torch_local(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The local tensor as torch's own placement code cuts it (left to right over mesh axes)."""
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = placement._split_tensor(local, mesh_shape[axis], with_padding=False)
            local = pieces[coordinate[axis]]
    return local


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3, 2), (2, 2, 2)])
@pytest.mark.parametrize("global_shape", [(8, 12, 4), (7, 5, 3), (3, 10, 1), (1, 2, 9)])
def test_local_index_matches_torch_split(mesh_shape, global_shape) -> None:
    """The index lists select exactly the elements torch's Shard/_StridedShard split gives each rank."""
    full = torch.arange(torch.Size(global_shape).numel()).reshape(global_shape)
    for placements in itertools.product(_PURE_PLACEMENTS, repeat=len(mesh_shape)):
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            expected = _torch_local(full, mesh_shape, coordinate, placements)
            index = local_index(global_shape, mesh_shape, coordinate, placements)
            got = full[
                torch.meshgrid(
                    *(torch.tensor(i, dtype=torch.long) for i in index.indices), indexing="ij"
                )
            ]
            assert index.local_shape == tuple(expected.shape), (placements, coordinate)
            assert torch.equal(got, expected), (placements, coordinate)
            # the boxes tile the local tensor: each box is a contiguous block of the logical one
            for box in index.boxes():
                block = full[tuple(slice(o, o + e) for o, e in zip(box.offset, box.extent))]
                local = expected[
                    tuple(slice(s, s + e) for s, e in zip(box.local_start, box.extent))
                ]
                assert torch.equal(block, local)


def test_local_index_refuses_unknown_placements() -> None:
    """A placement the library cannot place is a typed error, not a guess."""
    with pytest.raises(DTensorPlacementError, match="is not Shard, _StridedShard"):
        local_index((4, 4), (2,), (0,), [object()])
    with pytest.raises(DTensorPlacementError, match="placements for a 2-axis mesh"):
        local_index((4, 4), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(DTensorPlacementError, match="shards dim 2"):
        local_index((4, 4), (2,), (0,), [Shard(2)])
