"""Megatron-core's ``parallel_state`` as a source of ranks and groups.

Every Megatron training script initialises ``megatron.core.parallel_state``; where
rng_tracker's own parallel state (:func:`~rng_tracker.parallel.init_model_parallel`) is absent,
the edges that need ranks or groups (seeding, ``distribute_saved_activations``,
``verify_rng_consistency``) read them from Megatron's through :func:`current_layout`. Megatron is
never imported here: its state is used only when ``megatron.core.parallel_state`` is already in
``sys.modules`` and initialised. Without either state nothing is guessed: the callers keep
raising their typed errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch.distributed as dist

from rng_tracker._optional_module import OptionalModule
from rng_tracker.errors import ParallelStateMismatchError, UnknownAxisError
from rng_tracker.parallel._mesh import ParallelState, get_parallel_state_or_none

_imported_parallel_state = OptionalModule("megatron.core.parallel_state")

# axis -> the name Megatron's getters use: get_<name>_rank/_world_size/_group
_GETTERS = {
    "tp": "tensor_model_parallel",
    "pp": "pipeline_model_parallel",
    "dp": "data_parallel",
    "cp": "context_parallel",
    "ep": "expert_model_parallel",
    "etp": "expert_tensor_parallel",
    "edp": "expert_data_parallel",
}


@dataclass(frozen=True, slots=True)
class MegatronParallelState:
    """This rank's ranks, sizes and groups per axis (tp, pp, dp, cp, ep, etp, edp), read
    from Megatron's initialised ``parallel_state``: a :class:`~rng_tracker.ParallelLayout`, as
    :class:`~rng_tracker.parallel.ParallelState` is (it has no DeviceMesh). It does not import
    the Protocol (the core imports this module lazily; tests/test_layout.py checks it)."""

    sizes: dict[str, int] = field(hash=False)
    ranks: dict[str, int] = field(hash=False)
    groups: dict[str, Any] = field(hash=False, repr=False)

    @classmethod
    def from_module(cls, ps: ModuleType) -> MegatronParallelState:
        """Read every axis from Megatron's ``parallel_state`` module ``ps``."""
        ranks, sizes, groups = {}, {}, {}
        for axis, name in _GETTERS.items():
            ranks[axis] = int(getattr(ps, f"get_{name}_rank")())
            sizes[axis] = int(getattr(ps, f"get_{name}_world_size")())
            groups[axis] = getattr(ps, f"get_{name}_group")()
        return cls(sizes=sizes, ranks=ranks, groups=groups)

    def _check(self, axis: str) -> None:
        if not isinstance(axis, str) or axis not in _GETTERS:
            raise UnknownAxisError(f"unknown parallel axis {axis!r}; use one of {tuple(_GETTERS)}")

    def rank(self, axis: str) -> int:
        """This process's coordinate on ``axis``."""
        self._check(axis)
        return self.ranks[axis]

    def size(self, axis: str) -> int:
        """The number of ranks along ``axis``."""
        self._check(axis)
        return self.sizes[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Megatron's process group of ``axis`` for this rank."""
        self._check(axis)
        return self.groups[axis]

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return dist.get_world_size()

    def __str__(self) -> str:
        parts = " ".join(f"{a}={self.ranks[a]}/{self.sizes[a]}" for a in _GETTERS)
        return f"MegatronParallelState({parts})"


# axis -> Megatron's virtual rank, set by parallel_state.set_<name>_rank; its rank getters
# return it before asking any group, with or without torch.distributed
_VIRTUAL_RANKS = {
    "tp": "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "pp": "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "dp": "_MPU_DATA_PARALLEL_RANK",
    "ep": "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "etp": "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
}


def megatron_virtual_ranks() -> dict[str, int]:
    """The ranks set with Megatron's ``parallel_state.set_*_rank``, by axis (the axes set only;
    {} when ``megatron.core.parallel_state`` is not imported). Without an expert-tensor group
    the etp rank is the tp rank, as Megatron's getter answers."""
    ps = _imported_parallel_state()
    if ps is None:
        return {}
    ranks = {axis: getattr(ps, name, None) for axis, name in _VIRTUAL_RANKS.items()}
    if ranks["etp"] is None and getattr(ps, "_EXPERT_TENSOR_PARALLEL_GROUP", None) is None:
        ranks["etp"] = ranks["tp"]
    return {axis: rank for axis, rank in ranks.items() if rank is not None}


def megatron_parallel_state_or_none() -> MegatronParallelState | None:
    """Megatron's parallel state if ``megatron.core.parallel_state`` is imported and
    initialised in this process, else None (Megatron is never imported here)."""
    ps = _imported_parallel_state()
    if ps is None or not dist.is_available() or not dist.is_initialized():
        return None
    is_initialized = getattr(ps, "model_parallel_is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    return MegatronParallelState.from_module(ps)


def current_layout() -> ParallelState | MegatronParallelState | None:
    """The ranks and groups the edges use: rng_tracker's own parallel state first, else
    Megatron's initialised one, else None (the caller raises; no rank is guessed).

    With both initialised they must agree on every axis's size and this rank's coordinate,
    else :class:`ParallelStateMismatchError`: which one is right cannot be known.
    """
    state = get_parallel_state_or_none()
    theirs = megatron_parallel_state_or_none()
    if state is not None and theirs is not None:
        _check_agree(state, theirs)
    return state if state is not None else theirs


def _check_agree(ours: ParallelState, theirs: MegatronParallelState) -> None:
    differ = [
        f"{axis}: rng_tracker {ours.rank(axis)}/{ours.size(axis)}, megatron "
        f"{theirs.rank(axis)}/{theirs.size(axis)}"
        for axis in _GETTERS
        if (ours.rank(axis), ours.size(axis)) != (theirs.rank(axis), theirs.size(axis))
    ]
    if differ:
        raise ParallelStateMismatchError(
            "rng_tracker's parallel state (init_model_parallel) and megatron-core's "
            "parallel_state are both initialised and disagree (rank/size): "
            + "; ".join(differ)
            + ". Keep one: destroy_model_parallel() the other, or initialise both with the "
            "same sizes and order"
        )
