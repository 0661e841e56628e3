"""``invariant_random()``: torch's own dropout and init calls drawing the same values on one
device and on any mesh, with no edit to the model.

A torch function mode routes ``F.dropout`` (so ``nn.Dropout``) and its variants and
``nn.init``/``Tensor.uniform_``/``normal_`` on plain tensors and DTensors alike to the
layout-invariant ops of :mod:`rng_tracker.parallel.dtensor` and the same kernels, so a
single-device run draws what any mesh draws, and a model parallelized with
``parallelize_module`` (or torchtitan) gets them without an edit. ``init="keyed"`` (the default)
computes each rank's shard of a parameter from (seed, name, index) alone
(:mod:`rng_tracker.parallel.keyed_init`). ``trunc_normal_``, which bypasses function modes, is
swapped while a block is open: one keyed draw per element, or torch's on the full tensor. See
docs/dtensor.md for the routed calls and the torch internals this relies on.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from rng_tracker._batch_position import (
    ENTER_A_POSITION,
    BatchPosition,
    batch_context,
    box_in_batch,
    required_position,
)
from rng_tracker._checkpointing import in_unreplayed_torch_checkpoint, is_checkpointing
from rng_tracker._torch_private import (
    correct_fan,
    dynamo_allows_no_graph_break,
    dynamo_traced_checkpoint_body,
    is_innermost_function_mode,
    set_trunc_normal_impl,
    torch_reentrant_checkpoint_forward_active,
    trunc_normal_impl,
)
from rng_tracker._validate import checked_int
from rng_tracker.errors import (
    BatchPositionError,
    BatchPositionTypeError,
    InvariantRandomConfigError,
    InvariantRandomConfigTypeError,
    InvariantRandomModeError,
    InvariantRandomUnsupportedError,
    KernelInputError,
    RNGTrackerError,
    UnroutedCheckpointWarning,
)
from rng_tracker.kernels import Region
from rng_tracker.kernels import dropout as _kernel_dropout
from rng_tracker.kernels._call import KERNEL_DTYPES
from rng_tracker.kernels._fused_dropout import check_writable_in_place
from rng_tracker.kernels._keyed_fill import (
    check_normal,
    check_trunc_normal,
    check_uniform,
    real_number,
)
from rng_tracker.kernels.reference import check_p, keep_scale_unchecked
from rng_tracker.parallel._placement import (
    fill_from_full,
    local_index_of,
    record_in_place_draw,
    without_partial,
    wrap_local,
    write_in_place,
)
from rng_tracker.parallel.dtensor import dropout
from rng_tracker.parallel.keyed_init import KeyedInit, check_keyed_fill

__all__ = [
    "InitMode",
    "UnroutedCheckpointWarning",
    "disable_invariant_random",
    "enable_invariant_random",
    "invariant_random",
]

InitMode = Literal["full", "keyed"]
_INIT_MODES = ("full", "keyed")


def _samples(
    ctx: _InvariantRandomMode, x: torch.Tensor, dim: int | None = None
) -> tuple[int, BatchPosition] | None:
    """Where a draw on x (its mask: x's shape) sits in the global batch: (its sample dim, the
    place of its samples), or None where it is the whole batch or a DTensor whose mesh shards
    the sample dim (it holds its place). ``dim``: the sample dim, if not the mode's
    ``batch_dim``."""
    shape = x.shape
    dim = ctx.batch_dim if dim is None else dim
    if not -len(shape) <= dim < len(shape):
        if batch_context().position is not None:
            raise BatchPositionError(
                f"a dropout mask of shape {tuple(shape)} drawn under invariant_random() inside "
                "batch_position(...) has no sample dim, so its place in the global batch is "
                "unknown; draw it outside the batch_position block"
            )
        return None
    dim %= len(shape)
    if isinstance(x, DTensor) and any(
        isinstance(p, Shard) and p.dim % len(shape) == dim for p in x.placements
    ):
        return None
    position = required_position(shape[dim], "a dropout under invariant_random()", ENTER_A_POSITION)
    if position.sample_offset == 0 and position.global_batch == shape[dim]:
        return None
    return dim, position


def _in_batch(shape: Sequence[int], batch: tuple[int, BatchPosition] | None) -> Region | None:
    """The kernels' shard of a plain tensor of ``shape`` whose samples sit at ``batch``."""
    if batch is None:
        return None
    return Region(*box_in_batch(shape, *batch))


