"""Where a local tensor sits in the logical tensor, and its elements' global indices.

Every placement (``Chunk``, ``Region`` or a general ``IndexMap``) becomes one affine index map
from the local row-major flat index l to the logical row-major flat index g:

    g = offset + sum_d ((l // inner_d) % extent_d) * stride_d

over merged dims d (outermost first; inner_d = product of the extents after d). Dims of
extent 1 are dropped and neighbours contiguous in both tensors are merged, so an unsharded
tensor or a contiguous block is one dim of stride 1 (no division) and an equal-chunk shard
two dims (one division).

Bound: the logical tensor has at most ``MAX_LOGICAL_NUMEL`` = 2**63 - 1 elements, so every
global index, offset and stride is an int64 on every path (the torch reference, the
compiled CPU kernel and Triton). A placement beyond it raises :class:`KernelInputError`
when the ``Chunk``, ``Region`` or ``IndexMap`` is built, before any path runs or anything is
drawn (docs/keyed.md, "Huge logical tensors").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rng_tracker._validate import checked_int, known_true
from rng_tracker.errors import KernelInputError, KernelInputTypeError

MAX_LOGICAL_NUMEL = 2**63 - 1  # int64's largest value: global indices stay int64 on every path


def _check_logical_numel(owner: str, what: str, value: int) -> None:
    if known_true(value > MAX_LOGICAL_NUMEL):
        raise KernelInputError(
            f"{owner} {what} is {value}, beyond the {MAX_LOGICAL_NUMEL} (2**63 - 1) elements a "
            "logical tensor may have: global indices must fit in int64 on every kernel path; "
            "split the logical tensor (e.g. one logical tensor per layer or per micro-batch)"
        )


def chunk_bounds(extent: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``count`` along a dim of ``extent``, by torch.chunk's
    rule (DTensor's too): chunks of ceil(extent / count), so the last ones may be short or empty."""
    size = -(-extent // count)
    # builtin min: Dynamo keeps it symbolic (torch.sym_min costs 8 us per call on plain ints)
    start = min(index * size, extent)
    return start, min(start + size, extent)


def _check_int(owner: str, name: str, value: object, *, minimum: int | None = 0) -> int:
    return checked_int(
        value,
        f"{owner}.{name}",
        type_error=KernelInputTypeError,
        value_error=KernelInputError,
        minimum=minimum,
    )


def _int_tuple(owner: str, name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, torch.Size):
        values = tuple(values)
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise KernelInputTypeError(
            f"{owner}.{name} must be a sequence of ints, got {type(values).__name__}"
        )
    return tuple(_check_int(owner, f"{name}[{i}]", v) for i, v in enumerate(values))


@dataclass(frozen=True, slots=True)
class Chunk:
    """The local tensor is chunk ``index`` of ``count`` chunks of the logical tensor along ``dim``.

    Chunks follow torch.chunk's rule (DTensor's too): chunk size ceil(extent / count), so
    with an uneven ``extent`` the last chunks are smaller or empty (10 rows in 4: 3, 3, 3, 1).
    ``extent`` is the logical size of ``dim``. It is required whenever ``count > 1``: the
    local size alone never determines it (a 3-row chunk 0 of 4 may come from 9 to 12 rows,
    each giving a different mask), and guessing would draw a silently different mask. For
    an even split pass ``extent=x_local.shape[dim] * count``.
    """

    dim: int
    index: int
    count: int
    extent: int | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "index", "count"):
            object.__setattr__(
                self, name, _check_int("Chunk", name, getattr(self, name), minimum=None)
            )
        if self.count < 1 or not 0 <= self.index < self.count:
            raise KernelInputError(
                f"Chunk needs count >= 1 and 0 <= index < count, got {self}: index is this "
                "rank's chunk (its rank in the group that splits the dim), count the group's size"
            )
        if self.extent is not None:
            object.__setattr__(self, "extent", _check_int("Chunk", "extent", self.extent))
            _check_logical_numel("Chunk", "extent", self.extent)
        elif self.count > 1:
            raise KernelInputError(
                f"Chunk(dim={self.dim}, index={self.index}, count={self.count}) needs extent=, "
                "the logical size of the sharded dim: the local size does not determine it "
                "(torch.chunk splits 10 rows in 4 as 3, 3, 3, 1). Pass "
                "extent=x_local.shape[dim] * count for an even split, or use Region"
            )


