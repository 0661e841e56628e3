"""Layout-invariant random ops on DTensors: dropout, bias_dropout_add, uniform_, normal_.

Each op computes, on every rank, exactly its part of the op on the full logical tensor,
with the generator state the full op would see, and leaves the generator where the full
op leaves it. So ``result.full_tensor()`` is bitwise the same for any mesh and any
placements (Shard, _StridedShard, Replicate, Partial; even or uneven splits), as long as
every rank of the mesh starts from the same generator state (the replicated stream). Keyed
(``seed=``/``site=``), dropout draws nothing: the mask is a pure function of the seed words and
the global index; ``region_of(x)`` gives the ``Region`` of a rank's local tensor for the kernels.

``invariant_random()`` routes torch's dropout and init calls on plain tensors and DTensors
alike through these ops and the same kernels, so a single-device run draws what any mesh
draws, and a model parallelized with ``parallelize_module`` (or torchtitan) gets them
without an edit; ``init="keyed"`` computes each rank's shard of a parameter from (seed, name,
index) alone. See docs/dtensor.md for the routed calls and the torch internals this relies on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.overrides import TorchFunctionMode

from rng_tracker._collective import all_gather_json, state_digest
from rng_tracker._device_rng import default_generator
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._torch_private import (
    correct_fan,
    is_innermost_function_mode,
    set_trunc_normal_impl,
    trunc_normal_impl,
)
from rng_tracker.errors import (
    DTensorInputTypeError,
    DTensorPlacementError,
    InvariantRandomConfigError,
    InvariantRandomModeError,
    InvariantRandomUnsupportedError,
    KernelInputError,
    RNGConsistencyError,
)
from rng_tracker.kernels import IndexMap, Region
from rng_tracker.kernels import bias_dropout_add as _kernel_bias_dropout_add
from rng_tracker.kernels import dropout as _kernel_dropout
from rng_tracker.kernels._fused_dropout import check_p as _check_p
from rng_tracker.kernels.reference import keep_scale
from rng_tracker.parallel._placement import LocalIndex, local_index_of
from rng_tracker.parallel.keyed_init import (
    KeyedInit,
    keyed_normal_,
    keyed_trunc_normal_,
    keyed_uniform_,
)

__all__ = [
    "InitMode",
    "assert_same_generator_state",
    "bias_dropout_add",
    "disable_invariant_random",
    "dropout",
    "enable_invariant_random",
    "invariant_random",
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


def _require_dtensor(name: str, x: object) -> DTensor:
    if not isinstance(x, DTensor):
        raise DTensorInputTypeError(
            f"{name} must be a DTensor, got {type(x).__name__}; for a plain local shard use "
            "rng_tracker.kernels.dropout(x, p, shard=Region(...))"
        )
    return x


def _without_partial(x: DTensor) -> DTensor:
    """x with every Partial axis reduced (dropout is not linear: reduce, then drop)."""
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    placements = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
    return x.redistribute(x.device_mesh, placements)


def _clone(generator: torch.Generator) -> torch.Generator:
    clone = torch.Generator(device=generator.device)
    clone.set_state(generator.get_state())
    return clone


def _last_dim_indices(slices: tuple[slice, ...], region: Region) -> range:
    """Global indices along the last dim of the box that ``slices`` cut from the local tensor."""
    return range(region.offset[-1], region.offset[-1] + slices[-1].stop - slices[-1].start)


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
    [tuple[slice, ...], Sequence[int], Region | IndexMap, torch.Generator | None], torch.Tensor
]


def _run_kernel(local: torch.Tensor, index: LocalIndex, op: _KernelCall) -> torch.Tensor:
    """The kernel over this rank's part of the logical tensor, from one generator state.

    A box (every Shard/Replicate placement) is one call with a Region; an even strided shard
    one call with its affine IndexMap. Otherwise (uneven strided shards) one call per box,
    each from a clone of the generator, which then takes the state the clones end in:
    what one call over the logical tensor leaves.
    """
    boxes = index.boxes()
    shape = index.global_shape
    whole = (slice(None),) * local.dim()
    if len(boxes) == 1:
        return op(whole, _last_dim_indices(*boxes[0]), boxes[0][1], None)
    affine = index.affine()
    if affine is not None:
        index_map = IndexMap(offset=affine[0], dims=affine[1], logical_numel=math.prod(shape))
        return op(whole, index.indices[-1], index_map, None)
    generator = default_generator(local.device)
    pieces, end = [], None
    for slices, region in boxes:
        clone = _clone(generator)
        pieces.append(op(slices, _last_dim_indices(slices, region), region, clone))
        end = clone.get_state()
    generator.set_state(end)
    return _assemble(pieces, [len(index.runs(d)) for d in range(len(shape))])


def _wrap(local: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def region_of(x: DTensor) -> Region:
    """Where this rank's local tensor of ``x`` sits in the logical tensor, as a kernels ``Region``.

    For keyed (or any explicit) dropout on ``x.to_local()`` with ``rng_tracker.kernels``: no
    torch private call needed. Every Shard/Replicate layout is one box; a DTensor whose local
    tensor is several boxes (uneven ``_StridedShard``) or a partial sum (``Partial``) raises
    :class:`DTensorPlacementError` - use :func:`dropout` with ``seed=`` or ``site=`` there.
    """
    _require_dtensor("x", x)
    if any(isinstance(p, Partial) for p in x.placements):
        raise DTensorPlacementError(
            f"x has placements {x.placements}: its local tensor is a partial sum, not its values; "
            "redistribute the Partial axes to Replicate() first (dtensor.dropout does that)"
        )
    boxes = local_index_of(x).boxes()
    if len(boxes) != 1:
        raise DTensorPlacementError(
            f"this rank's local tensor of x (placements {x.placements}) is {len(boxes)} boxes of "
            "the logical tensor, not one Region; call rng_tracker.parallel.dtensor.dropout(x, p, "
            "seed=...) instead, which handles strided shards"
        )
    return boxes[0][1]


def _keyed_seed(x: DTensor, seed: torch.Tensor | None, site: str | None) -> torch.Tensor | None:
    """The seed words of a keyed call: ``seed`` itself, or keyed site ``site``'s at its step."""
    if site is None:
        return seed
    if seed is not None:
        raise KernelInputError(
            "pass site= (a keyed site of get_keyed_rng) or seed= (its seed words), not both"
        )
    return get_keyed_rng(x.device).seed_tensor(site)


