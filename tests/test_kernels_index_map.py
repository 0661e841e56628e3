"""Region kernels: any box, N-d shard grid (torch.chunk's uneven split) or strided shard of the
logical tensor draws exactly the logical tensor's mask there, on the reference, the compiled
CPU kernel and the Triton path (interpreted on CPU), and advances the generator as the logical call does; placements the
library cannot place exactly are typed errors that draw nothing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rng_tracker import RNGTrackerError
from rng_tracker.errors import KernelInputError, KernelUnavailableError
from rng_tracker.kernels import Chunk, IndexMap, Region, _cpu_kernel, bias_dropout_add, dropout
from rng_tracker.kernels._index_map import index_map_of

IMPLS = ["torch", "cpu", "triton"]


@pytest.fixture(autouse=True, scope="module")
def _compiled_cpu_kernel_runs() -> None:
    """impl="cpu" falls back to the reference (with a warning) where the C kernel cannot be
    built; the "cpu" cases would then compare the reference with itself."""
    assert _cpu_kernel.available(), _cpu_kernel._state["failed"]


P = 0.4
# Small tensors: the interpreted Triton kernel costs about a second per launch.
PROPERTY = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logical(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed))


def _check_piece(full_x, local_x, shard, expected, impl, seed, full_state) -> None:
    g = gen(seed)
    got = dropout(local_x.contiguous(), P, shard=shard, generator=g, impl=impl)
    assert torch.equal(got, expected)
    assert torch.equal(g.get_state(), full_state)  # advanced by the logical numel


@st.composite
def _boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    starts = [draw(st.integers(0, extent - 1)) for extent in shape]
    sizes = [draw(st.integers(1, extent - start)) for extent, start in zip(shape, starts)]
    return shape, tuple(starts), tuple(sizes), draw(st.integers(0, 2**16))


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(case=_boxes())
@example(case=((5, 9, 7), (1, 2, 3), (3, 5, 4), 1))  # 3 merged dims, unaligned
@example(case=((3, 8, 12), (1, 0, 4), (2, 8, 8), 2))  # 2 merged dims, aligned
@example(case=((4, 6), (4, 2), (0, 3), 3))  # empty
def test_any_box_draws_the_logical_mask_there(impl, case):
    """dropout(x[box], shard=Region) == dropout(x)[box] and bias_dropout_add likewise (bias
    sliced to the box's columns), bitwise; the generator ends as after the logical call."""
    shape, starts, sizes, seed = case
    box = tuple(slice(s, s + n) for s, n in zip(starts, sizes))
    x, residual, bias = _logical(shape, seed), _logical(shape, seed + 1), _logical(shape[-1:], 3)
    g = gen(seed)
    full = dropout(x, P, generator=g, impl="torch")
    _check_piece(x, x[box], Region(shape, starts), full[box], impl, seed, g.get_state())
    full_bda = bias_dropout_add(x, bias, residual, P, generator=gen(seed), impl="torch")
    got = bias_dropout_add(
        x[box].contiguous(),
        bias[box[-1]].contiguous(),
        residual[box].contiguous(),
        P,
        shard=Region(shape, starts),
        generator=gen(seed),
        impl=impl,
    )
    assert torch.equal(got, full_bda[box])


def _chunk_bounds(extent: int, index: int, count: int) -> tuple[int, int]:
    """torch.chunk's (and DTensor's) split, with empty trailing chunks."""
    size = -(-extent // count)
    start = min(index * size, extent)
    return start, min(start + size, extent)


@st.composite
def _grids(draw):
    shape = tuple(draw(st.lists(st.integers(1, 10), min_size=2, max_size=3)))
    counts = tuple(draw(st.integers(1, 4)) for _ in shape)
    cell = tuple(draw(st.integers(0, c - 1)) for c in counts)
    return shape, counts, cell, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(case=_grids())
@example(case=((10, 7, 8), (4, 3, 2), (3, 1, 1), 1))  # uneven 3, 3, 3, 1 and 3, 3, 1
@example(case=((5, 9), (4, 2), (3, 0), 2))  # 5 in 4: 2, 2, 1, empty
def test_a_cell_of_an_nd_shard_grid_draws_the_logical_mask(impl, case):
    """A cell of an N-d mesh of torch.chunk splits (uneven and empty chunks included), placed by
    Region, equals the logical output there; along one sharded dim the Chunk shorthand with
    its extent gives the same."""
    shape, counts, cell, seed = case
    bounds = [_chunk_bounds(e, i, c) for e, i, c in zip(shape, cell, counts)]
    box = tuple(slice(a, b) for a, b in bounds)
    x = _logical(shape, seed)
    g = gen(seed)
    full = dropout(x, P, generator=g, impl="torch")
    state = g.get_state()
    region = Region(shape, tuple(a for a, _ in bounds))
    _check_piece(x, x[box], region, full[box], impl, seed, state)
    sharded = [d for d, c in enumerate(counts) if c > 1]
    if len(sharded) == 1:
        d = sharded[0]
        shard = Chunk(d - len(shape), cell[d], counts[d], extent=shape[d])
        _check_piece(x, x[box], shard, full[box], impl, seed, state)


@st.composite
def _strided(draw):
    """A dim of extent a*b*c whose local part is piece i of b in each of a chunks (as DTensor's
    _StridedShard after FSDP2 + TP), with the other dims cut to a box."""
    ndim = draw(st.integers(1, 3))
    d = draw(st.integers(0, ndim - 1))
    a, b, c = draw(st.integers(1, 3)), draw(st.integers(2, 3)), draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    shape[d] = a * b * c
    starts = [draw(st.integers(0, e - 1)) for e in shape]
    sizes = [draw(st.integers(1, e - s)) for e, s in zip(shape, starts)]
    return (
        tuple(shape),
        d,
        (a, b, c),
        draw(st.integers(0, b - 1)),
        starts,
        sizes,
        draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(case=_strided())
@example(case=((3, 24, 4), 1, (2, 3, 4), 1, [1, 0, 1], [2, 24, 2], 1))
def test_a_strided_shard_draws_the_logical_mask(impl, case):
    """A general IndexMap (a dim split into chunk and within-chunk sub-dims, each with its own
    global stride) draws the logical mask at exactly those elements."""
    shape, d, (a, b, c), piece, starts, sizes, seed = case
    x = _logical(shape, seed)
    g = gen(seed)
    full = dropout(x, P, generator=g, impl="torch")
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]

    def take(t: torch.Tensor) -> torch.Tensor:
        box = tuple(
            slice(None) if k == d else slice(s, s + n)
            for k, (s, n) in enumerate(zip(starts, sizes))
        )
        t = t[box]
        split = t.reshape(*t.shape[:d], a, b, c, *t.shape[d + 1 :])
        return split.select(d + 1, piece).reshape(*t.shape[:d], a * c, *t.shape[d + 1 :])

    dims = []
    for k in range(len(shape)):
        if k == d:
            dims += [(a, b * c * strides[k]), (c, strides[k])]
        else:
            dims.append((sizes[k], strides[k]))
    offset = sum(s * st_ for k, (s, st_) in enumerate(zip(starts, strides)) if k != d)
    layout = IndexMap(
        offset=offset + piece * c * strides[d], dims=tuple(dims), logical_numel=x.numel()
    )
    _check_piece(x, take(x), layout, take(full), impl, seed, g.get_state())


def _refuses(call, error=KernelInputError, words=""):
    g = gen(9)
    before = g.get_state()
    with pytest.raises(error) as info:
        call(g)
    assert isinstance(info.value, RNGTrackerError) and words in str(info.value)
    assert torch.equal(g.get_state(), before)


def test_the_issue_uneven_last_chunk_needs_its_extent():
    """Issue 10: the 1-row last chunk of a 10-row tensor split 3, 3, 3, 1 as Chunk(0, 3, 4) is
    refused (no extent), a wrong extent is refused, and extent=10 draws the logical rows."""
    x = _logical((10, 5), 1)
    local = x.chunk(4)[3]
    assert local.shape[0] == 1
    _refuses(lambda g: dropout(local, P, shard=Chunk(0, 3, 4), generator=g), words="extent=")
    _refuses(
        lambda g: dropout(local, P, shard=Chunk(0, 3, 4, extent=12), generator=g),
        words="has size 3",
    )
    for impl in IMPLS:
        full = dropout(x, P, generator=gen(2), impl="torch")
        got = dropout(local, P, shard=Chunk(0, 3, 4, extent=10), generator=gen(2), impl=impl)
        assert torch.equal(got, full[9:])


@pytest.mark.parametrize(
    ("shape", "shard", "words"),
    [
        ((3, 4), Region((3, 4, 1), (0, 0, 0)), "Region has 3 dims"),
        ((3, 4), Region((5, 4), (3, 0)), "does not fit in dim 0"),
        ((3, 4), IndexMap(offset=0, dims=((10, 1),), logical_numel=20), "covers 10"),
        ((2, 4), Chunk(1, 0, 2, extent=9), "has size 5"),
    ],
)
def test_placements_that_do_not_match_x_are_typed_errors(shape, shard, words):
    _refuses(lambda g: dropout(torch.ones(shape), P, shard=shard, generator=g), words=words)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"offset": 0, "dims": ((2, 3), (3, 2)), "logical_numel": 20}, "overlap"),
        ({"offset": 8, "dims": ((3, 4),), "logical_numel": 12}, "reaches global index 16"),
        ({"offset": -1, "dims": ((3, 1),), "logical_numel": 12}, ">= 0"),
        ({"offset": 0, "dims": ((3,),), "logical_numel": 12}, "pair"),
    ],
)
def test_bad_layouts_are_typed_errors(kwargs, words):
    with pytest.raises(RNGTrackerError, match=words):
        IndexMap(**kwargs)