def _drop(
    ctx: _InvariantRandomMode, x: torch.Tensor, p: float, training: bool, inplace: bool = False
) -> torch.Tensor:
    """Dropout of a DTensor or a plain tensor: the same kernel, so one device equals any mesh,
    placed in the global batch where the batch position says (``inplace``: written into x,
    refused before the draw where torch would refuse the write)."""
    if not training or p == 0.0:
        return x
    batch = _samples(ctx, x)
    if isinstance(x, DTensor):
        if batch is None:
            return dropout(x, p, training, inplace)
        return dropout(x, p, training, inplace, position=batch[1], batch_dim=batch[0])
    return _kernel_dropout(x, p, training, inplace, shard=_in_batch(x.shape, batch))


def _ones(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Ones to draw a keep mask on: fp32 whatever the default dtype (the kernels take no fp64)."""
    return torch.ones(shape, dtype=torch.float32, device=device)


def _keep(ctx: _InvariantRandomMode, x: torch.Tensor, p: float) -> torch.Tensor:
    """The keep mask (bool, x's shape and placements) dropout(x, p) would draw."""
    if isinstance(x, DTensor):
        x = without_partial(x)
        ones = wrap_local(_ones(x.to_local().shape, x.device), x)
        return _drop(ctx, ones, p, True) != 0
    return _drop(ctx, _ones(x.shape, x.device), p, True) != 0


def _inplace(input: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace and out is not input:
        return write_in_place(input, out)
    return out


def _f_dropout(
    ctx: _InvariantRandomMode,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    if input.dtype not in KERNEL_DTYPES:  # fp64: the kernel's mask, applied in input's dtype
        return _masked_dropout(ctx, input, p, training, inplace)
    return _drop(ctx, input, p, training, inplace)


_ALPHA = 1.7580993408473766  # SELU's alpha: alpha dropout keeps mean 0 and variance 1


def _alpha(input: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """torch's alpha-dropout arithmetic on our keep mask."""
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    noise = keep.to(input.dtype)
    bias = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
    return input * (noise * a) + bias


def _always(dims: int) -> bool:
    return True


def _two_dims_or_more(dims: int) -> bool:
    return dims >= 2


# The feature dropouts, as torch reads an input of n dims: whether it carries a batch dim (the
# mask is per (N, C), else per C), and whether torch takes it without a warning or an error.
_FEATURE_DROPOUTS: dict[Any, tuple[Callable[[int], bool], Callable[[int], bool]]] = {
    F.dropout1d: (lambda dims: dims == 3, lambda dims: dims in (2, 3)),
    F.dropout2d: (_always, lambda dims: dims == 4),  # a 3-D input warns, and is (N, C, L)
    F.dropout3d: (lambda dims: dims == 5, lambda dims: dims in (4, 5)),
    F.feature_alpha_dropout: (_always, _two_dims_or_more),
    torch.feature_dropout: (_always, _two_dims_or_more),
    torch.feature_dropout_: (_always, _two_dims_or_more),
    torch.feature_alpha_dropout: (_always, _two_dims_or_more),
    torch.feature_alpha_dropout_: (_always, _two_dims_or_more),
}


def _torchs_checks(func: Any, input: torch.Tensor, p: float, training: bool) -> None:
    """torch's own errors and warnings of ``func`` for an input of this many dims, from torch's
    code on a meta tensor (nothing drawn); the dims torch takes silently skip it."""
    if not _FEATURE_DROPOUTS[func][1](input.dim()):
        with _torchs_own():
            func(torch.empty(input.shape, device="meta"), p, training)


def _feature_keep(
    func: Any, ctx: _InvariantRandomMode, input: torch.Tensor, p: float
) -> torch.Tensor:
    """The per-(sample, channel) keep mask of a feature dropout, broadcastable to ``input``.

    Drawn on the logical (N, C) tensor by every rank alike (the rows of N in the global batch
    where the batch position says), then cut to this rank's part.
    """
    features = 2 if _FEATURE_DROPOUTS[func][0](input.dim()) else 1
    shape = tuple(input.shape[:features])
    batch = _samples(ctx, input, 0 if features == 2 else input.dim())  # unbatched: no N
    ones = _ones(shape, input.device)
    keep = _kernel_dropout(ones, p, shard=_in_batch(shape, batch)) != 0  # (N, C) or (C,)
    if isinstance(input, DTensor):
        index = local_index_of(input)
        for dim in range(features):
            if index.indices[dim] != tuple(range(shape[dim])):
                rows = torch.tensor(index.indices[dim], dtype=torch.int64, device=keep.device)
                keep = keep.index_select(dim, rows)
    return keep.reshape(keep.shape + (1,) * (input.dim() - features))


def _local_keep(ctx: _InvariantRandomMode, x: torch.Tensor, p: float) -> torch.Tensor:
    """This rank's part of the element keep mask ``dropout(x, p)`` would draw."""
    keep = _keep(ctx, x, p)
    return keep.to_local() if isinstance(keep, DTensor) else keep


def _mask_route(
    alpha: bool,
    keep_of: Callable[[_InvariantRandomMode, torch.Tensor, float], torch.Tensor],
    func: Any = None,
) -> Callable[..., torch.Tensor]:
    """The route of a dropout that applies its keep mask here (alpha and feature dropouts):
    ``keep_of(mode, x, p)`` is this rank's part of the mask, broadcastable to x's local tensor;
    ``func``: the feature dropout whose input rules (:func:`_torchs_checks`) apply."""

    def route(
        ctx: _InvariantRandomMode,
        input: torch.Tensor,
        p: float = 0.5,
        training: bool = not alpha,  # torch's defaults: alpha dropouts are off unless asked
        inplace: bool = False,
    ) -> torch.Tensor:
        p = check_p(p)
        if func is not None:
            _torchs_checks(func, input, p, training)
        if not training or p == 0.0:
            return input
        if alpha and p == 1.0:
            return _inplace(input, input.mul(0.0), inplace)
        if inplace:
            check_writable_in_place(input)
        x = without_partial(input) if isinstance(input, DTensor) else input
        local = x.to_local() if isinstance(x, DTensor) else x  # (local shape of x)
        keep = keep_of(ctx, x, p)
        if alpha:
            out = _alpha(local, keep, p)
        elif local.dtype == torch.float64:  # torch's arithmetic: the kernels' scale is fp32
            out = local * keep.to(local.dtype).div_(1.0 - p)
        else:
            out = local * (keep.to(local.dtype) * keep_scale_unchecked(p))
        return _inplace(input, wrap_local(out, x) if isinstance(x, DTensor) else out, inplace)

    return route


_masked_dropout = _mask_route(False, _local_keep)


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
    try:
        p = check_p(p)
    except RNGTrackerError:
        _raise_torchs_refusal(lambda probe: probe.bernoulli_(p), self)
        raise
    _samples(ctx, self)  # a bad batch placement is refused before self is touched
    record_in_place_draw(self)
    keep = _keep(ctx, self, 1.0 - p)
    with torch.no_grad():
        return write_in_place(self, keep)


_REQUIRED = object()

# Each routed dropout's p and training as torch takes them: p's default, training's name and
# default (_REQUIRED: no default).
_DROPOUT_ARGUMENTS: dict[Any, tuple[object, str, object]] = {
    **dict.fromkeys((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d), (0.5, "training", True)),
    **dict.fromkeys((F.alpha_dropout, F.feature_alpha_dropout), (0.5, "training", False)),
    **dict.fromkeys(
        (
            torch.dropout,
            torch.dropout_,
            torch.alpha_dropout,
            torch.alpha_dropout_,
            torch.feature_dropout,
            torch.feature_dropout_,
            torch.feature_alpha_dropout,
            torch.feature_alpha_dropout_,
        ),
        (_REQUIRED, "train", _REQUIRED),
    ),
}
_DRAW = object()
_MASK_DRAWS = frozenset((*_DROPOUT_ARGUMENTS, torch.Tensor.bernoulli_))


def _refuse_in_torchs_checkpoint(func: Any) -> None:
    """Refuse a mask drawn in a forward of torch's own checkpoint: its recompute runs where the
    mode is not (autograd's engine drops function modes), so it would draw torch's masks there
    and the gradients would silently be another mask's. rng_tracker's checkpoints (and torch's
    with ``context_fn=rng_context_fn()``) enter the mode again around their recompute."""
    reentrant = not is_checkpointing() and torch_reentrant_checkpoint_forward_active()
    if not (reentrant or in_unreplayed_torch_checkpoint()):
        return
    raise InvariantRandomUnsupportedError(
        f"{getattr(func, '__name__', func)} under invariant_random() inside "
        "torch.utils.checkpoint: torch's recompute runs without the mode, so it would draw "
        "another mask than this forward and the gradients would be wrong. Checkpoint with "
        "rng_tracker.checkpoint (e.g. checkpoint_wrapper(module, checkpoint_fn="
        "rng_tracker.checkpoint)), or pass context_fn=rng_tracker.rng_context_fn() to torch's"
    )


# torch.utils.checkpoint as Dynamo traces it: a higher-order op, which reaches the mode as one
# call, so its body is traced with the mode popped (torch 2.13). None where torch has none.
_TORCH_CHECKPOINT_UNDER_COMPILE = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


@torch.compiler.assume_constant_result
def _warn_unrouted_checkpoint() -> bool:
    """Warn (run while Dynamo traces, so no graph break) that the checkpoint's body is not routed,
    unless its traced graph has no call the mode routes or refuses (a body that draws nothing,
    as a torchtitan block without dropout). A body Dynamo does not show is taken to draw."""
    body = dynamo_traced_checkpoint_body()
    if body is not None and not _may_draw(body):
        return True
    way_out = (
        # rng_tracker.checkpoint runs eagerly, a graph break fullgraph refuses
        "Draw with keyed sites (rng_tracker.parallel.sites.site_dropout(..., rng_mode='keyed')), "
        "layout-invariant too, which compile whole inside torch's checkpoint"
        if dynamo_allows_no_graph_break()
        else "Checkpoint with rng_tracker.checkpoint (checkpoint_wrapper(module, checkpoint_fn="
        "rng_tracker.checkpoint)), which keeps the mode"
    )
    warnings.warn(
        "torch.compile traced torch.utils.checkpoint under invariant_random(): Dynamo traces the "
        "checkpoint's body without the mode (torch 2.13), so a dropout or init inside it draws "
        f"torch's values, not the layout-invariant ones, and is not refused as in eager. {way_out}",
        UnroutedCheckpointWarning,
        stacklevel=1,  # no line of the caller's is on the stack while Dynamo traces
    )
    return True


def _may_draw(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a traced graph (with the subgraphs it holds) calls something the mode routes or
    refuses on a DTensor; a submodule call it cannot see into counts as a draw."""
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            return True
        if node.op == "call_function" and _draws_or_refused(node.target):
            return True
        if node.op == "call_method" and _draws_or_refused(getattr(torch.Tensor, node.target, None)):
            return True
    return any(
        _may_draw(child)
        for child in graph_module.children()
        if isinstance(child, torch.fx.GraphModule)
    )


def _draws_or_refused(target: object) -> bool:
    try:
        return target in _ROUTES or target in _REFUSED_ON_DTENSOR
    except TypeError:  # an unhashable target is none of them
        return False


@torch.compiler.disable(
    reason="invariant_random's dropout draws from a generator and checks for torch's checkpoint, "
    "neither traceable: one graph break per call; keyed sites (rng_mode='keyed') compile whole"
)
def _draw_untraced(
    mode: _InvariantRandomMode, route: Callable[..., Any], func: Any, args: tuple, kwargs: dict
) -> Any:
    """A routed mask draw under torch.compile, as one untraced step: the check for torch's
    checkpoint reads saved-tensor hooks and the draw reads a generator, neither traceable, so
    together they are one graph break per call, not two (and Dynamo's warning on the hooks is
    not raised). The check runs each time the compiled code runs, as it must."""
    _refuse_in_torchs_checkpoint(func)
    return route(mode, *args, **kwargs)


def _torchs_answer(func: Any, args: tuple, kwargs: dict) -> Any:
    """torch's own answer to a dropout call the routes need not draw, else ``_DRAW``: where it
    draws nothing (training off, p == 0 or 1: torch's result, for any dtype and aliasing as
    torch aliases) or where torch refuses the call (its own error, for p and dtype alike)."""
    p_default, training_name, training_default = _DROPOUT_ARGUMENTS[func]
    input = _first_tensor(args, kwargs)
    p = _argument(args, kwargs, 1, "p", p_default)
    training = _argument(args, kwargs, 2, training_name, training_default)
    if p is _REQUIRED or training is _REQUIRED:  # torch's TypeError, before anything is drawn
        with _torchs_own():
            return func(*args, **kwargs)

    def raise_torchs_refusal() -> None:  # p as it is then: the caller's, or the checked one
        _raise_torchs_refusal(lambda probe: func(probe, p, training), input)

    try:
        p = check_p(p)
    except RNGTrackerError:
        raise_torchs_refusal()
        raise
    if training is False or p in (0.0, 1.0):  # torch draws nothing: x, or x * 0
        with _torchs_own():
            return func(*args, **kwargs)
    if not input.dtype.is_floating_point:
        raise_torchs_refusal()
        raise InvariantRandomUnsupportedError(
            f"{getattr(func, '__name__', func)} of a {input.dtype} tensor has no "
            "layout-invariant draw under invariant_random(): the masks are drawn for floating "
            "tensors; cast it, or leave the block"
        )
    return _DRAW


def _raise_torchs_refusal(call: Callable[[torch.Tensor], Any], input: torch.Tensor) -> None:
    """Raise torch's own error for ``call`` on a tensor like ``input`` (its dtype and number of
    dims, one element, on the CPU): torch's code runs, its CPU generator restored, so nothing is
    drawn; returns where torch takes the call."""
    probe = torch.zeros((1,) * input.dim(), dtype=input.dtype)
    with torch.random.fork_rng(devices=[]), _torchs_own():
        call(probe)


# Per thread: > 0 while a route runs torch's own init. Calls made inside a mode's handler reach
# the next mode out, so an enclosing invariant_random block would draw them keyed instead.
_TORCHS_OWN = threading.local()


@contextmanager
def _torchs_own() -> Iterator[None]:
    """Within the block, every invariant_random mode of this thread passes calls through."""
    depth = getattr(_TORCHS_OWN, "depth", 0)
    _TORCHS_OWN.depth = depth + 1
    try:
        yield
    finally:
        _TORCHS_OWN.depth = depth


def _torch_draw(torch_func: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """torch's own ``torch_func`` on ``tensor``: on the full tensor for a DTensor (every rank
    draws all of it and keeps its part), as is for a plain tensor."""
    with _torchs_own():
        if isinstance(tensor, DTensor):
            return fill_from_full(tensor, lambda full: torch_func(full, *args, **kwargs))
        return torch_func(tensor, *args, **kwargs)


def _init_route(
    torch_func: Any, kind: str, names: tuple[str, str], *, recorded: bool = False
) -> Callable[..., Any]:
    """A route for uniform_/normal_: keyed by name in keyed mode, else torch's own draw on the
    full tensor (a DTensor keeps its part; a plain tensor is the full tensor). ``recorded``: the
    Tensor methods, which autograd records where grad is enabled (nn.init's run under no_grad)."""

    def route(ctx: _InvariantRandomMode, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        values = [0.0, 1.0]  # every one of these four defaults to (0, 1)
        for i, value in enumerate(args[:2]):
            values[i] = value
        for i, key in enumerate(names):
            values[i] = kwargs.get(key, values[i])
        low, high = (real_number(v, key) for v, key in zip(values, names, strict=True))
        keyed = ctx.keyed is not None and kwargs.get("generator") is None
        if not keyed:
            _TORCH_CHECKS[kind](low, high, tensor.dtype)  # torch's own rules, as typed errors
        if recorded:
            if keyed:  # the fill checks its arguments itself, but after this write: check first
                check_keyed_fill(tensor, kind, low, high)
            record_in_place_draw(tensor)
        if keyed:
            return ctx.keyed.fill(tensor, kind, low, high)
        return _torch_draw(torch_func, tensor, *args, **kwargs)

    return route


_TORCH_CHECKS = {"uniform": check_uniform, "normal": check_normal}


def _init_kaiming_uniform(
    ctx: _InvariantRandomMode, tensor: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    # kaiming_uniform_ dispatches as itself, so its inner Tensor.uniform_ would run with the
    # mode off: compute its bound from the global shape here and draw through the routes.
    if ctx.keyed is not None and kwargs.get("generator") is None:
        bound = _kaiming_bound(tensor, *args, **kwargs)
        return _ROUTES[torch.nn.init.uniform_](ctx, tensor, -bound, bound)
    return _torch_draw(torch.nn.init.kaiming_uniform_, tensor, *args, **kwargs)


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


def _feature_route(func: Any, alpha: bool) -> Callable[..., torch.Tensor]:
    return _mask_route(alpha, functools.partial(_feature_keep, func), func)


def _torch_form(route: Callable[..., torch.Tensor], inplace: bool) -> Callable[..., torch.Tensor]:
    """``route`` (input, p, training, inplace) under the torch.* dropouts' (input, p, train)."""

    def torch_route(
        ctx: _InvariantRandomMode, input: torch.Tensor, p: float, train: bool
    ) -> torch.Tensor:
        return route(ctx, input, p, train, inplace)

    return torch_route


_ROUTES: dict[Any, Callable[..., Any]] = {
    F.dropout: _f_dropout,
    torch.dropout: _torch_form(_f_dropout, inplace=False),
    torch.dropout_: _torch_form(_f_dropout, inplace=True),
    F.dropout1d: _feature_route(F.dropout1d, alpha=False),
    F.dropout2d: _feature_route(F.dropout2d, alpha=False),
    F.dropout3d: _feature_route(F.dropout3d, alpha=False),
    torch.feature_dropout: _torch_form(_feature_route(torch.feature_dropout, False), False),
    torch.feature_dropout_: _torch_form(_feature_route(torch.feature_dropout_, False), True),
    F.alpha_dropout: _mask_route(True, _local_keep),
    torch.alpha_dropout: _torch_form(_mask_route(True, _local_keep), inplace=False),
    torch.alpha_dropout_: _torch_form(_mask_route(True, _local_keep), inplace=True),
    F.feature_alpha_dropout: _feature_route(F.feature_alpha_dropout, alpha=True),
    torch.feature_alpha_dropout: _torch_form(
        _feature_route(torch.feature_alpha_dropout, True), False
    ),
    torch.feature_alpha_dropout_: _torch_form(
        _feature_route(torch.feature_alpha_dropout_, True), True
    ),
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.nn.init.uniform_: _init_route(torch.nn.init.uniform_, "uniform", ("a", "b")),
    torch.nn.init.normal_: _init_route(torch.nn.init.normal_, "normal", ("mean", "std")),
    torch.nn.init.kaiming_uniform_: _init_kaiming_uniform,
    torch.Tensor.uniform_: _init_route(
        torch.Tensor.uniform_, "uniform", ("from", "to"), recorded=True
    ),
    torch.Tensor.normal_: _init_route(
        torch.Tensor.normal_, "normal", ("mean", "std"), recorded=True
    ),
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
    torch.rrelu_: "torch.rrelu_ (F.rrelu_)",
    torch.Tensor.multinomial: "Tensor.multinomial",
    torch.native_dropout: "torch.native_dropout",
    F.gumbel_softmax: "F.gumbel_softmax",
    F.fractional_max_pool2d: "F.fractional_max_pool2d without _random_samples",
    F.fractional_max_pool3d: "F.fractional_max_pool3d without _random_samples",
    F.scaled_dot_product_attention: "F.scaled_dot_product_attention with dropout_p > 0",
    F.multi_head_attention_forward: "F.multi_head_attention_forward with dropout_p > 0",
}


def _always_draws(args: tuple, kwargs: dict) -> bool:
    return True


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: object) -> object:
    return args[index] if len(args) > index else kwargs.get(name, default)


# Of the refused, those that draw only for some arguments (the call runs where it draws nothing).
_DRAWS_WHEN: dict[Any, Callable[[tuple, dict], bool]] = {
    F.fractional_max_pool2d: lambda a, k: _argument(a, k, 5, "_random_samples", None) is None,
    F.fractional_max_pool3d: lambda a, k: _argument(a, k, 5, "_random_samples", None) is None,
    F.scaled_dot_product_attention: lambda a, k: _argument(a, k, 4, "dropout_p", 0.0) != 0,
    F.multi_head_attention_forward: lambda a, k: (
        _argument(a, k, 10, "dropout_p", 0.0) != 0 and bool(_argument(a, k, 13, "training", True))
    ),
    torch.native_dropout: lambda a, k: _argument(a, k, 2, "train", True) is not False,
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


# invariant_random blocks open in this thread (innermost last); nn.init.trunc_normal_ is routed
# while any thread has one open, and the route acts only for the thread that has.
_BLOCKS = threading.local()
_TRUNC_ROUTE_LOCK = threading.Lock()
_TRUNC_ROUTE: dict[str, Any] = {"users": 0, "torch": None}


def _open_blocks() -> list[_InvariantRandomMode]:
    if not hasattr(_BLOCKS, "modes"):
        _BLOCKS.modes = []
    return _BLOCKS.modes


def _routed_trunc_normal(
    tensor: torch.Tensor,
    mean: float,
    std: float,
    a: float,
    b: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """torch's ``_no_grad_trunc_normal_`` inside an ``invariant_random`` block.

    Keyed: one keyed inverse-CDF draw per element (keyed by the parameter's name, or by its
    place among the block's draws); bounds the keyed draw refuses run torch's code, which answers
    them as torch does. ``init="full"`` or a ``generator=``: torch's own draw, on the full tensor
    for a DTensor (run on the DTensor, its pointwise steps would redistribute a ``Partial`` one
    and round its values).
    """
    torch_trunc_normal = _TRUNC_ROUTE["torch"]
    blocks = _open_blocks()
    keyed = blocks[-1].keyed if blocks else None
    if keyed is not None and generator is None:
        if _keyed_bounds(mean, std, a, b):
            return keyed.fill(tensor, "trunc_normal", mean, std, a, b)
        return torch_trunc_normal(tensor, mean, std, a, b)  # torch's answer, its draws keyed
    if blocks:
        return _torch_draw(torch_trunc_normal, tensor, mean, std, a, b, generator=generator)
    return torch_trunc_normal(tensor, mean, std, a, b, generator=generator)


def _keyed_bounds(mean: object, std: object, a: object, b: object) -> bool:
    """Whether the keyed truncated normal takes these (real) numbers; bounds it refuses run
    torch's own, which answers them as torch does. Numbers that are not real raise."""
    try:
        check_trunc_normal(mean, std, a, b)
    except KernelInputError:
        return False
    return True


def _open_block(mode: _InvariantRandomMode) -> None:
    with _TRUNC_ROUTE_LOCK:
        if _TRUNC_ROUTE["users"] == 0:
            torch_impl = trunc_normal_impl()
            if torch_impl is not None:
                _TRUNC_ROUTE["torch"] = torch_impl
                set_trunc_normal_impl(_routed_trunc_normal)
        _TRUNC_ROUTE["users"] += 1
    _open_blocks().append(mode)


def _close_block(mode: _InvariantRandomMode) -> None:
    blocks = _open_blocks()
    for i in range(len(blocks) - 1, -1, -1):  # the innermost entry of this mode
        if blocks[i] is mode:
            del blocks[i]
            break
    with _TRUNC_ROUTE_LOCK:
        _TRUNC_ROUTE["users"] -= 1
        if _TRUNC_ROUTE["users"] == 0 and _TRUNC_ROUTE["torch"] is not None:
            if trunc_normal_impl() is _routed_trunc_normal:
                set_trunc_normal_impl(_TRUNC_ROUTE["torch"])
            _TRUNC_ROUTE["torch"] = None


class _InvariantRandomMode(TorchFunctionMode):
    """Sends the random ops of _ROUTES, on plain tensors and DTensors alike, to the invariant
    ops; refuses the random ops that have none on a DTensor."""

    # rng_tracker's checkpoints enter it again around a recompute that autograd's engine runs
    # without it (rng_tracker._recompute.REPLAYED_IN_RECOMPUTE): the recompute draws its masks
    replayed_in_recompute = True

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        init: InitMode = "keyed",
        seed: int | None = None,
        batch_dim: int = 0,
    ) -> None:
        super().__init__()
        batch_dim = checked_int(
            batch_dim,
            "batch_dim (the sample dim of the activations)",
            type_error=BatchPositionTypeError,
        )
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
            raise InvariantRandomConfigTypeError(
                f"model must be an nn.Module (whose parameter names key init) or None, got "
                f"{type(model).__name__}"
            )
        self.init = init
        self.batch_dim = batch_dim
        self.keyed: KeyedInit | None = None
        if init == "keyed":
            self.keyed = KeyedInit(model, torch.initial_seed() if seed is None else seed)

    def __enter__(self) -> _InvariantRandomMode:
        _open_block(self)
        try:
            return super().__enter__()
        except BaseException:
            _close_block(self)
            raise

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            _close_block(self)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(_TORCHS_OWN, "depth", 0):  # torch's own init, run by a route
            return func(*args, **kwargs)
        if func is _TORCH_CHECKPOINT_UNDER_COMPILE:  # said once Dynamo has traced it so
            out = func(*args, **kwargs)
            _warn_unrouted_checkpoint()
            return out
        route = _ROUTES.get(func)
        if route is not None and isinstance(_first_tensor(args, kwargs), torch.Tensor):
            if func in _DROPOUT_ARGUMENTS:
                answer = _torchs_answer(func, args, kwargs)
                if answer is not _DRAW:
                    return answer
            if func in _MASK_DRAWS:
                if torch.compiler.is_compiling():
                    return _draw_untraced(self, route, func, args, kwargs)
                _refuse_in_torchs_checkpoint(func)
            return route(self, *args, **kwargs)
        whole = len(args) == 1 and not kwargs  # any() of the whole tensor, no dim
        if func in _GLOBAL_REDUCTIONS and whole and isinstance(args[0], DTensor):
            return _global_any(args[0])
        if (
            func in _REFUSED_ON_DTENSOR
            and any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))
            and _DRAWS_WHEN.get(func, _always_draws)(args, kwargs)
        ):
            return _refuse_on_dtensor(_REFUSED_ON_DTENSOR[func])(self)
        return func(*args, **kwargs)


@contextmanager
def invariant_random(
    model: torch.nn.Module | None = None,
    *,
    init: InitMode = "keyed",
    seed: int | None = None,
    batch_dim: int = 0,
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

    Data parallelism and microbatches: a forward holds some samples of the step's global batch,
    which nothing in the forward says. Enter ``rng_tracker.batch_position(sample_offset,
    global_batch)`` around each microbatch's forward: each dropout mask is then the part of the
    global batch's mask that its samples own, along ``batch_dim`` (dim 0 of the (N, C) mask of
    the feature dropouts), so data-parallel ranks draw what one device draws over the whole
    batch. Each draw moves the generator past the whole global batch, so several microbatches
    on one rank must each start from the step's generator state (all but the last in
    ``torch.random.fork_rng``). Without a position a forward's tensors are the whole batch, and a
    process whose parallel layout (``rng_tracker.parallel.ParallelState``, megatron's) has
    several data-parallel ranks raises ``MissingBatchPositionError``. Checkpoints carry the
    position into the recompute.

    Random ops with no invariant route raise ``InvariantRandomUnsupportedError`` on a DTensor
    and run torch's own code on a plain tensor. Per thread (torch function modes are).
    """
    with _InvariantRandomMode(model, init=init, seed=seed, batch_dim=batch_dim):
        yield


# The mode enable_invariant_random() entered, per thread: torch's function-mode stack is per
# thread, so each thread turns the mode on and off on its own stack.
_ENABLED = threading.local()


def enable_invariant_random(
    model: torch.nn.Module | None = None,
    *,
    init: InitMode = "keyed",
    seed: int | None = None,
    batch_dim: int = 0,
) -> None:
    """Turn ``invariant_random(...)`` on in this thread until ``disable_invariant_random()``
    (idempotent: a second call while on changes nothing)."""
    if getattr(_ENABLED, "mode", None) is not None:
        return
    mode = _InvariantRandomMode(model, init=init, seed=seed, batch_dim=batch_dim)
    mode.__enter__()
    _ENABLED.mode = mode


def disable_invariant_random() -> None:
    """Turn off what ``enable_invariant_random()`` turned on in this thread (a no-op if off)."""
    mode = getattr(_ENABLED, "mode", None)
    if mode is None:
        return
    if not is_innermost_function_mode(mode):
        raise InvariantRandomModeError(
            "another torch function mode was entered after enable_invariant_random() and is "
            "still active; exit it first (modes form a stack)"
        )
    _ENABLED.mode = None
    mode.__exit__(None, None, None)