@dataclass(frozen=True, slots=True)
class Region:
    """The local tensor is the box of the logical tensor of ``global_shape`` at ``offset``.

    One offset per dim; the box's size is the local tensor's shape and must fit inside
    ``global_shape``. Covers uneven splits and N-d meshes (FSDP x TP) alike.
    """

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "global_shape", _int_tuple("Region", "global_shape", self.global_shape)
        )
        object.__setattr__(self, "offset", _int_tuple("Region", "offset", self.offset))
        if len(self.offset) != len(self.global_shape):
            raise KernelInputError(
                f"Region has {len(self.global_shape)} global dims but {len(self.offset)} "
                "offsets; give one offset per dim"
            )
        for d, (extent, start) in enumerate(zip(self.global_shape, self.offset, strict=True)):
            _check_logical_numel("Region", f"global_shape[{d}]", extent)
            _check_logical_numel("Region", f"offset[{d}]", start)
        _check_logical_numel(
            "Region", f"global_shape {self.global_shape} numel", math.prod(self.global_shape)
        )


@dataclass(frozen=True, slots=True)
class IndexMap:
    """A general affine index map, also accepted as ``shard=`` (e.g. for strided shards).

    ``dims`` holds (extent, stride) per dim of the local tensor's row-major flat order,
    outermost first: extents multiply to the local numel; strides are the dims' strides in
    the logical row-major tensor of ``logical_numel`` elements, starting at ``offset``.
    A dim of a DTensor ``_StridedShard`` is two dims here: (chunks, stride of a chunk) and
    (within a chunk, stride of a row). The map must not overlap (sorted by stride, every
    stride exceeds the span of the dims below it) and must stay inside the logical tensor.
    Construction normalises ``dims`` (extent-1 dims dropped, contiguous neighbours merged).
    """

    offset: int
    dims: tuple[tuple[int, int], ...]
    logical_numel: int
    numel: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("offset", "logical_numel"):
            object.__setattr__(self, name, _check_int("IndexMap", name, getattr(self, name)))
        _check_logical_numel("IndexMap", "logical_numel", self.logical_numel)
        _check_logical_numel("IndexMap", "offset", self.offset)
        if not isinstance(self.dims, Sequence):
            raise KernelInputTypeError(
                f"IndexMap.dims must be a sequence of (extent, stride) pairs, got {self.dims!r}"
            )
        pairs = []
        for i, pair in enumerate(self.dims):
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise KernelInputTypeError(
                    f"IndexMap.dims[{i}] must be an (extent, stride) pair, got {pair!r}"
                )
            pairs.append(
                (
                    _check_int("IndexMap", f"dims[{i}] extent", pair[0]),
                    _check_int("IndexMap", f"dims[{i}] stride", pair[1]),
                )
            )
        numel = math.prod([extent for extent, _ in pairs])
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "dims", _merge(pairs) if numel else ((0, 1),))
        if numel:
            self._check_inside_and_one_to_one()

    def _check_inside_and_one_to_one(self) -> None:
        if torch.compiler.is_compiling():  # sizes may be symbolic (sorting them breaks the graph)
            return  # the registered op checks the real sizes when it runs
        span = 0
        for extent, stride in sorted(self.dims, key=lambda pair: pair[1]):
            if stride <= span:
                raise KernelInputError(
                    f"IndexMap dims {self.dims} overlap: two local elements would share a global "
                    "index (sorted by stride, each stride must exceed the span of the dims below)"
                )
            span += (extent - 1) * stride
        if self.offset + span >= self.logical_numel:
            raise KernelInputError(
                f"IndexMap reaches global index {self.offset + span} but the logical tensor has "
                f"{self.logical_numel} elements"
            )

    @property
    def contiguous(self) -> bool:
        """Whether the local tensor is one contiguous block of the logical tensor."""
        return len(self.dims) <= 1 and (not self.dims or self.dims[0][1] == 1)

    def divisions(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """(last stride, ((inner_d, gap_d), ...)) with g = offset + l * last + sum (l // inner_d) * gap_d.

        The division form of the map: one floor division per merged dim but the innermost,
        no modulo (gap_d = stride_d - extent_{d+1} * stride_{d+1}, nonzero after merging).
        """
        if not self.dims:
            return 1, ()
        terms = []
        inner = 1
        for d in range(len(self.dims) - 1, 0, -1):
            extent, stride = self.dims[d]
            inner *= extent  # inner_{d-1}: the extents of dims d..last
            terms.append((inner, self.dims[d - 1][1] - extent * stride))
        return self.dims[-1][1], tuple(terms)

    @property
    def aligned(self) -> bool:
        """Whether each group of 4 local elements (l = 4k..4k+3) is 4 consecutive global ones
        starting at a multiple of 4, so one Philox call feeds the group."""
        if self.offset % 4:
            return False
        if self.contiguous:
            return True
        last_extent, last_stride = self.dims[-1]
        return (
            last_stride == 1
            and last_extent % 4 == 0
            and all(stride % 4 == 0 for _, stride in self.dims[:-1])
        )

    def global_index(self, local: torch.Tensor) -> torch.Tensor:
        """Global flat indices (int64) of the local flat indices ``local`` (int64)."""
        last, terms = self.divisions()
        g = local if last == 1 else local * last
        for inner, gap in terms:
            g = g + torch.div(local, inner, rounding_mode="floor") * gap
        return g + self.offset if self.offset else g

    def global_indices(self, device: torch.device) -> torch.Tensor:
        """Global flat indices of every local element, in local flat order."""
        return self.global_index(torch.arange(self.numel, dtype=torch.int64, device=device))

    def flat(self) -> list[int]:
        """dims as a flat list [extent0, stride0, extent1, ...] (a torch.library int[] argument)."""
        return [v for pair in self.dims for v in pair]


def _merge(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for extent, stride in pairs:
        if extent == 1:
            continue
        if merged and merged[-1][1] == extent * stride:
            merged[-1] = (merged[-1][0] * extent, stride)
        else:
            merged.append((extent, stride))
    return tuple(merged)


ShardArg = Chunk | Region | IndexMap


def permuted(index_map: IndexMap, shape: Sequence[int], order: Sequence[int]) -> IndexMap | None:
    """The map of ``x.permute(order)`` (read in its own row-major order) where ``index_map``
    places x of ``shape``: each element keeps its global index, so the mask moves with it.
    None where a dim of x is not one run of the map's dims (then x has no per-dim strides)."""
    if index_map.numel == 0:
        return index_map
    pairs = list(index_map.dims)
    per_dim: list[list[tuple[int, int]]] = []
    for extent in reversed(shape):  # peel the map's dims off from the innermost, x dim by x dim
        left, group = extent, []
        while left > 1:
            inner_extent, stride = pairs.pop()
            if inner_extent <= left and left % inner_extent == 0:
                group.insert(0, (inner_extent, stride))
                left //= inner_extent
            elif inner_extent % left == 0:  # the map's dim spans this x dim and outer ones
                pairs.append((inner_extent // left, stride * left))
                group.insert(0, (left, stride))
                left = 1
            else:
                return None
        per_dim.insert(0, group)
    dims = [pair for d in order for pair in per_dim[d]]
    return IndexMap(
        offset=index_map.offset, dims=tuple(dims), logical_numel=index_map.logical_numel
    )


def to_op_args(index_map: IndexMap) -> tuple[int, list[int], int]:
    """(offset, dims as [extent0, stride0, extent1, ...], logical numel): the index map as the
    registered ops take it (torch.library has no IndexMap type); :func:`from_op_args` inverts it."""
    return index_map.offset, index_map.flat(), index_map.logical_numel


def from_op_args(offset: int, dims: Sequence[int], logical_numel: int) -> IndexMap:
    """The index map of :func:`to_op_args`'s values (validated again: an op may be called directly)."""
    return IndexMap(
        offset=offset, dims=tuple(zip(dims[::2], dims[1::2])), logical_numel=logical_numel
    )


def _row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return strides[::-1]


def build_cached(builder: Any, *key: Any) -> Any:
    """``builder(*key)`` (an ``lru_cache``d builder: a layout repeats every step, so what is built
    of it is built and checked once), built anew where no cache can serve: while Dynamo traces
    (it warns when tracing through a cache) and for a symbolic size (unhashable: make_fx,
    export)."""
    if torch.compiler.is_compiling():
        return builder.__wrapped__(*key)
    try:
        hash(key)
    except TypeError:
        return builder.__wrapped__(*key)
    return builder(*key)


@functools.lru_cache(maxsize=1024)
def _box(shape: torch.Size, global_shape: tuple[int, ...], offset: tuple[int, ...]) -> IndexMap:
    strides = _row_major_strides(global_shape)
    return IndexMap(
        offset=sum(o * s for o, s in zip(offset, strides, strict=True)),
        dims=tuple(zip(shape, strides, strict=True)),
        logical_numel=math.prod(global_shape),
    )


@functools.lru_cache(maxsize=256)
def _whole(numel: int) -> IndexMap:
    return IndexMap(offset=0, dims=((numel, 1),), logical_numel=numel)


def index_map_of(shape: torch.Size, shard: ShardArg | None) -> IndexMap:
    """The index map of a local tensor of ``shape`` placed by ``shard`` (None: the whole tensor)."""
    shape = torch.Size(shape)
    if shard is None:
        # (torch.Size.numel() would specialise a symbolic size)
        return build_cached(_whole, math.prod(shape))
    if isinstance(shard, IndexMap):
        if shard.numel != shape.numel():
            raise KernelInputError(
                f"the IndexMap covers {shard.numel} local elements but x has {shape.numel()} "
                f"(shape {tuple(shape)}); its extents must multiply to x.numel()"
            )
        return shard
    if isinstance(shard, Region):
        if len(shard.global_shape) != len(shape):
            raise KernelInputError(
                f"Region has {len(shard.global_shape)} dims but x has {len(shape)} "
                f"(shape {tuple(shape)}); give one global extent and offset per dim of x"
            )
        for d, (size, start, extent) in enumerate(
            zip(shape, shard.offset, shard.global_shape, strict=True)
        ):
            if start + size > extent:
                raise KernelInputError(
                    f"the box does not fit in dim {d}: offset {start} + local size {size} > "
                    f"global extent {extent} (x {tuple(shape)}, {shard})"
                )
        return build_cached(_box, shape, shard.global_shape, shard.offset)
    if not isinstance(shard, Chunk):
        raise KernelInputTypeError(
            f"shard must be a Chunk, Region, IndexMap or None, got {type(shard).__name__}"
        )
    if not shape:
        raise KernelInputError("a 0-dim tensor cannot be a shard; pass shard=None")
    if not -len(shape) <= shard.dim < len(shape):
        raise KernelInputError(
            f"Chunk.dim {shard.dim} is out of range for a {len(shape)}-dim tensor"
        )
    dim = shard.dim % len(shape)
    extent = shape[dim] if shard.extent is None else shard.extent  # extent None only if count 1
    start, stop = chunk_bounds(extent, shard.index, shard.count)
    if shape[dim] != stop - start:
        raise KernelInputError(
            f"x has size {shape[dim]} in dim {dim} but chunk {shard.index} of {shard.count} of "
            f"extent {extent} has size {stop - start} (torch.chunk's rule: chunks of "
            f"ceil({extent}/{shard.count})); pass the logical extent of dim {dim} as extent="
        )
    global_shape = list(shape)
    global_shape[dim] = extent
    offset = [0] * len(shape)
    offset[dim] = start
    return build_cached(_box, shape, tuple(global_shape), tuple(offset))