def test_more_merged_dims_than_the_kernel_places_fall_back_or_refuse():
    """Five merged dims: impl='triton' refuses with a typed error; 'auto' runs (on CPU, the
    compiled kernel, which places up to 64)."""
    shape = (3, 3, 3, 3, 3)
    box = (slice(1, 3),) * 5
    x = _logical(shape, 4)
    region = Region(shape, (1,) * 5)
    assert len(index_map_of(x[box].shape, region).dims) == 5
    _refuses(
        lambda g: dropout(x[box].contiguous(), P, shard=region, generator=g, impl="triton"),
        KernelUnavailableError,
        "up to 4 merged dims",
    )
    got = dropout(x[box].contiguous(), P, shard=region, generator=gen(4), impl="auto")
    assert torch.equal(got, dropout(x, P, generator=gen(4), impl="torch")[box])


def test_common_placements_merge_to_the_fast_index_maps():
    """Unsharded and contiguous-block shards are one stride-1 dim (no division), an equal-chunk
    shard of a later dim two dims (one division), and both aligned for widths % 4 == 0."""
    unsharded = index_map_of(torch.Size((4, 8)), None)
    block = index_map_of(torch.Size((2, 8)), Chunk(0, 1, 2, extent=4))
    columns = index_map_of(torch.Size((4, 4)), Chunk(1, 1, 2, extent=8))
    assert unsharded.dims == ((32, 1),) and unsharded.divisions() == (1, ())
    assert block.dims == ((16, 1),) and block.offset == 16
    assert columns.dims == ((4, 8), (4, 1)) and columns.divisions() == (1, ((4, 4),))
    assert unsharded.aligned and block.aligned and columns.aligned


def test_chunk_bounds_and_the_dtensor_split_follow_torch_chunk() -> None:
    """One split rule for kernels' Chunk and the DTensor placements: torch.chunk's, where the
    chunks torch.chunk leaves out (10 rows in 4, 3 rows in 4) are empty."""
    from rng_tracker.kernels._index_map import chunk_bounds
    from rng_tracker.parallel._placement import split_spans

    for extent in range(13):
        for count in range(1, 6):
            chunks = torch.arange(extent).chunk(count) if extent else ()
            for index in range(count):
                want = chunks[index].tolist() if index < len(chunks) else []
                start, stop = chunk_bounds(extent, index, count)
                assert list(range(start, stop)) == want, (extent, index, count)
                spans = split_spans(((0, extent),), count, index)
                assert [g for first, n in spans for g in range(first, first + n)] == want
