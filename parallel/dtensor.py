"""Layout-invariant random ops on DTensors: dropout, bias_dropout_add, uniform_, normal_.

Each op computes, on every rank, exactly its part of the op on the full logical tensor,
with the generator state the full op would see, and leaves the generator where the full
op leaves it. So ``result.full_tensor()`` is bitwise the same for any mesh and any
placements (Shard, _StridedShard, Replicate, Partial; even or uneven splits), as long as
every rank of the mesh starts from the same generator state (the replicated stream). Keyed
(``seed=``/``site=``), dropout draws nothing: the mask is a pure function of the seed words and
the global index; ``region_of(x)`` gives the ``Region`` of a rank's local tensor for the kernels.

To route torch's own dropout and init calls (``nn.Dropout``, ``nn.init``) through these ops and
kernels without editing a model, see :mod:`rng_tracker.parallel.invariant`. docs/dtensor.md has
the details and the torch internals this relies on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from rng_tracker._batch_position import BatchPosition, fitting
from rng_tracker._collective import all_gather_json, state_digest
from rng_tracker._deprecation import deprecated_names
from rng_tracker._device_rng import default_generator
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._validate import checked_dim, checked_flag, checked_instance
from rng_tracker.errors import (
    BatchPositionError,
    BatchPositionTypeError,
    DTensorPlacementError,
    KernelInputError,
    KeyedTypeError,
    RNGConsistencyError,
)
from rng_tracker.kernels import IndexMap, Region
from rng_tracker.kernels import bias_dropout_add as _kernel_bias_dropout_add
from rng_tracker.kernels import dropout as _kernel_dropout
from rng_tracker.kernels._fused_dropout import check_writable_in_place
from rng_tracker.kernels._keyed_fill import check_normal, check_uniform
from rng_tracker.kernels._rng_source import check_generator
from rng_tracker.kernels.reference import check_p
from rng_tracker.parallel._placement import (
    LocalIndex,
    Span,
    fill_from_full,
    in_global_batch,
    local_index_of,
    record_in_place_draw,
    require_dtensor,
    without_partial,
    wrap_local,
    write_in_place,
)

__all__ = [
    "assert_same_generator_state",
    "bias_dropout_add",
    "dropout",
    "normal_",
    "region_of",
    "uniform_",
]

_MIN_TORCH = (2, 5)  # public torch.distributed.tensor, _StridedShard
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < _MIN_TORCH:
    raise ImportError(
        f"rng_tracker.parallel.dtensor needs torch >= {'.'.join(map(str, _MIN_TORCH))}, "
        f"found {torch.__version__}"
    )


def _clone(generator: torch.Generator) -> torch.Generator:
    clone = torch.Generator(device=generator.device)
    clone.set_state(generator.get_state())
    return clone


def _last_dim_spans(region: Region, shape: tuple[int, ...]) -> tuple[Span, ...]:
    """Global indices along the last dim of a box of ``shape`` at ``region`` (a 0-d tensor has
    no last dim, and no bias: its one element)."""
    if not shape:
        return ((0, 1),)
    return ((region.offset[-1], shape[-1]),)


def _assemble(pieces: list[torch.Tensor], counts: list[int], dim: int = 0) -> torch.Tensor:
    """Concatenate row-major pieces of a grid with ``counts`` pieces per dim."""
    if dim == len(counts):
        return pieces[0]
    step = math.prod(counts[dim + 1 :])
    rows = [
        _assemble(pieces[i * step : (i + 1) * step], counts, dim + 1) for i in range(counts[dim])
    ]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=dim)


# op(part of the local tensor, global last-dim indices of that part, shard=, generator=)
_KernelCall = Callable[
    [tuple[slice, ...], tuple[Span, ...], Region | IndexMap, torch.Generator | None], torch.Tensor
]


def _run_kernel(local: torch.Tensor, index: LocalIndex, op: _KernelCall) -> torch.Tensor:
    """The kernel over this rank's part of the logical tensor, from one generator state.

    A box (every Shard/Replicate placement) is one call with a Region; an even strided shard
    one call with its affine IndexMap. Otherwise (uneven strided shards) one call per box,
    each from a clone of the generator, which then takes the state the clones end in:
    what one call over the logical tensor leaves.
    """
    shape = index.global_shape
    whole = (slice(None),) * local.dim()
    box = index.box()
    if box is not None:
        return op(whole, _last_dim_spans(box, local.shape), box, None)
    affine = index.affine()
    if affine is not None:
        index_map = IndexMap(offset=affine[0], dims=affine[1], logical_numel=math.prod(shape))
        return op(whole, index.last_dim_spans(), index_map, None)
    generator = default_generator(local.device)
    pieces, end = [], None
    for slices, region in index.boxes():
        clone = _clone(generator)
        part_shape = tuple(s.stop - s.start for s in slices)
        pieces.append(op(slices, _last_dim_spans(region, part_shape), region, clone))
        end = clone.get_state()
    generator.set_state(end)
    return _assemble(pieces, [len(index.runs(d)) for d in range(len(shape))])


def region_of(x: DTensor) -> Region:
    """Where this rank's local tensor of ``x`` sits in the logical tensor, as a kernels ``Region``.

    For keyed (or any explicit) dropout on ``x.to_local()`` with ``rng_tracker.kernels``: no
    torch private call needed. Every Shard/Replicate layout is one box; a DTensor whose local
    tensor is several boxes (uneven ``_StridedShard``) or a partial sum (``Partial``) raises
    :class:`DTensorPlacementError` - use :func:`dropout` with ``seed=`` or ``site=`` there.
    """
    require_dtensor("x", x)
    if any(isinstance(p, Partial) for p in x.placements):
        raise DTensorPlacementError(
            f"x has placements {x.placements}: its local tensor is a partial sum, not its values; "
            "redistribute the Partial axes to Replicate() first (dtensor.dropout does that)"
        )
    index = local_index_of(x)
    box = index.box()
    if box is None:
        raise DTensorPlacementError(
            f"this rank's local tensor of x (placements {x.placements}) is "
            f"{len(index.boxes())} boxes of the logical tensor, not one Region; call "
            "rng_tracker.parallel.dtensor.dropout(x, p, seed=...) instead, which handles strided "
            "shards"
        )
    return box


def _keyed_seed(x: DTensor, seed: torch.Tensor | None, site: str | None) -> torch.Tensor | None:
    """The seed words of a keyed call: ``seed`` itself, or keyed site ``site``'s at its step."""
    if site is None:
        return seed
    if not isinstance(site, str):
        raise KeyedTypeError(
            f"site must be the name (a str) of a keyed site of get_keyed_rng, got "
            f"{type(site).__name__} {site!r}"
        )
    if seed is not None:
        raise KernelInputError(
            "pass site= (a keyed site of get_keyed_rng) or seed= (its seed words), not both"
        )
    return get_keyed_rng(x.device).seed_tensor(site)


