"""Huge logical tensors: every kernel path gives the same answer near 2**62..2**64 elements.

Up to ``MAX_LOGICAL_NUMEL`` (2**63 - 1) elements, impl 'torch', 'cpu' and (interpreted)
'triton' all compute the documented mask: element g keeps iff word g % 4 of Philox4x32-10
at counter c = (base + g // 4) mod 2**64 is >= ceil(p * 2**32). The oracle below is that
definition in Python ints, independent of every kernel. Beyond the bound every path refuses
with ``KernelInputError`` and nothing is drawn. (conftest.py sets TRITON_INTERPRET=1.)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rng_tracker.errors import KernelInputError, RNGTrackerError
from rng_tracker.kernels import MAX_LOGICAL_NUMEL, Chunk, IndexMap, Region, _cpu_kernel, dropout
from rng_tracker.kernels._index_map import index_map_of
from rng_tracker.kernels._rng_source import advanced_offset

IMPLS = ("torch", "cpu", "triton")
P = 0.5
M32 = 0xFFFFFFFF


@pytest.fixture(autouse=True, scope="module")
def _compiled_cpu_kernel_runs() -> None:
    """impl="cpu" falls back to the reference (with a warning) where the C kernel cannot be
    built; the "cpu" cases would then compare the reference with itself."""
    assert _cpu_kernel.available(), _cpu_kernel._state["failed"]


def _philox_words(key: int, counter: tuple[int, int, int, int]) -> tuple[int, ...]:
    """Philox4x32-10 in Python ints (Salmon et al. 2011), the oracle's own implementation."""
    x0, x1, x2, x3 = counter
    k0, k1 = key & M32, (key >> 32) & M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 & M32, (p0 >> 32) ^ x3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return x0, x1, x2, x3


