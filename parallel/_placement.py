"""Which elements of a DTensor's logical tensor this rank holds: placements + mesh → index lists.

DTensor shards act on one tensor dim each, so the local tensor is always the logical
tensor indexed by one list of global indices per dim (in local order), kept as spans of
consecutive indices. ``Shard`` splits
the current piece of a dim by torch.chunk's rule (the last chunks may be short or
empty); ``_StridedShard(dim, split_factor=s)`` (FSDP2 + TP) first chunks the piece into
``s`` parts, chunks each part over the mesh axis and concatenates this rank's chunk of
every part. Mesh axes apply left to right, unless the spec carries an explicit
``shard_order``. The lists are then cut into contiguous runs: a box of the logical
tensor per combination of runs (one box in the common case).

Also the DTensor mechanics every random op on a DTensor shares: refusing a plain tensor,
reducing Partial axes before a nonlinear op, wrapping a local result back, and which rank of a
Partial placement holds an init's values.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from rng_tracker._batch_position import BatchPosition
from rng_tracker._torch_private import strided_shard_type
from rng_tracker.errors import DTensorInputTypeError, DTensorPlacementError
from rng_tracker.kernels._fused_dropout import elements_share_memory
from rng_tracker.kernels._index_map import Region, build_cached, chunk_bounds

_StridedShard = strided_shard_type()
_SHARD_LIKE = (Shard, _StridedShard)  # not subclasses of each other


# (global start, length): consecutive global indices of a dim, as a rank holds them
Span = tuple[int, int]


def split_spans(spans: Sequence[Span], count: int, index: int) -> tuple[Span, ...]:
    """Chunk ``index`` of the indices ``spans`` hold (in order), split into ``count`` parts by
    torch.chunk's rule. Sizes may be symbolic (a trace): nothing is expanded to a list."""
    start, stop = chunk_bounds(sum(length for _, length in spans), index, count)
    part, position = [], 0
    for first, length in spans:
        lo, hi = max(start - position, 0), min(stop - position, length)
        if lo < hi:
            part.append((first + lo, hi - lo))
        position += length
    return tuple(part)


@dataclass(frozen=True, slots=True)
class LocalIndex:
    """The global indices this rank holds along each dim of a logical tensor of ``global_shape``,
    as spans of consecutive indices in local order (sizes stay symbolic under a trace)."""

    global_shape: tuple[int, ...]
    spans: tuple[tuple[Span, ...], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(length for _, length in spans) for spans in self.spans)

    @property
    def indices(self) -> tuple[tuple[int, ...], ...]:
        """The global indices along each dim, listed (real sizes only)."""
        return tuple(
            tuple(g for first, length in spans for g in range(first, first + length))
            for spans in self.spans
        )

    def runs(self, dim: int) -> list[tuple[int, int, int]]:
        """Maximal runs (local start, length, global start) of consecutive global indices along ``dim``."""
        runs: list[list[int]] = []
        position = 0
        for first, length in self.spans[dim]:
            if runs and runs[-1][2] + runs[-1][1] == first:
                runs[-1][1] += length
            else:
                runs.append([position, length, first])
            position += length
        return [tuple(run) for run in runs] if runs else [(0, 0, 0)]

    def affine(self) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """The map local flat -> global flat as (offset, ((extent, stride), ...)), or None.

        Exists when every dim's indices are runs of one length at one step (even strided
        shards): each such dim is two dims, (runs, step) and (run length, 1), in units of
        the dim's stride in the logical tensor. Found once per layout.
        """
        return build_cached(_affine_of, self)

    def _affine(self) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        strides = [math.prod(self.global_shape[d + 1 :]) for d in range(len(self.global_shape))]
        offset, dims = 0, []
        for d, stride in enumerate(strides):
            runs = self.runs(d)
            # compared, not put in a set: a symbolic size (a trace) cannot be hashed
            if any(length != runs[0][1] for _, length, _ in runs):
                return None
            steps = [b[2] - a[2] for a, b in itertools.pairwise(runs)]
            if any(step != steps[0] for step in steps):
                return None
            offset += runs[0][2] * stride
            if steps:
                dims.append((len(runs), steps[0] * stride))
            dims.append((runs[0][1], stride))
        return offset, tuple(dims)

    def box(self) -> Region | None:
        """The local tensor as one box of the logical tensor, or None where it is several (no
        slice object is made: a trace keeps the sizes symbolic). Found once per layout."""
        return build_cached(_box_of, self)

    def _box(self) -> Region | None:
        per_dim = [self.runs(d) for d in range(len(self.global_shape))]
        if any(len(runs) != 1 for runs in per_dim):
            return None
        return Region(self.global_shape, tuple(runs[0][2] for runs in per_dim))

    def last_dim_spans(self) -> tuple[Span, ...]:
        """The global indices along the last dim, as maximal spans ((0, 1) for a 0-d tensor)."""
        if not self.global_shape:
            return ((0, 1),)
        return tuple((first, length) for _, length, first in self.runs(len(self.global_shape) - 1))

    def boxes(self) -> list[tuple[tuple[slice, ...], Region]]:
        """The local tensor as boxes of the logical tensor, in row-major order of the runs:
        each the local slices that hold it and its :class:`~rng_tracker.kernels.Region`."""
        per_dim = [self.runs(d) for d in range(len(self.global_shape))]
        return [
            (
                tuple(slice(start, start + length) for start, length, _ in combo),
                Region(self.global_shape, tuple(offset for _, _, offset in combo)),
            )
            for combo in itertools.product(*per_dim)
        ]


