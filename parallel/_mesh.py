"""The process mesh: tensor, pipeline, data, context and expert parallel groups.

Ranks are laid out as Megatron-LM's ``parallel_state`` lays them out for the same ``order``
(default "tp-cp-ep-dp-pp": tp fastest, pp slowest): the dense mesh has axes (pp, dp, cp, tp);
the expert mesh refactors the same ranks as (pp, edp, ep, etp) with etp = tp, so ep must
divide dp * cp. Every rank gets Megatron's coordinates and groups for every order Megatron
accepts (tests/test_megatron_state.py checks them against Megatron's own).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rng_tracker._device_rng import require_device_type
from rng_tracker._validate import checked_int, checked_size
from rng_tracker.errors import (
    ParallelConfigError,
    ParallelConfigTypeError,
    ParallelStateError,
    TrackerDeviceError,
    UnknownAxisError,
)

_DENSE_AXES = ("pp", "dp", "cp", "tp")
_EXPERT_AXES = ("pp", "edp", "ep", "etp")

DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # Megatron's default: the first token varies fastest
_ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This rank's place in the mesh: ranks, sizes, groups and meshes per axis.

    Axes: ``tp``, ``pp``, ``dp``, ``cp`` (dense mesh) and ``ep``, ``etp``, ``edp``
    (expert mesh).
    """

    mesh: DeviceMesh
    expert_mesh: DeviceMesh
    sizes: dict[str, int] = field(hash=False)
    ranks: dict[str, int] = field(hash=False)

    def _mesh_of(self, axis: str) -> DeviceMesh:
        if axis in _DENSE_AXES:
            return self.mesh
        if axis in _EXPERT_AXES:
            return self.expert_mesh
        raise UnknownAxisError(
            f"unknown parallel axis {axis!r}; use one of {_DENSE_AXES + _EXPERT_AXES[1:]}"
        )

    def rank(self, axis: str) -> int:
        """This process's coordinate on ``axis``."""
        self._mesh_of(axis)
        return self.ranks[axis]

    def size(self, axis: str) -> int:
        """The number of ranks along ``axis``."""
        self._mesh_of(axis)
        return self.sizes[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only on ``axis``."""
        return self._mesh_of(axis).get_group(axis)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.mesh.size()

    def __str__(self) -> str:
        parts = " ".join(
            f"{a}={self.ranks[a]}/{self.sizes[a]}" for a in ("tp", "cp", "dp", "pp", "ep", "etp")
        )
        return f"ParallelState({parts})"


_STATE: ParallelState | None = None
_GROUPS: tuple[dist.ProcessGroup, ...] = ()  # the groups _STATE's meshes created


def _check_device_type(device_type: object) -> None:
    """Refuse a device type torch does not know (or a device with an index, such as "cuda:0"),
    and one with no usable device here (meta; cuda on a machine without one)."""
    if device_type is None:
        return
    if not isinstance(device_type, str):
        raise ParallelConfigTypeError(
            f"device_type must be a str such as 'cuda' or 'cpu', or None, got "
            f"{type(device_type).__name__} {device_type!r}"
        )
    try:
        known = torch.device(device_type).type == device_type
    except (RuntimeError, ValueError):
        known = False
    if not known:
        raise ParallelConfigError(
            f"device_type {device_type!r} is not a torch device type; pass one such as 'cuda' "
            "or 'cpu' (no index: each rank uses its current device), or None to pick cuda when "
            "available, else cpu"
        )
    try:  # the mesh's ranks draw from its device's generator and run collectives on it
        require_device_type(device_type)
    except TrackerDeviceError:
        raise ParallelConfigError(
            f"device_type {device_type!r} has no usable device here: this torch "
            f"{torch.__version__} build or machine gives it no generator and no collectives "
            "(the meta device never has them); pass 'cpu', an accelerator this machine has, or "
            "None to pick cuda when available, else cpu"
        ) from None


def _order_tokens(order: object, sizes: dict[str, int]) -> list[str]:
    """Megatron's order string as its tokens, fastest first; tokens it leaves out are
    appended (allowed only for axes of size 1, as in Megatron)."""
    if not isinstance(order, str):
        raise ParallelConfigTypeError(
            f"order must be a str such as {DEFAULT_ORDER!r}, got {type(order).__name__} {order!r}"
        )
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in _ORDER_TOKENS]
    if unknown or len(set(tokens)) != len(tokens):
        raise ParallelConfigError(
            f"order {order!r} must name each of {'-'.join(_ORDER_TOKENS)} at most once, "
            f"separated by '-' (e.g. {DEFAULT_ORDER!r} or 'tp-cp-ep-pp-dp')"
        )
    for token in _ORDER_TOKENS:
        if token not in tokens:
            if sizes[token] != 1:
                raise ParallelConfigError(
                    f"order {order!r} leaves out {token!r}, whose size is {sizes[token]}; "
                    "name every axis of size above 1"
                )
            tokens.append(token)
    return tokens


def _rank_grid(tokens: list[str], sizes: dict[str, int], axes: tuple[str, ...]) -> torch.Tensor:
    """The global ranks as a tensor with one dim per mesh axis of ``axes`` (order tokens), laid
    out as Megatron's RankGenerator does: the first token of the order has stride 1."""
    slowest_first = tokens[::-1]
    grid = torch.arange(math.prod(sizes.values())).reshape([sizes[t] for t in slowest_first])
    rest = [t for t in slowest_first if t not in axes]
    grid = grid.permute([slowest_first.index(t) for t in (*axes, *rest)])
    return grid.reshape([sizes[t] for t in axes])


def global_rank(
    coordinates: Mapping[str, int], sizes: Mapping[str, int], order: str = DEFAULT_ORDER
) -> int:
    """The global rank :func:`init_model_parallel` gives the rank at ``coordinates`` of a layout
    of ``sizes`` (dense axes ``tp``, ``cp``, ``dp``, ``pp``; those left out are 0 and of size 1).

    A pure function of the layout, so a job can place a layout that is not the live mesh
    (a saved checkpoint's, say) by the mesh's own rule, Megatron's order included.
    """
    unknown = sorted(set(coordinates) - set(_DENSE_AXES)) + sorted(set(sizes) - set(_DENSE_AXES))
    if unknown:
        raise ParallelConfigError(f"global_rank takes the dense axes {_DENSE_AXES}, got {unknown}")
    full = {axis: 1 for axis in _ORDER_TOKENS}
    full.update({axis: checked_size(size, f"sizes[{axis!r}]") for axis, size in sizes.items()})
    at = []
    for axis in _DENSE_AXES:
        rank = checked_int(
            coordinates.get(axis, 0), f"coordinates[{axis!r}]", type_error=ParallelConfigError
        )
        if not 0 <= rank < full[axis]:
            raise ParallelConfigError(
                f"coordinates[{axis!r}] is {rank}, outside an axis of size {full[axis]}"
            )
        at.append(rank)
    return int(_rank_grid(_order_tokens(order, full), full, _DENSE_AXES)[tuple(at)])


def _pipeline_groups(grid: torch.Tensor) -> set[tuple[int, ...]]:
    """The ranks along the pp axis (the first) of ``grid``, one tuple per pipeline."""
    return {tuple(column) for column in grid.reshape(grid.shape[0], -1).T.tolist()}


def init_model_parallel(
    *,
    tensor: int = 1,
    pipeline: int = 1,
    context: int = 1,
    expert: int = 1,
    device_type: str | None = None,
    order: str = DEFAULT_ORDER,
) -> ParallelState:
    """Build the mesh over the initialised default process group; data parallel is inferred.

    ``order`` is Megatron's (``parallel_state.initialize_model_parallel(order=...)``): the
    axes from fastest- to slowest-varying rank, e.g. "tp-cp-ep-dp-pp" or "tp-cp-ep-pp-dp";
    every rank gets the coordinates and groups Megatron gives it, and orders Megatron
    refuses raise :class:`ParallelConfigError`.
    """
    global _STATE, _GROUPS
    if not dist.is_initialized():
        raise ParallelStateError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group "
            "first (torchrun sets up the environment for it)"
        )
    if _STATE is not None:
        raise ParallelStateError(
            "model parallel is already initialised; call destroy_model_parallel() first"
        )
    tp, pp = checked_size(tensor, "tensor"), checked_size(pipeline, "pipeline")
    _check_device_type(device_type)
    cp, ep = checked_size(context, "context"), checked_size(expert, "expert")
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ParallelConfigError(
            f"world size {world} is not divisible by tensor * pipeline * context = {tp} * {pp} * {cp}; "
            "choose sizes whose product divides the number of processes"
        )
    dp = world // (tp * pp * cp)
    if (dp * cp) % ep:
        raise ParallelConfigError(
            f"expert={ep} must divide data * context = {dp} * {cp}: expert ranks are carved out "
            "of the data- and context-parallel ranks"
        )
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    edp = dp * cp // ep
    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": tp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    tokens = _order_tokens(order, {**dense_sizes, "ep": ep})
    dense = _rank_grid(tokens, dense_sizes, ("pp", "dp", "cp", "tp"))
    experts = _rank_grid(tokens, expert_sizes, ("pp", "dp", "ep", "tp"))
    if pp > 1 and not order.endswith("pp") and edp != dp:
        raise ParallelConfigError(
            f"order {order!r} does not end in 'pp', so the expert data-parallel size ({edp}) "
            f"must equal the data-parallel size ({dp}), as in Megatron; put 'pp' last"
        )
    if _pipeline_groups(dense) != _pipeline_groups(experts):
        raise ParallelConfigError(
            f"order {order!r} gives the dense and the expert layers different pipeline groups "
            "(Megatron refuses it too); put 'pp' last"
        )
    mesh = DeviceMesh(device_type, dense, mesh_dim_names=_DENSE_AXES)
    expert_mesh = DeviceMesh(device_type, experts, mesh_dim_names=_EXPERT_AXES)
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "etp": tp, "edp": edp}
    coords = {axis: mesh.get_local_rank(axis) for axis in _DENSE_AXES}
    coords.update({axis: expert_mesh.get_local_rank(axis) for axis in _EXPERT_AXES[1:]})
    _STATE = ParallelState(mesh=mesh, expert_mesh=expert_mesh, sizes=sizes, ranks=coords)
    _GROUPS = _groups_created_by(mesh, expert_mesh)
    return _STATE