def _oracle(seed: list[int], global_indices: list[int]) -> list[bool]:
    key, base, c2, c3 = (w % 2**64 for w in seed)
    threshold = math.ceil(P * 2**32)
    keep = []
    for g in global_indices:
        c = (base + g // 4) % 2**64
        keep.append(_philox_words(key, (c & M32, c >> 32, c2, c3))[g % 4] >= threshold)
    return keep


def _box_indices(shape: tuple[int, ...], global_shape: tuple[int, ...], offset: tuple[int, ...]):
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    indices = [0]
    for size, start, stride in zip(shape, offset, strides, strict=True):
        indices = [i + (start + k) * stride for i in indices for k in range(size)]
    return indices


def _signed(word: int) -> int:
    return word - 2**64 if word >= 2**63 else word


def _answers(shape: tuple[int, ...], make_shard, seed: list[int]) -> dict[str, object]:
    """Each impl's mask (a bool list) or the type of its refusal. The shard is built per call,
    so a refusal at construction is each path's own refusal."""
    x = torch.ones(shape)
    seed_t = torch.tensor([_signed(w % 2**64) for w in seed], dtype=torch.int64)
    answers: dict[str, object] = {}
    for impl in IMPLS:
        try:
            y = dropout(x, P, shard=make_shard(), seed=seed_t, impl=impl)
        except RNGTrackerError as error:
            assert isinstance(error, KernelInputError) and isinstance(error, ValueError), error
            assert "2**63 - 1" in str(error), str(error)
            answers[impl] = type(error)
        else:
            answers[impl] = (y != 0).reshape(-1).tolist()
    return answers


seeds = st.tuples(
    st.integers(0, 2**64 - 1),
    st.one_of(st.integers(2**64 - 64, 2**64 - 1), st.integers(0, 2**64 - 1)),  # base: carry
    st.integers(0, M32),
    st.integers(0, M32),
).map(list)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    log2_numel=st.floats(62.0, 64.2),
    cols=st.one_of(st.integers(1, 12), st.integers(2**20, 2**40)),
    rows_local=st.integers(1, 3),
    cols_local=st.integers(1, 9),
    from_end=st.integers(0, 6),
    col_at=st.integers(0, 2**40),
    seed=seeds,
)
@example(  # the case: (2**62, 8) is 2**65 elements
    log2_numel=65.0, cols=8, rows_local=4, cols_local=8, from_end=0, col_at=0, seed=[123, 0, 0, 0]
)
@example(  # the largest logical tensor, its last elements
    log2_numel=63.0, cols=1, rows_local=3, cols_local=1, from_end=0, col_at=0, seed=[1, -1, 0, 0]
)
def test_every_impl_gives_the_same_answer_on_huge_regions(
    log2_numel, cols, rows_local, cols_local, from_end, col_at, seed
):
    rows = max(rows_local, int(2**log2_numel) // cols)
    if log2_numel == 63.0:
        rows = MAX_LOGICAL_NUMEL  # the bound itself, with cols 1
    cols_local = min(cols_local, cols)
    global_shape = (rows, cols)
    offset = (
        rows - rows_local - min(from_end, rows - rows_local),
        col_at % (cols - cols_local + 1),
    )
    shape = (rows_local, cols_local)
    answers = _answers(shape, lambda: Region(global_shape, offset), seed)
    if rows * cols > MAX_LOGICAL_NUMEL:
        assert answers == dict.fromkeys(IMPLS, KernelInputError)
    else:
        expected = _oracle(seed, _box_indices(shape, global_shape, offset))
        assert answers == dict.fromkeys(IMPLS, expected)


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(
    rows_local=st.integers(1, 4),
    cols=st.integers(1, 6),
    log2_count=st.floats(59.0, 63.5),
    seed=seeds,
)
def test_shards_of_huge_extent_agree_or_are_refused(rows_local, cols, log2_count, seed):
    """Chunk arithmetic (chunk size, start) near the bound: the last chunk of a huge dim 0."""
    count = int(2**log2_count) // rows_local
    extent = rows_local * count
    shape = (rows_local, cols)
    answers = _answers(shape, lambda: Chunk(0, count - 1, count, extent), seed)
    if extent * cols > MAX_LOGICAL_NUMEL:
        assert answers == dict.fromkeys(IMPLS, KernelInputError)
    else:
        start = (count - 1) * rows_local
        expected = _oracle(seed, _box_indices(shape, (extent, cols), (start, 0)))
        assert answers == dict.fromkeys(IMPLS, expected)


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(
    rows_local=st.integers(2, 3),
    cols_local=st.integers(2, 5),
    stride=st.integers(2**40, 2**62),
    below_end=st.integers(1, 2**20),
    seed=seeds,
)
def test_transposed_layouts_near_the_bound_agree(rows_local, cols_local, stride, below_end, seed):
    """A layout whose outer local dim has the small stride (negative gaps in the division form):
    intermediate products pass 2**63 on the int64 paths, the result must not."""
    stride = max(stride, cols_local)
    span = (cols_local - 1) + (rows_local - 1) * stride
    offset = MAX_LOGICAL_NUMEL - below_end - span
    dims = ((cols_local, 1), (rows_local, stride))
    answers = _answers(
        (cols_local, rows_local),
        lambda: IndexMap(offset=offset, dims=dims, logical_numel=MAX_LOGICAL_NUMEL),
        seed,
    )
    indices = [offset + i + j * stride for i in range(cols_local) for j in range(rows_local)]
    assert answers == dict.fromkeys(IMPLS, _oracle(seed, indices))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Region((2**62, 8), (2**62 - 4, 0)),
        lambda: Region((2**63, 1), (2**63 - 4, 0)),
        lambda: Region((0, 2**64), (0, 0)),
        lambda: Region((4, 8), (2**64, 0)),
        lambda: Chunk(0, 0, 1, 2**63),
        lambda: IndexMap(offset=0, dims=((4, 1),), logical_numel=2**63),
        lambda: IndexMap(offset=2**63, dims=((0, 1),), logical_numel=8),
    ],
)
def test_placements_beyond_the_bound_are_refused_and_nothing_is_drawn(make):
    generator = torch.default_generator
    before = generator.get_state()
    with pytest.raises(KernelInputError, match=r"2\*\*63 - 1"):
        index_map_of(torch.Size((4, 8)), make())
    for impl in IMPLS:
        with pytest.raises(KernelInputError, match=r"2\*\*63 - 1"):
            dropout(torch.ones(4, 8), P, shard=make(), impl=impl)
    assert torch.equal(generator.get_state(), before)


def test_cuda_offset_advance_past_2_to_the_64_is_refused():
    """The CUDA generator path's offset arithmetic (rng_source.advanced_offset), which runs
    before set_offset: an advance that would wrap the uint64 offset is refused."""
    assert advanced_offset(0, MAX_LOGICAL_NUMEL) == 2**63
    assert advanced_offset(2**64 - 8, 4) == 2**64 - 4
    with pytest.raises(KernelInputError, match="2\\*\\*64 - 1"):
        advanced_offset(2**64 - 4, 1)
    with pytest.raises(KernelInputError):
        advanced_offset(2**63 + 4, MAX_LOGICAL_NUMEL)