def in_global_batch(index: LocalIndex, batch_dim: int, position: BatchPosition) -> LocalIndex:
    """``index`` of a tensor whose logical tensor holds samples [sample_offset, sample_offset +
    b) of a global batch along ``batch_dim``: the same elements, placed in the logical tensor
    over the whole global batch."""
    global_shape, spans = list(index.global_shape), list(index.spans)
    global_shape[batch_dim] = position.global_batch
    spans[batch_dim] = tuple((first + position.sample_offset, n) for first, n in spans[batch_dim])
    return LocalIndex(tuple(global_shape), tuple(spans))


def _shard_steps(placements: Sequence[object], shard_order: object) -> list[tuple[int, int]]:
    """(mesh axis, tensor dim) of every shard placement, in the order they apply."""
    if shard_order is not None:
        return [(axis, entry.tensor_dim) for entry in shard_order for axis in entry.mesh_dims]
    steps = []
    for axis, placement in enumerate(placements):
        if isinstance(placement, _SHARD_LIKE):
            steps.append((axis, placement.dim))
    return steps


@torch.compiler.disable(reason="Dynamo (torch 2.13) cannot read _StridedShard.split_factor")
def _split_factor(placement: _StridedShard) -> int:
    # Dynamo (torch 2.13) fails reading this attribute ("cls_source must not be None"), in
    # torch's own code too: read outside the graph (a break only where a _StridedShard is)
    return int(placement.split_factor)


@functools.lru_cache(maxsize=256)
def _box_of(index: LocalIndex) -> Region | None:
    return index._box()


@functools.lru_cache(maxsize=256)
def _affine_of(index: LocalIndex) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    return index._affine()


def local_index(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    *,
    shard_order: object = None,
) -> LocalIndex:
    """The index lists of the rank at ``coordinate`` of a mesh of ``mesh_shape``, found once
    per layout (a DTensor's random op asks every step).

    Raises DTensorPlacementError for a placement that is not Shard, _StridedShard,
    Replicate or Partial (the library cannot place it exactly).
    """
    return build_cached(
        _local_index,
        tuple(global_shape),
        tuple(mesh_shape),
        tuple(coordinate),
        tuple(placements),
        shard_order,
    )


@functools.lru_cache(maxsize=256)
def _local_index(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[object, ...],
    shard_order: object,
) -> LocalIndex:
    ndim = len(global_shape)
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise DTensorPlacementError(
            f"{len(placements)} placements for a {len(mesh_shape)}-axis mesh "
            f"(coordinate {tuple(coordinate)}); give one placement per mesh axis"
        )
    for placement in placements:
        if not isinstance(placement, (*_SHARD_LIKE, Replicate, Partial)):
            raise DTensorPlacementError(
                f"placement {placement!r} is not Shard, _StridedShard, Replicate or Partial; "
                "redistribute the DTensor to one of those before a random op"
            )
        if isinstance(placement, _SHARD_LIKE) and not -ndim <= placement.dim < max(ndim, 1):
            raise DTensorPlacementError(
                f"{placement!r} shards dim {placement.dim} of a {ndim}-dim tensor"
            )
    spans: list[tuple[Span, ...]] = [((0, size),) for size in global_shape]
    for axis, dim in _shard_steps(placements, shard_order):
        placement = placements[axis]
        dim %= ndim
        count, index = mesh_shape[axis], coordinate[axis]
        if isinstance(placement, _StridedShard):
            split = _split_factor(placement)
            parts = [split_spans(spans[dim], split, j) for j in range(split)]
            spans[dim] = tuple(span for part in parts for span in split_spans(part, count, index))
        else:
            spans[dim] = split_spans(spans[dim], count, index)
    return LocalIndex(global_shape=tuple(global_shape), spans=tuple(spans))


def local_index_of(x: DTensor) -> LocalIndex:
    """The index lists of this rank's local tensor of ``x``, checked against its actual shape."""
    mesh = x.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise DTensorPlacementError(
            "this rank is not part of the DTensor's mesh; call random ops on mesh ranks only"
        )
    spec = x._spec
    shard_order = None
    if not getattr(spec, "use_strided_shard_as_shard_order", True):
        order = getattr(spec, "shard_order", None)
        if order is not None and order != spec.compute_default_shard_order(spec.placements):
            shard_order = order
    found = local_index(
        tuple(x.shape), tuple(mesh.shape), coordinate, x.placements, shard_order=shard_order
    )
    with torch.no_grad():
        actual = tuple(x.to_local().shape)
    if found.local_shape != actual:
        raise DTensorPlacementError(
            f"the local tensor has shape {actual} but placements {x.placements} on mesh "
            f"{tuple(mesh.shape)} give {found.local_shape} at coordinate {tuple(coordinate)}; "
            "the DTensor's metadata does not describe its shards (from_local with a wrong "
            "shape?), so its place in the logical tensor is unknown"
        )
    return found


