"""Which elements of a DTensor's logical tensor a rank holds (rng_tracker.parallel._placement).

Invariant: for any mesh, coordinate and Shard/_StridedShard/Replicate placements, the index lists
select exactly the elements torch's own split gives that rank, their affine map and boxes describe
the same elements, and a placement the library cannot place is a typed error.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from rng_tracker.errors import DTensorPlacementError
from rng_tracker.kernels import IndexMap
from rng_tracker.parallel._placement import local_index

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
            affine = index.affine()  # full holds global flat indices: got is the map itself
            if affine is not None and got.numel():
                index_map = IndexMap(offset=affine[0], dims=affine[1], logical_numel=full.numel())
                assert torch.equal(index_map.global_index(torch.arange(got.numel())), got.flatten())
            # the boxes tile the local tensor: each box is a contiguous block of the logical one
            for slices, region in index.boxes():
                assert region.global_shape == tuple(full.shape)
                extents = [cut.stop - cut.start for cut in slices]
                block = full[tuple(slice(o, o + e) for o, e in zip(region.offset, extents))]
                assert torch.equal(block, expected[slices])


def test_strided_shards_take_the_affine_map_or_boxes() -> None:
    """Even strided shards are one affine map; uneven ones (runs of two lengths) are boxes."""
    even = local_index((8, 3), (4,), (1,), [_StridedShard(0, split_factor=2)])
    assert even.indices[0] == (1, 5)
    assert even.affine() == (3, ((2, 12), (1, 3), (3, 1)))
    uneven = local_index((7, 3), (2,), (1,), [_StridedShard(0, split_factor=2)])
    assert uneven.indices[0] == (2, 3, 6)
    assert uneven.affine() is None
    assert [(slices, region.offset) for slices, region in uneven.boxes()] == [
        ((slice(0, 2), slice(0, 3)), (2, 0)),
        ((slice(2, 3), slice(0, 3)), (6, 0)),
    ]


def test_local_index_refuses_unknown_placements() -> None:
    """A placement the library cannot place is a typed error, not a guess."""
    with pytest.raises(DTensorPlacementError, match="is not Shard, _StridedShard"):
        local_index((4, 4), (2,), (0,), [object()])
    with pytest.raises(DTensorPlacementError, match="placements for a 2-axis mesh"):
        local_index((4, 4), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(DTensorPlacementError, match="shards dim 2"):
        local_index((4, 4), (2,), (0,), [Shard(2)])


def test_a_layout_is_placed_once_and_a_symbolic_size_is_placed_anew() -> None:
    """A DTensor's random op places its layout every step: the index lists, the box and the
    affine map are now built once per layout (the same objects come back, equal to a fresh
    build), and a size that cannot be a cache key (a SymInt under make_fx) is placed anew."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rng_tracker.parallel import _placement

    args = ((8, 12, 4), (2, 2), (1, 0), (Shard(1), _StridedShard(0, split_factor=2)))
    first = local_index(*args)
    assert local_index(*args) is first and first.box() is None  # a strided shard: no one box
    assert first.affine() is not None and first.affine() is first.affine()
    fresh = _placement._local_index.__wrapped__(*args, None)
    assert fresh == first and fresh._affine() == first.affine()
    boxed_args = ((8, 12, 4), (2, 2), (1, 0), (Shard(1), Shard(0)))
    boxed = local_index(*boxed_args)
    assert boxed.box() is not None and boxed.box() is boxed.box()
    assert boxed.box() == _placement._local_index.__wrapped__(*boxed_args, None)._box()
    assert local_index([8, 12, 4], [2, 2], [1, 0], list(args[3])) is first  # lists: the same key

    placed = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        placed.append(local_index((x.shape[0], 4), (2,), (1,), (Shard(0),)))
        return x

    make_fx(traced, tracing_mode="symbolic")(torch.ones(6, 4))
    symbolic = placed[0]
    assert not isinstance(symbolic.global_shape[0], int)  # placed with the SymInt, no error
    assert symbolic.spans[1] == ((0, 4),)


def test_an_even_strided_shard_of_a_symbolic_size_has_its_affine_map() -> None:
    """The affine map of an even _StridedShard (FSDP2 + TP) put run lengths and steps in sets,
    and a symbolic size cannot be hashed: under make_fx's symbolic trace it raised TypeError.
    It now compares them, and the map's values are the concrete layout's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    placements = (_StridedShard(0, split_factor=2),)
    maps = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        offset, dims = local_index((x.shape[0], 4), (2,), (1,), placements).affine()
        maps.append((int(offset), tuple((int(e), int(s)) for e, s in dims)))
        return x

    make_fx(traced, tracing_mode="symbolic")(torch.ones(8, 4))
    assert maps == [local_index((8, 4), (2,), (1,), placements).affine()]