def _groups_created_by(*meshes: DeviceMesh) -> tuple[dist.ProcessGroup, ...]:
    groups: list[dist.ProcessGroup] = []
    for mesh in meshes:
        for axis in mesh.mesh_dim_names or ():
            group = mesh.get_group(axis)
            if group is not dist.group.WORLD and all(group is not g for g in groups):
                groups.append(group)
    return tuple(groups)


def get_parallel_state() -> ParallelState:
    """The state built by :func:`init_model_parallel`."""
    if _STATE is None:
        raise ParallelStateError(
            "model parallel is not initialised; call init_model_parallel() first"
        )
    return _STATE


def get_parallel_state_or_none() -> ParallelState | None:
    """The parallel state, or None before :func:`init_model_parallel`."""
    return _STATE


def destroy_model_parallel() -> None:
    """Forget the parallel state and destroy the process groups its meshes created (each gloo
    group holds threads; a job that re-initialises would otherwise accumulate them). The
    default process group stays.

    A collective over the default group, like ``init_model_parallel``: call it on every rank.
    """
    global _STATE, _GROUPS
    groups, _STATE, _GROUPS = _GROUPS, None, ()
    if not dist.is_initialized():
        return  # destroy_process_group() already destroyed every group
    if groups:
        # a rank must not close its end of a group while a peer is still connecting to it
        dist.barrier()
    for group in groups:
        with contextlib.suppress(ValueError):  # the caller destroyed this group already
            dist.destroy_process_group(group)
