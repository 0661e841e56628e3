"""Invariant init of megatron-core's parameters: deferred while a model is built, then filled
shard by shard from the model's ``sharded_state_dict()`` boxes.

While invariant mode is installed, megatron's init sites draw nothing: its affine helpers
(``_initialize_affine_weight_gpu``/``_cpu``, replaced here) and the config's init methods called
on a parameter (position embedding, router: :class:`DeferredInitMethod`) record (parameter,
init method). When the model's construction ends, :func:`fill_deferred` takes every
``ShardedTensor`` of ``model.sharded_state_dict()`` (factories built, so a gated fc1 is its two
logical halves), finds the deferred parameter its data views, and fills that view with the keyed
values of (seed, the tensor's key, the element's global index) from the distribution the init
method draws on the parameter's logical shape. A rank computes only its local shard: no master
weight exists, with ``use_cpu_initialization`` True or False alike.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rng_tracker.kernels._keyed_fill as _kernel
from rng_tracker._torch_private import set_trunc_normal_impl, trunc_normal_impl
from rng_tracker.errors import (
    KeyedUnseededError,
    MegatronInvariantInitError,
    MegatronInvariantUnsupportedError,
)

# Process-wide, under _LOCK: what install(invariant=True) switched on, for every thread's model.
_STATE: dict[str, Any] = {"active": False, "hook": None}
_LOCK = threading.RLock()
# id(parameter) -> (weak reference to it, the init method megatron would have called on it)
_DEFERRED: dict[int, tuple[weakref.ref[torch.Tensor], Callable[..., Any]]] = {}


def set_active(active: bool) -> None:
    """Turn deferral on (invariant mode installed) or off."""
    _STATE["active"] = bool(active)


def _forget(key: int) -> None:
    with _LOCK:
        _DEFERRED.pop(key, None)
        if not _DEFERRED and _STATE["hook"] is not None:
            _STATE["hook"].remove()
            _STATE["hook"] = None


def defer(param: torch.Tensor, init_method: Callable[..., Any]) -> None:
    """Record that ``param`` takes its values from ``init_method`` once its model is built."""
    method = getattr(init_method, "original", init_method)
    key = id(param)
    with _LOCK:
        _DEFERRED[key] = (weakref.ref(param, lambda _, key=key: _forget(key)), method)
        if _STATE["hook"] is None:
            _STATE["hook"] = torch.nn.modules.module.register_module_forward_pre_hook(
                _refuse_unfilled
            )


def _is_deferred(param: object) -> bool:
    entry = _DEFERRED.get(id(param))
    return entry is not None and entry[0]() is param


def _refuse_unfilled(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook on every module while parameters wait: one of them may not run."""
    for name, param in module.named_parameters(recurse=False):
        if _is_deferred(param):
            raise MegatronInvariantInitError(
                f"{type(module).__name__}.{name} {tuple(param.shape)} was never filled by "
                "rng_tracker.megatron.install(invariant=True): invariant init fills a model's "
                "parameters when a megatron-core GPTModel's construction ends, from its "
                "sharded_state_dict(); this parameter was built outside one (or after it). "
                "Build it inside the GPTModel, or call install() without invariant=True"
            )


class DeferredInitMethod:
    """A config init method that, in invariant mode, records the parameter it is given instead
    of drawing (its values come from :func:`fill_deferred`); on anything else, or with
    invariant mode off, it is the original init method."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _STATE["active"] and isinstance(tensor, torch.nn.Parameter) and not args and not kwargs:
            defer(tensor, self.original)
            return tensor
        return self.original(tensor, *args, **kwargs)

    def __repr__(self) -> str:
        return f"DeferredInitMethod({self.original!r})"


def _mark_tensor_parallel(weight: torch.Tensor, partition_dim: int, stride: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(
        tensor=weight, is_parallel=True, dim=partition_dim, stride=stride
    )


def initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable[..., Any],
    partition_dim: int,
    stride: int = 1,
    is_expert: bool = False,
) -> None:
    """Megatron's ``_initialize_affine_weight_gpu`` in invariant mode: sets the same
    tensor-parallel attributes and defers the values (nothing is drawn)."""
    _mark_tensor_parallel(weight, partition_dim, stride)
    defer(weight, init_method)


def initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable[..., Any],
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
    world_size: int | None = None,
    skip_set_tensor_parallel_attributes: bool = False,
) -> None:
    """Megatron's ``_initialize_affine_weight_cpu`` in invariant mode: no master weight is
    built; the values are deferred (the same as with ``use_cpu_initialization=False``), so
    ``return_master_weight`` gets None."""
    if not skip_set_tensor_parallel_attributes:
        _mark_tensor_parallel(weight, partition_dim, stride)
    defer(weight, init_method)


# -- what an init method draws --------------------------------------------------------------
_aten = torch.ops.aten
_CONSTANT_FILLS = frozenset({_aten.fill_, _aten.zero_})


class _Draws(TorchDispatchMode):
    """Records the draws (and any other in-place op) an init method makes on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, tuple[float, ...], tuple[int, ...]]] = []
        self.others: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (_aten.normal_, _aten.uniform_):
            low, high = (0.0, 1.0)
            given = [*args[1:3]]
            names = ("mean", "std") if packet is _aten.normal_ else ("from", "to")
            values = [low, high]
            for i, value in enumerate(given):
                values[i] = value
            for i, name in enumerate(names):
                values[i] = kwargs.get(name, values[i])
            kind = "normal" if packet is _aten.normal_ else "uniform"
            self.draws.append((kind, tuple(float(v) for v in values), tuple(args[0].shape)))
        elif packet in _CONSTANT_FILLS:
            self.others.append("constant")
        elif func._schema.is_mutable:
            self.others.append(str(packet))
        return func(*args, **kwargs)