def _batch_of(
    x: DTensor, position: BatchPosition | None, batch_dim: object
) -> tuple[int, BatchPosition] | None:
    """(x's sample dim, where its samples sit in the global batch), checked; None: no position."""
    if position is None:
        return None
    dim = checked_dim(
        batch_dim,
        "batch_dim",
        x.shape,
        type_error=BatchPositionTypeError,
        value_error=BatchPositionError,
    )
    return dim, fitting(position, x.shape[dim])


def _placed_index(x: DTensor, batch: tuple[int, BatchPosition] | None) -> LocalIndex:
    """The place of this rank's local tensor of x in its logical tensor (over the global batch
    where ``batch`` says where x's samples sit)."""
    index = local_index_of(x)
    return index if batch is None else in_global_batch(index, *batch)


def dropout(
    x: DTensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    seed: torch.Tensor | None = None,
    site: str | None = None,
    position: BatchPosition | None = None,
    batch_dim: int = 0,
) -> DTensor:
    """Dropout of a DTensor whose gathered result is ``rng_tracker.kernels.dropout(full, p)``.

    Partial axes are reduced first (the result is Replicate there); other placements are
    kept. Without ``seed``/``site`` every rank draws from its default generator, which must be
    in the same state on all ranks of the mesh, and advances it by the logical element count.
    Keyed: ``site`` (a name registered with ``get_keyed_rng(x.device)``) or ``seed`` (the int64
    words ``[key, base, c2, c3]``, e.g. ``keyed.seed_tensor(site)``) makes the mask a pure
    function of those words and the global index: nothing is drawn from any generator.
    ``position``: x holds those samples of a global batch along ``batch_dim`` (a data-parallel
    rank's, a microbatch's: its mesh does not shard the batch); the mask is then that part of
    the mask of the logical tensor over the whole global batch. ``inplace=True``: the result
    is written into x (a Partial x as an init of it: the values where it holds them, zeros
    elsewhere) and x is returned, as ``torch.nn.functional.dropout(x, p, training, inplace)``.
    """
    require_dtensor("x", x)
    seed = _keyed_seed(x, seed, site)
    batch = _batch_of(x, position, batch_dim)
    inplace = checked_flag(inplace, "inplace")
    if not checked_flag(training, "training") or check_p(p) == 0.0:
        return x  # as torch and the kernel: nothing drawn, x itself
    if inplace:
        check_writable_in_place(x)
    target, x = x, without_partial(x)
    index = _placed_index(x, batch)
    local = x.to_local()  # (local shape of x)

    def call(
        part: tuple[slice, ...],
        last: tuple[Span, ...],
        shard: Region | IndexMap,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if seed is not None:  # keyed: no generator takes part
            return _kernel_dropout(local[part], p, training=training, shard=shard, seed=seed)
        return _kernel_dropout(local[part], p, training=training, shard=shard, generator=generator)

    out = wrap_local(_run_kernel(local, index, call), x)
    return write_in_place(target, out) if inplace else out


def _gathered_bias(bias: DTensor, x: DTensor) -> torch.Tensor:
    """bias whole on every rank; its gradient sums over the mesh axes that shard x."""
    whole = bias.redistribute(bias.device_mesh, [Replicate()] * bias.device_mesh.ndim)
    # Ranks that hold other elements of x add other rows to the bias gradient: Partial there.
    grad_placements = [Replicate() if isinstance(p, Replicate) else Partial() for p in x.placements]
    return whole.to_local(grad_placements=grad_placements)


def bias_dropout_add(
    x: DTensor,
    bias: DTensor | None,
    residual: DTensor,
    p: float,
    training: bool = True,
    *,
    seed: torch.Tensor | None = None,
    site: str | None = None,
    position: BatchPosition | None = None,
    batch_dim: int = 0,
) -> DTensor:
    """``residual + dropout(x + bias)`` on DTensors, gathered equal to the fused kernel on the full tensors.

    ``bias`` (shape ``(x.shape[-1],)``, any placements) is gathered - it is small - and
    sliced to x's last-dim indices; ``residual`` is redistributed to x's placements.
    ``seed``/``site``/``position``: as in :func:`dropout`.
    """
    seed = _keyed_seed(require_dtensor("x", x), seed, site)
    batch = _batch_of(x, position, batch_dim)
    checked_flag(training, "training")
    residual = require_dtensor("residual", residual)
    if bias is not None:
        bias = require_dtensor("bias", bias)
    for name, other in (("residual", residual), ("bias", bias)):
        if other is not None and other.device_mesh != x.device_mesh:
            raise DTensorPlacementError(
                f"{name} lives on mesh {other.device_mesh} but x on {x.device_mesh}; "
                "put them on one mesh"
            )
    # global shapes, the same on every rank: local ones may match on some ranks only
    if residual.shape != x.shape:
        raise DTensorPlacementError(
            f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; give them "
            "the same global shape"
        )
    x = without_partial(x)
    if residual.placements != x.placements:
        residual = residual.redistribute(x.device_mesh, x.placements)
    index = _placed_index(x, batch)
    local = x.to_local()  # (local shape of x)
    local_residual = residual.to_local()  # (local shape of x)
    full_bias = None if bias is None else _gathered_bias(bias, x)  # (hidden,)

    def call(
        part: tuple[slice, ...],
        last: tuple[Span, ...],
        shard: Region | IndexMap,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        part_bias = full_bias
        if full_bias is not None and x.ndim > 0 and full_bias.shape == x.shape[-1:]:
            # (else the kernel names the shape mismatch)
            pieces = [full_bias.narrow(0, first, n) for first, n in last]
            part_bias = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return _kernel_bias_dropout_add(
            local[part],
            part_bias,
            local_residual[part],
            p,
            training=training,
            shard=shard,
            generator=None if seed is not None else generator,
            seed=seed,
        )

    return wrap_local(_run_kernel(local, index, call), x)


def _check_init(t: object, generator: object) -> DTensor:
    """``t`` itself after the checks of an init op's arguments, made before anything is drawn."""
    t = require_dtensor("tensor", t)
    if generator is not None:
        check_generator(generator)
    return t


def uniform_(
    t: DTensor, a: float = 0.0, b: float = 1.0, *, generator: torch.Generator | None = None
) -> DTensor:
    """Fill ``t`` in place from U(a, b): its full tensor is what ``full.uniform_(a, b)`` draws.

    Every rank draws the whole logical tensor and keeps its part (a transient full-size
    buffer per rank), so the generator ends where the full draw leaves it. Bounds torch
    refuses (a > b, not finite, past the dtype's range) raise :class:`KernelInputError`.
    """
    check_uniform(a, b, _check_init(t, generator).dtype)
    record_in_place_draw(t)  # Tensor.uniform_'s autograd rules
    return fill_from_full(t, lambda full: full.uniform_(a, b, generator=generator))


def normal_(
    t: DTensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> DTensor:
    """Fill ``t`` in place from N(mean, std²): its full tensor is what ``full.normal_(mean, std)``
    draws. A std torch refuses (< 0, NaN) raises :class:`KernelInputError`."""
    check_normal(mean, std, _check_init(t, generator).dtype)
    record_in_place_draw(t)
    return fill_from_full(t, lambda full: full.normal_(mean, std, generator=generator))


def assert_same_generator_state(
    mesh: DeviceMesh, *, generator: torch.Generator | None = None
) -> None:
    """Raise RNGConsistencyError unless every rank of ``mesh`` holds the same generator state.

    The ops above need it (a replicated stream); this costs one small all-gather per mesh
    axis, so call it at start-up or after suspect code, not per op. ``generator`` defaults
    to the default generator of the mesh's device type.
    """
    checked_instance(mesh, DeviceMesh, "mesh must be a DeviceMesh (e.g. from init_device_mesh)")
    if generator is None:
        generator = default_generator(mesh.device_type)
    else:
        checked_instance(generator, torch.Generator, "generator must be a torch.Generator or None")
    digest = state_digest(generator.get_state())
    for axis in range(mesh.ndim):
        digests = all_gather_json(digest, mesh.get_group(axis))
        if len(set(digests)) > 1:
            name = (mesh.mesh_dim_names or [None] * mesh.ndim)[axis] or f"axis {axis}"
            raise RNGConsistencyError(
                f"the generator state differs across mesh {name} (coordinate "
                f"{mesh.get_coordinate()}): {digests}; seed every rank alike (torch.manual_seed "
                "on all ranks) and draw the same randomness on each before DTensor random ops"
            )


# Names of 0.1 that live in their own module now; they resolve, with a warning, until 0.3.
__getattr__ = deprecated_names(
    __name__,
    {
        **{
            name: f"rng_tracker.parallel.invariant:{name}"
            for name in (
                "InitMode",
                "disable_invariant_random",
                "enable_invariant_random",
                "invariant_random",
            )
        },
        **{
            name: f"rng_tracker.errors:{name}"
            for name in ("InvariantRandomConfigError", "InvariantRandomUnsupportedError")
        },
    },
)