def require_dtensor(name: str, x: object) -> DTensor:
    """``x`` itself if it is a DTensor, else :class:`DTensorInputTypeError` naming ``name``."""
    if not isinstance(x, DTensor):
        raise DTensorInputTypeError(
            f"{name} must be a DTensor, got {type(x).__name__}; for a plain local shard use "
            "rng_tracker.kernels.dropout(x, p, shard=Region(...))"
        )
    return x


def without_partial(x: DTensor) -> DTensor:
    """x with every Partial axis reduced (dropout is not linear: reduce, then drop)."""
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    placements = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
    return x.redistribute(x.device_mesh, placements)


def wrap_local(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's part of a DTensor of ``like``'s mesh, placements, shape, stride."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def write_in_place(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` written into ``target`` in place, as into a plain tensor. ``value`` has target's
    placements with Partial made Replicate (as the draws return it). DTensor's own copy_ would
    divide it by the size of each Partial("sum") axis on every rank: v/3 summed three times is
    not v in floating point, and an integer v/n truncates. So a Partial target's local tensor
    takes the value where it holds one and zeros elsewhere, as an init of it does."""
    if not partial_written_exactly(target) or (torch.is_grad_enabled() and target.requires_grad):
        return target.copy_(value)  # (recording autograd: DTensor's copy_ does it)
    with torch.no_grad():
        local = target.to_local()
        if holds_values(target):
            local.copy_(value.to_local())
        else:
            local.zero_()
    return target


_EXACT_REDUCTIONS = ("sum", "max", "min")  # the Partial reductions an init writes exactly


def _is_exact_partial(placement: object) -> bool:
    return type(placement) is Partial and placement.reduce_op in _EXACT_REDUCTIONS


def partial_written_exactly(t: object) -> bool:
    """Whether ``t`` is a DTensor with Partial axes, each one that :func:`holds_values` places
    exactly (sum, max or min)."""
    partials = [p for p in getattr(t, "placements", ()) if isinstance(p, Partial)]
    return bool(partials) and all(map(_is_exact_partial, partials))


def holds_values(t: DTensor) -> bool:
    """Whether this rank holds the values (True) or zeros (False) of an init of ``t``.

    A ``Partial("sum")`` axis keeps the values on its coordinate 0 (the others add zero);
    ``Partial("max"/"min")`` on every coordinate; other reductions cannot be initialised exactly.
    """
    holds = True
    coordinate = t.device_mesh.get_coordinate()
    for axis, placement in enumerate(t.placements):
        if not isinstance(placement, Partial):
            continue
        if not _is_exact_partial(placement):
            raise DTensorPlacementError(
                f"cannot initialise a DTensor with placement {placement!r} exactly; "
                "Partial('sum'|'max'|'min') and Shard/Replicate are supported - "
                "initialise a Replicate() or Shard() DTensor instead"
            )
        if placement.reduce_op == "sum" and coordinate[axis] != 0:
            holds = False  # the values live on coordinate 0 of the axis; the rest add zero
    return holds


def record_in_place_draw(t: torch.Tensor) -> None:
    """What torch makes of an in-place draw into ``t``, before values are written under no_grad:
    a leaf that requires grad (or its view), an inference tensor outside inference mode and a
    tensor whose elements share memory (an expand) raise torch's own error; outside no_grad,
    anything else records a write that gives its old value no gradient. Call once the arguments
    are checked, before anything is drawn (torch draws an inference tensor's values first)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if torch.is_grad_enabled() and t.requires_grad:
        t.zero_()  # (autograd refuses a leaf before the kernel writes)
    elif local.is_inference() and not torch.is_inference_mode_enabled():
        local.as_strided((0,), (1,)).zero_()  # torch's error, raised after a write: of nothing
    if elements_share_memory(local):
        # torch's overlap error, from a tensor of the same strides (storage: the few elements
        # the strides reach)
        torch.empty_strided(local.shape, local.stride(), dtype=local.dtype).add_(0)


def fill_from_full(t: object, draw: Callable[[torch.Tensor], Any]) -> DTensor:
    """Fill the DTensor ``t`` in place with its part of ``draw(full)``, a draw on the whole
    logical tensor (every rank draws all of it: torch's CPU and CUDA draws depend on the full
    tensor's size and order), so the generator ends where the full draw leaves it."""
    t = require_dtensor("tensor", t)
    index = local_index_of(t)
    holds = holds_values(t)
    with torch.no_grad():
        local = t.to_local()  # (local shape of t), the DTensor's own storage
        # t's global strides: torch draws in memory order, so a transposed t draws as a
        # transposed plain tensor does.
        full = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=local.device)
        draw(full)
        piece = full
        for dim, idx in enumerate(index.indices):
            if idx != tuple(range(full.shape[dim])):
                keep = torch.tensor(idx, dtype=torch.int64, device=full.device)
                piece = piece.index_select(dim, keep)
        if holds:
            local.copy_(piece)
        else:
            local.zero_()
    return t