_PROBE_LOCK = threading.Lock()


def _distribution(
    init_method: Callable[..., Any], shape: tuple[int, ...]
) -> tuple[str, tuple[float, ...]] | None:
    """(kind, parameters) of the one draw ``init_method`` makes on a tensor of ``shape``; None
    for an init that only fills a constant. Anything else cannot be keyed and is refused, an
    init that does nothing on the meta device probe included (``orthogonal_``)."""
    probe = _Draws()
    truncated: list[tuple[float, ...]] = []

    def capture_truncated(
        tensor: torch.Tensor,
        mean: float,
        std: float,
        a: float,
        b: float,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        truncated.append((float(mean), float(std), float(a), float(b)))
        return tensor

    with _PROBE_LOCK:
        torch_impl = trunc_normal_impl()
        if torch_impl is not None:
            set_trunc_normal_impl(capture_truncated)
        try:
            with probe, torch.no_grad():
                init_method(torch.empty(shape, device="meta"))
        finally:
            if torch_impl is not None:
                set_trunc_normal_impl(torch_impl)
    draws = [(kind, params) for kind, params, drawn in probe.draws if drawn == shape]
    draws += [("trunc_normal", params) for params in truncated]
    others = [op for op in probe.others if op != "constant"]
    if len(draws) == 1 and len(probe.draws) + len(truncated) == 1 and not probe.others:
        return draws[0]
    if not probe.draws and not truncated and probe.others and not others:
        return None  # it wrote a constant (zeros_, constant_): no draw to key
    raise MegatronInvariantUnsupportedError(
        f"invariant init cannot key the init method {_describe(init_method)}: on a tensor of "
        f"shape {shape} it makes {len(probe.draws) + len(truncated)} draw(s) and the in-place "
        f"op(s) {probe.others}; a keyed init takes one normal_, uniform_ or trunc_normal_ draw "
        "over the whole tensor (megatron's init_method_normal and scaled_init_method_normal, "
        "xavier_*, kaiming_*). Use one of those, or install() without invariant=True"
    )


def _describe(function: Callable[..., Any]) -> str:
    inner = getattr(function, "func", function)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"{name} ({function!r})" if inner is not function else name


_FILLS: dict[str, Callable[..., torch.Tensor]] = {
    "normal": _kernel.keyed_normal_,
    "uniform": _kernel.keyed_uniform_,
    "trunc_normal": _kernel.keyed_trunc_normal_,
}


def _fill_box(
    data: torch.Tensor,
    kind: str,
    params: Sequence[float],
    *,
    seed: int,
    key: str,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    prepended: int,
) -> None:
    """Keyed values of (seed, key, global index) into ``data``: the box of the logical tensor of
    ``global_shape`` at ``offsets`` (its first ``prepended`` axes of extent 1, as megatron's
    ``prepend_axis_num``)."""
    with torch.no_grad():
        view = data.detach()[(None,) * prepended]  # (1,) * prepended + local shape
        indices = [range(o, o + n) for o, n in zip(offsets, view.shape, strict=True)]
        target = view if view.device.type == "cpu" else torch.empty(view.shape, dtype=view.dtype)
        _FILLS[kind](
            target, *params, seed=seed, name=key, global_shape=tuple(global_shape), indices=indices
        )
        if target is not view:
            view.copy_(target)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _tied_copy(model: torch.nn.Module) -> tuple[int, Callable[..., Any]] | None:
    """(id of the last stage's copy of a tied embedding, the embedding's init method), or None.

    With ``share_embeddings_and_output_weights`` a pipeline stage that has the output layer but
    not the embedding holds a copy of the embedding under its key; megatron starts it equal to
    the first stage's embedding (zeroed, then all-reduced while the model is built). Its init
    is therefore the embedding's, not the output layer's ``init_method`` it was deferred with."""
    if not getattr(model, "share_embeddings_and_output_weights", False) or getattr(
        model, "pre_process", True
    ):
        return None
    weight = getattr(getattr(model, "output_layer", None), "weight", None)
    method = getattr(getattr(model, "config", None), "embedding_init_method", None)
    if weight is None or method is None:
        return None
    return id(weight), getattr(method, "original", method)


def fill_deferred(model: torch.nn.Module, *, seed: int | None) -> int:
    """Fill every deferred parameter of ``model`` from ``model.sharded_state_dict()``; returns how
    many. Raises :class:`MegatronInvariantInitError` (nothing filled) when a deferred parameter
    is not exactly covered by the boxes of its sharded tensors."""
    waiting = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if _is_deferred(p)]
    if not waiting:
        return 0
    if seed is None:
        raise KeyedUnseededError(
            "invariant init has no seed: call model_parallel_cuda_manual_seed(seed) (the same "
            "seed on every rank) before building the model"
        )
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    by_storage: dict[tuple[str, int], list[Any]] = {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor) and value.data is not None:
            by_storage.setdefault(_storage_key(value.data), []).append(value)
    on_meta = [name for name, param in waiting if param.device.type == "meta"]
    if on_meta:
        raise MegatronInvariantUnsupportedError(
            f"invariant init fills parameters when the model is built, but {on_meta[:3]} are on "
            "the meta device (init_model_with_meta_device): their values would be drawn again "
            "when materialised, outside invariant init; build the model on a real device"
        )
    plan = []
    for name, param in waiting:
        if any(p is param for _, p, _ in plan):
            continue  # a parameter listed twice (tied)
        boxes, seen = [], set()
        start, end = param.storage_offset(), param.storage_offset() + param.numel()
        for box in by_storage.get(_storage_key(param), []):
            data = box.data
            where = (data.storage_offset(), tuple(data.shape), tuple(data.stride()))
            if where in seen or not start <= data.storage_offset() < end or box.flattened_range:
                continue
            seen.add(where)
            boxes.append(box)
        if sum(box.data.numel() for box in boxes) != param.numel():
            raise MegatronInvariantInitError(
                f"invariant init cannot place {name} {tuple(param.shape)}: the model's "
                f"sharded_state_dict() gives boxes for {sum(b.data.numel() for b in boxes)} of its "
                f"{param.numel()} elements ({[b.key for b in boxes]}), so its keyed values have no "
                "layout-free home; this megatron-core module is not supported by invariant mode"
            )
        plan.append((name, param, boxes))
    kinds: dict[tuple[int, tuple[int, ...]], tuple[str, tuple[float, ...]] | None] = {}
    tied = _tied_copy(model)
    for _, param, boxes in plan:
        method = tied[1] if tied is not None and tied[0] == id(param) else _DEFERRED[id(param)][1]
        for box in boxes:
            shape = tuple(box.global_shape[box.prepend_axis_num :])
            found = kinds.get((id(method), shape), ...)
            if found is ...:
                found = kinds[(id(method), shape)] = _distribution(method, shape)
            if found is None:  # a constant fill: the same on every shard
                with torch.no_grad():
                    method(box.data.detach())
                continue
            _fill_box(
                box.data,
                found[0],
                found[1],
                seed=seed,
                key=box.key,
                global_shape=box.global_shape,
                offsets=box.global_offset,
                prepended=box.prepend_axis_num,
            )
    for _, param, _ in plan:
        _forget(id(param))
    return len(plan)


def check_helpers() -> None:
    """Megatron's helpers must keep the parameters the replacements take (checked at install)."""
    from megatron.core.tensor_parallel import layers

    for ours, theirs in (
        (initialize_affine_weight_cpu, layers._initialize_affine_weight_cpu),
        (initialize_affine_weight_gpu, layers._initialize_affine_weight_gpu),
    ):
        if list(inspect.signature(ours).parameters) != list(inspect.signature(theirs).parameters):
            raise MegatronInvariantUnsupportedError(
                f"megatron-core's {theirs.__name__}{inspect.signature(theirs)} is not the helper "
                "invariant mode replaces; this megatron-core version's init is not known"
            )