def dropout(
    x: DTensor,
    p: float,
    *,
    training: bool = True,
    seed: torch.Tensor | None = None,
    site: str | None = None,
) -> DTensor:
    """Dropout of a DTensor whose gathered result is ``rng_tracker.kernels.dropout(full, p)``.

    Partial axes are reduced first (the result is Replicate there); other placements are
    kept. Without ``seed``/``site`` every rank draws from its default generator, which must be
    in the same state on all ranks of the mesh, and advances it by the logical element count.
    Keyed: ``site`` (a name registered with ``get_keyed_rng(x.device)``) or ``seed`` (the int64
    words ``[key, base, c2, c3]``, e.g. ``keyed.seed_tensor(site)``) makes the mask a pure
    function of those words and the global index: nothing is drawn from any generator.
    """
    _require_dtensor("x", x)
    seed = _keyed_seed(x, seed, site)
    if not training or _check_p(p) == 0.0:
        return x  # as torch and the kernel: nothing drawn, x itself
    x = _without_partial(x)
    index = local_index_of(x)
    local = x.to_local()  # (local shape of x)

    def call(
        part: tuple[slice, ...],
        last: Sequence[int],
        shard: Region | IndexMap,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if seed is not None:  # keyed: no generator takes part
            return _kernel_dropout(local[part], p, training=training, shard=shard, seed=seed)
        return _kernel_dropout(local[part], p, training=training, shard=shard, generator=generator)

    return _wrap(_run_kernel(local, index, call), x)


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
    *,
    training: bool = True,
    seed: torch.Tensor | None = None,
    site: str | None = None,
) -> DTensor:
    """``residual + dropout(x + bias)`` on DTensors, gathered equal to the fused kernel on the full tensors.

    ``bias`` (shape ``(x.shape[-1],)``, any placements) is gathered - it is small - and
    sliced to x's last-dim indices; ``residual`` is redistributed to x's placements.
    ``seed``/``site``: keyed, as in :func:`dropout`.
    """
    seed = _keyed_seed(_require_dtensor("x", x), seed, site)
    x = _without_partial(x)
    residual = _require_dtensor("residual", residual)
    if bias is not None:
        bias = _require_dtensor("bias", bias)
    for name, other in (("residual", residual), ("bias", bias)):
        if other is not None and other.device_mesh != x.device_mesh:
            raise DTensorPlacementError(
                f"{name} lives on mesh {other.device_mesh} but x on {x.device_mesh}; "
                "put them on one mesh"
            )
    if residual.placements != x.placements:
        residual = residual.redistribute(x.device_mesh, x.placements)
    index = local_index_of(x)
    local = x.to_local()  # (local shape of x)
    local_residual = residual.to_local()  # (local shape of x)
    if local_residual.shape != local.shape:
        raise DTensorPlacementError(
            f"residual has local shape {tuple(local_residual.shape)} but x has "
            f"{tuple(local.shape)} after redistribution; give them the same global shape"
        )
    full_bias = None if bias is None else _gathered_bias(bias, x)  # (hidden,)

    def call(
        part: tuple[slice, ...],
        last: Sequence[int],
        shard: Region | IndexMap,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        part_bias = full_bias
        if full_bias is not None and x.ndim > 0 and full_bias.shape == x.shape[-1:]:
            if isinstance(last, range):  # (else the kernel names the shape mismatch)
                part_bias = full_bias.narrow(0, last.start, len(last))
            else:
                keep = torch.tensor(last, dtype=torch.int64, device=full_bias.device)
                part_bias = full_bias.index_select(0, keep)
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

    return _wrap(_run_kernel(local, index, call), x)


def _partial_fill(t: DTensor) -> bool:
    """Whether this rank holds the values (True) or zeros (False) of a Partial init."""
    holds = True
    coordinate = t.device_mesh.get_coordinate()
    for axis, placement in enumerate(t.placements):
        if not isinstance(placement, Partial):
            continue
        if type(placement) is not Partial or placement.reduce_op not in ("sum", "max", "min"):
            raise DTensorPlacementError(
                f"cannot initialise a DTensor with placement {placement!r} exactly; "
                "Partial('sum'|'max'|'min') and Shard/Replicate are supported - "
                "initialise a Replicate() or Shard() DTensor instead"
            )
        if placement.reduce_op == "sum" and coordinate[axis] != 0:
            holds = False  # the values live on coordinate 0 of the axis; the rest add zero
    return holds


def _init_(t: object, draw: Callable[[torch.Tensor], Any]) -> DTensor:
    t = _require_dtensor("tensor", t)
    index = local_index_of(t)
    holds = _partial_fill(t)
    with torch.no_grad():
        local = t.to_local()  # (local shape of t), the DTensor's own storage
        # Drawn whole: torch's CPU and CUDA draws depend on the full tensor's size and order.
        full = torch.empty(t.shape, dtype=t.dtype, device=local.device)
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


def uniform_(
    t: DTensor, a: float = 0.0, b: float = 1.0, *, generator: torch.Generator | None = None
) -> DTensor:
    """Fill ``t`` in place from U(a, b): its full tensor is what ``full.uniform_(a, b)`` draws.

    Every rank draws the whole logical tensor and keeps its part (a transient full-size
    buffer per rank), so the generator ends where the full draw leaves it.
    """
    return _init_(t, lambda full: full.uniform_(a, b, generator=generator))


def normal_(
    t: DTensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> DTensor:
    """Fill ``t`` in place from N(mean, std²): its full tensor is what ``full.normal_(mean, std)`` draws."""
    return _init_(t, lambda full: full.normal_(mean, std, generator=generator))


def assert_same_generator_state(
    mesh: DeviceMesh, *, generator: torch.Generator | None = None
) -> None:
    """Raise RNGConsistencyError unless every rank of ``mesh`` holds the same generator state.

    The ops above need it (a replicated stream); this costs one small all-gather per mesh
    axis, so call it at start-up or after suspect code, not per op. ``generator`` defaults
    to the default generator of the mesh's device type.
    """
    if generator is None:
        generator = default_generator(mesh.device_type)
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


# --- routing torch's own calls -------------------------------------------------------

InitMode = Literal["full", "keyed"]
_INIT_MODES = ("full", "keyed")


def _drop(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout of a DTensor or a plain tensor: the same kernel, so one device equals any mesh."""
    if isinstance(x, DTensor):
        return dropout(x, p, training=training)
    return _kernel_dropout(x, p, training=training)


def _keep(x: torch.Tensor, p: float) -> torch.Tensor:
    """The keep mask (bool, x's shape and placements) dropout(x, p) would draw."""
    if isinstance(x, DTensor):
        x = _without_partial(x)
        ones = _wrap(torch.ones(x.to_local().shape, device=x.device), x)
        return dropout(ones, p) != 0
    return _kernel_dropout(torch.ones(x.shape, device=x.device), p) != 0


def _inplace(input: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace and out is not input:
        return input.copy_(out)
    return out


def _f_dropout(
    ctx: _InvariantRandomMode,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    return _inplace(input, _drop(input, p, training), inplace)


def _torch_dropout(
    ctx: _InvariantRandomMode, input: torch.Tensor, p: float, train: bool
) -> torch.Tensor:
    return _drop(input, p, train)


_ALPHA = 1.7580993408473766  # SELU's alpha: alpha dropout keeps mean 0 and variance 1


def _alpha(input: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """torch's alpha-dropout arithmetic on our keep mask."""
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    noise = keep.to(input.dtype)
    bias = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
    return input * (noise * a) + bias


def _feature_keep(func: Any, input: torch.Tensor, p: float) -> torch.Tensor:
    """The per-(sample, channel) keep mask of a feature dropout, broadcastable to ``input``.

    Drawn on the logical (N, C) tensor by every rank alike, then cut to this rank's part.
    """
    batched = input.dim() > _FEATURE_UNBATCHED_DIMS.get(func, 0)
    features = 2 if batched else 1
    shape = tuple(input.shape[:features])
    keep = _kernel_dropout(torch.ones(shape, device=input.device), p) != 0  # (N, C) or (C,)
    if isinstance(input, DTensor):
        index = local_index_of(input)
        for dim in range(features):
            if index.indices[dim] != tuple(range(shape[dim])):
                rows = torch.tensor(index.indices[dim], dtype=torch.int64, device=keep.device)
                keep = keep.index_select(dim, rows)
    return keep.reshape(keep.shape + (1,) * (input.dim() - features))


def _feature(alpha: bool) -> Callable[..., torch.Tensor]:
    def route(
        ctx: _InvariantRandomMode,
        input: torch.Tensor,
        p: float = 0.5,
        training: bool = not alpha,
        inplace: bool = False,
        *,
        _func: Any = None,
    ) -> torch.Tensor:
        p = _check_p(p)
        if not training or p == 0.0:
            return input
        if alpha and p == 1.0:
            return _inplace(input, input.mul(0.0), inplace)
        x = _without_partial(input) if isinstance(input, DTensor) else input
        local = x.to_local() if isinstance(x, DTensor) else x  # (local shape of x)
        keep = _feature_keep(_func, x, p)
        out = _alpha(local, keep, p) if alpha else local * (keep.to(local.dtype) * keep_scale(p))
        result = _wrap(out, x) if isinstance(x, DTensor) else out
        return _inplace(input, result, inplace)

    return route


def _alpha_dropout(
    ctx: _InvariantRandomMode,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    p = _check_p(p)
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return _inplace(input, input.mul(0.0), inplace)
    x = _without_partial(input) if isinstance(input, DTensor) else input
    keep = _keep(x, p)
    if isinstance(x, DTensor):
        out = _wrap(_alpha(x.to_local(), keep.to_local(), p), x)
    else:
        out = _alpha(x, keep, p)
    return _inplace(input, out, inplace)


def _bernoulli_(
    ctx: _InvariantRandomMode,
    self: torch.Tensor,
    p: float | torch.Tensor = 0.5,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if isinstance(p, torch.Tensor) or generator is not None:
        raise InvariantRandomUnsupportedError(
            "Tensor.bernoulli_ under invariant_random() takes a float p and the default "
            "generator; a tensor of probabilities or a generator= has no layout-invariant "
            "draw here - draw it outside the block, or use a float p"
        )
    keep = _keep(self, 1.0 - _check_p(p))
    with torch.no_grad():
        return self.copy_(keep)


def _init_route(torch_func: Any, kind: str, names: tuple[str, str]) -> Callable[..., Any]:
    """A route for uniform_/normal_: keyed by name in keyed mode, else torch's own draw on the
    full tensor (a DTensor keeps its part; a plain tensor is the full tensor)."""

    def route(ctx: _InvariantRandomMode, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if ctx.keyed is not None and kwargs.get("generator") is None:
            name = ctx.keyed.name_of(tensor)
            values = [0.0, 1.0]  # every one of these four defaults to (0, 1)
            for i, value in enumerate(args[:2]):
                values[i] = value
            for i, key in enumerate(names):
                values[i] = kwargs.get(key, values[i])
            fill = keyed_uniform_ if kind == "uniform" else keyed_normal_
            return fill(tensor, float(values[0]), float(values[1]), name=name, seed=ctx.keyed.seed)
        if isinstance(tensor, DTensor):
            return _init_(tensor, lambda full: torch_func(full, *args, **kwargs))
        return torch_func(tensor, *args, **kwargs)

    return route


def _init_kaiming_uniform(
    ctx: _InvariantRandomMode, tensor: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    # kaiming_uniform_ dispatches as itself, so its inner Tensor.uniform_ would run with the
    # mode off: compute its bound from the global shape here and draw through the routes.
    if ctx.keyed is not None and kwargs.get("generator") is None:
        bound = _kaiming_bound(tensor, *args, **kwargs)
        return _ROUTES[torch.Tensor.uniform_](ctx, tensor, -bound, bound)
    if isinstance(tensor, DTensor):
        return _init_(tensor, lambda full: torch.nn.init.kaiming_uniform_(full, *args, **kwargs))
    return torch.nn.init.kaiming_uniform_(tensor, *args, **kwargs)


def _kaiming_bound(
    tensor: torch.Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    generator: torch.Generator | None = None,
) -> float:
    if 0 in tensor.shape:
        return 0.0
    fan = correct_fan(tensor, mode)
    gain = torch.nn.init.calculate_gain(nonlinearity, a)  # type: ignore[arg-type]
    return math.sqrt(3.0) * gain / math.sqrt(fan)


def _refuse_on_dtensor(name: str) -> Callable[..., Any]:
    def route(ctx: _InvariantRandomMode, *args: Any, **kwargs: Any) -> Any:
        raise InvariantRandomUnsupportedError(
            f"{name} on a DTensor under invariant_random() has no layout-invariant draw (each "
            "shard would draw from the same generator state on its own); draw it on a plain "
            "tensor and distribute it, or leave the block"
        )

    return route


# F.dropout1d/2d/3d and feature_alpha_dropout: inputs of more dims than this carry a batch dim.
_FEATURE_UNBATCHED_DIMS: dict[Any, int] = {
    F.dropout1d: 2,
    F.dropout2d: 2,  # torch treats a 3-D input to dropout2d as batched (N, C, L)
    F.dropout3d: 4,
    F.feature_alpha_dropout: 1,
}


def _bind_feature(func: Any, alpha: bool) -> Callable[..., torch.Tensor]:
    route = _feature(alpha)

    def bound(ctx: _InvariantRandomMode, *args: Any, **kwargs: Any) -> torch.Tensor:
        return route(ctx, *args, _func=func, **kwargs)

    return bound


_ROUTES: dict[Any, Callable[..., Any]] = {
    F.dropout: _f_dropout,
    torch.dropout: _torch_dropout,
    F.dropout1d: _bind_feature(F.dropout1d, alpha=False),
    F.dropout2d: _bind_feature(F.dropout2d, alpha=False),
    F.dropout3d: _bind_feature(F.dropout3d, alpha=False),
    F.alpha_dropout: _alpha_dropout,
    F.feature_alpha_dropout: _bind_feature(F.feature_alpha_dropout, alpha=True),
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.nn.init.uniform_: _init_route(torch.nn.init.uniform_, "uniform", ("a", "b")),
    torch.nn.init.normal_: _init_route(torch.nn.init.normal_, "normal", ("mean", "std")),
    torch.nn.init.kaiming_uniform_: _init_kaiming_uniform,
    torch.Tensor.uniform_: _init_route(torch.Tensor.uniform_, "uniform", ("from", "to")),
    torch.Tensor.normal_: _init_route(torch.Tensor.normal_, "normal", ("mean", "std")),
}

# Random ops with no invariant route: refused on a DTensor; on a plain tensor they run
# torch's own code (a documented pass-through: a tensor that is plain on every layout).
_REFUSED_ON_DTENSOR: dict[Any, str] = {
    torch.Tensor.random_: "Tensor.random_",
    torch.Tensor.exponential_: "Tensor.exponential_",
    torch.Tensor.cauchy_: "Tensor.cauchy_",
    torch.Tensor.log_normal_: "Tensor.log_normal_",
    torch.Tensor.geometric_: "Tensor.geometric_",
    torch.Tensor.bernoulli: "Tensor.bernoulli",
    torch.bernoulli: "torch.bernoulli",
    torch.normal: "torch.normal",
    torch.poisson: "torch.poisson",
    torch.multinomial: "torch.multinomial",
    torch.rand_like: "torch.rand_like",
    torch.randn_like: "torch.randn_like",
    torch.randint_like: "torch.randint_like",
    F.rrelu: "F.rrelu",
    torch.rrelu: "torch.rrelu",
}


def _global_any(x: DTensor) -> DTensor:
    """``x.any()`` over the whole logical tensor, Replicate on every rank.

    torch's ``trunc_normal_`` resamples while ``mask.any()``; on a DTensor that is the local
    shard's answer, so ranks would take different branches and draw different amounts.
    """
    mesh = x.device_mesh
    if any(isinstance(p, Partial) for p in x.placements):
        flag = x.full_tensor().any()
    else:
        count = x.to_local().any().to(torch.int64).reshape(1)
        if mesh.size() == dist.get_world_size():  # one collective over the world
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        else:
            for axis in range(mesh.ndim):
                dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mesh.get_group(axis))
        flag = count[0].bool()
    return DTensor.from_local(flag, mesh, [Replicate()] * mesh.ndim, run_check=False)


# Whole-tensor reductions made global on a DTensor, so data-dependent init loops agree.
_GLOBAL_REDUCTIONS = frozenset({torch.Tensor.any, torch.any})


def _first_tensor(args: tuple, kwargs: dict) -> object:
    return args[0] if args else next(iter(kwargs.values()), None)


# Keyed blocks open in this thread (innermost last); nn.init.trunc_normal_ is routed while any
# thread has one open, and the route draws keyed only for the thread that has.
_KEYED_BLOCKS = threading.local()
_TRUNC_ROUTE_LOCK = threading.Lock()
_TRUNC_ROUTE: dict[str, Any] = {"users": 0, "torch": None}


def _keyed_blocks() -> list[_InvariantRandomMode]:
    if not hasattr(_KEYED_BLOCKS, "modes"):
        _KEYED_BLOCKS.modes = []
    return _KEYED_BLOCKS.modes


def _keyed_trunc_normal(
    tensor: torch.Tensor,
    mean: float,
    std: float,
    a: float,
    b: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """torch's ``_no_grad_trunc_normal_`` inside a keyed block: one keyed inverse-CDF draw per
    element (keyed by the parameter's name, or by its place among the block's draws); a
    ``generator=`` call or invalid bounds run torch's own."""
    blocks = _keyed_blocks()
    keyed = blocks[-1].keyed if blocks else None
    valid = math.isfinite(mean) and math.isfinite(std) and std > 0 and a < b
    if keyed is None or generator is not None or not valid:
        return _TRUNC_ROUTE["torch"](tensor, mean, std, a, b, generator=generator)
    name = keyed.name_of(tensor)
    return keyed_trunc_normal_(tensor, mean, std, a, b, name=name, seed=keyed.seed)


def _open_keyed_block(mode: _InvariantRandomMode) -> None:
    with _TRUNC_ROUTE_LOCK:
        if _TRUNC_ROUTE["users"] == 0:
            torch_impl = trunc_normal_impl()
            if torch_impl is not None:
                _TRUNC_ROUTE["torch"] = torch_impl
                set_trunc_normal_impl(_keyed_trunc_normal)
        _TRUNC_ROUTE["users"] += 1
    _keyed_blocks().append(mode)


def _close_keyed_block(mode: _InvariantRandomMode) -> None:
    blocks = _keyed_blocks()
    if mode in blocks:
        blocks.reverse()
        blocks.remove(mode)  # the innermost entry of this mode
        blocks.reverse()
    with _TRUNC_ROUTE_LOCK:
        _TRUNC_ROUTE["users"] -= 1
        if _TRUNC_ROUTE["users"] == 0 and _TRUNC_ROUTE["torch"] is not None:
            if trunc_normal_impl() is _keyed_trunc_normal:
                set_trunc_normal_impl(_TRUNC_ROUTE["torch"])
            _TRUNC_ROUTE["torch"] = None


class _InvariantRandomMode(TorchFunctionMode):
    """Sends the random ops of _ROUTES, on plain tensors and DTensors alike, to the invariant
    ops; refuses the random ops that have none on a DTensor."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        init: InitMode = "keyed",
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if init not in _INIT_MODES:
            raise InvariantRandomConfigError(
                f"init must be 'keyed' (values keyed by name, computed per shard; the default) or "
                f"'full' (torch's values on the full tensor), got {init!r}"
            )
        if init == "full" and seed is not None:
            raise InvariantRandomConfigError(
                "seed= keys init='keyed' only; init='full' draws from the default generator "
                "(seed it with torch.manual_seed on every rank)"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InvariantRandomConfigError(
                f"model must be an nn.Module or None, got {type(model).__name__}"
            )
        self.init = init
        self.keyed: KeyedInit | None = None
        if init == "keyed":
            self.keyed = KeyedInit(model, torch.initial_seed() if seed is None else seed)

    def __enter__(self) -> _InvariantRandomMode:
        if self.keyed is not None:
            _open_keyed_block(self)
        try:
            return super().__enter__()
        except BaseException:
            if self.keyed is not None:
                _close_keyed_block(self)
            raise

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            if self.keyed is not None:
                _close_keyed_block(self)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None and isinstance(_first_tensor(args, kwargs), torch.Tensor):
            return route(self, *args, **kwargs)
        whole = len(args) == 1 and not kwargs  # any() of the whole tensor, no dim
        if func in _GLOBAL_REDUCTIONS and whole and isinstance(args[0], DTensor):
            return _global_any(args[0])
        if func in _REFUSED_ON_DTENSOR and any(
            isinstance(a, DTensor) for a in (*args, *kwargs.values())
        ):
            return _refuse_on_dtensor(_REFUSED_ON_DTENSOR[func])(self)
        return func(*args, **kwargs)


@contextmanager
def invariant_random(
    model: torch.nn.Module | None = None, *, init: InitMode = "keyed", seed: int | None = None
) -> Iterator[None]:
    """Within the block, dropout and init draw the same values on one device and on any mesh.

    Routes, on plain tensors and DTensors alike: ``F.dropout`` (so ``nn.Dropout``),
    ``torch.dropout``, ``F.dropout1d/2d/3d``, ``F.alpha_dropout``, ``F.feature_alpha_dropout``
    and ``Tensor.bernoulli_`` to the layout-invariant kernel; ``nn.init.uniform_``/``normal_``/
    ``kaiming_uniform_`` and ``Tensor.uniform_``/``normal_`` (so ``xavier_*``,
    ``kaiming_normal_`` and ``trunc_normal_`` too) to the init of ``init``:

    - ``"keyed"`` (default): values a pure function of (``seed``, a name, the element's global
      index); each rank computes only its shard, with no full-size buffer and no collective,
      and nothing is drawn from a generator. The name is the tensor's name in ``model`` when
      given (then also invariant to pipeline splits, init order and meta-device
      materialisation), else its place among the block's init draws (every rank of a mesh
      runs the same init in the same order). ``trunc_normal_`` is one inverse-CDF draw per
      element (torch's resampling loop would need every rank's answer). ``seed`` defaults to
      ``torch.initial_seed()`` when the block is entered: seed first. Not torch's values.
    - ``"full"``: torch's own draw on the full tensor (bitwise a plain single-device torch
      init from the same generator state; each rank draws the whole tensor and holds a
      full-size buffer: for small models that must equal a plain torch run).

    Random ops with no invariant route raise ``InvariantRandomUnsupportedError`` on a DTensor
    and run torch's own code on a plain tensor. Per thread (torch function modes are).
    """
    with _InvariantRandomMode(model, init=init, seed=seed):
        yield


_ENABLED: list[_InvariantRandomMode] = []


def enable_invariant_random(
    model: torch.nn.Module | None = None, *, init: InitMode = "keyed", seed: int | None = None
) -> None:
    """Turn ``invariant_random(...)`` on until ``disable_invariant_random()`` (idempotent:
    a second call while on changes nothing)."""
    if _ENABLED:
        return
    mode = _InvariantRandomMode(model, init=init, seed=seed)
    mode.__enter__()
    _ENABLED.append(mode)


def disable_invariant_random() -> None:
    """Turn off what ``enable_invariant_random()`` turned on (a no-op if it is off)."""
    if not _ENABLED:
        return
    if not is_innermost_function_mode(_ENABLED[0]):
        raise InvariantRandomModeError(
            "another torch function mode was entered after enable_invariant_random() and is "
            "still active; exit it first (modes form a stack)"
        )
    _ENABLED.pop().__exit__(None, None, None)
