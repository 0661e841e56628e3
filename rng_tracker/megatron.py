"""A drop-in for ``megatron.core.tensor_parallel.random``, on any device.

Every public name of Megatron-LM's module, and the private ones Megatron's other
modules import from it, with Megatron's signatures and positional order. "cuda" in a
name only echoes Megatron's API: the names act on the default generator of the current
device (CUDA, another ``torch.accelerator`` device, or CPU). Where the behaviour
differs from Megatron's, ``docs/migrating.md`` says how and why.

``install()`` routes megatron-core's own modules here (one line in a training script);
``uninstall()`` undoes it. ``install(invariant=True)`` also makes megatron-core's init and every
dropout and jitter mask a pure function of (seed, step, site, global index), the same on any
layout; the training loop then says where each microbatch sits (:func:`batch_position`) and
which optimizer step runs (:func:`set_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

import rng_tracker._megatron_install as _megatron_install
from rng_tracker import checkpoint_without_output as _without_output
from rng_tracker._batch_position import batch_position
from rng_tracker._collective import collective_device
from rng_tracker._device_rng import RNGState, default_device, device_rng, plain_state
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._layout import ParallelLayout, process_layout
from rng_tracker._megatron_install import (
    KNOWN_KEY_SCHEMES,
    KNOWN_MEGATRON_CORE_VERSIONS,
    installed,
    invariant_installed,
    uninstall,
)
from rng_tracker._optional_module import OptionalModule
from rng_tracker._saved_inputs import check_split_input
from rng_tracker._seeds import (
    SeedPlan,
    apply_seed_plan,
    checked_rank,
    plan_seeds,
    ranks_from_layout,
)
from rng_tracker._streams import (
    AXES,
    DATA_PARALLEL_RNG,
    EXPERT_GTP_REMAT_RNG,
    EXPERT_PARALLEL_RNG,
    GTP_REMAT_RNG,
    MODEL_PARALLEL_RNG,
)
from rng_tracker._torch_private import disable_current_dispatch_modes
from rng_tracker._tracker import (
    RNGStatesTracker,
    check_stream_seeds,
    process_tracker,
    set_process_tracker,
    validate_seed,
)
from rng_tracker._validate import checked_flag, checked_size
from rng_tracker.activation_checkpoint import is_checkpointing, reentrant_checkpoint
from rng_tracker.checkpoint_without_output import CheckpointWithoutOutputManager
from rng_tracker.errors import (
    CheckpointConfigError,
    InvariantSeedError,
    ParallelStateError,
    RankError,
    RNGTrackerError,
    SeedOverflowError,
    SeedReuseError,
    TrackerDeviceTypeError,
    TrackerNotInitializedError,
)

__all__ = [
    "HAVE_TE",
    "KNOWN_KEY_SCHEMES",
    "KNOWN_MEGATRON_CORE_VERSIONS",
    "CheckpointFunction",
    "CheckpointWithoutOutput",
    "CheckpointWithoutOutputManager",
    "CudaRNGStatesTracker",
    "batch_position",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_gtp_remat_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "initialize_rng_tracker",
    "install",
    "installed",
    "is_checkpointing",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "set_step",
    "uninstall",
]

# Megatron's private helpers of random.py that its other modules call, provided here with its
# signatures: install() replaces them as it does the public names.
_MEGATRON_HELPERS = (
    "_fork_rng",
    "_get_all_rng_states",
    "_get_cuda_rng_state",
    "_set_all_rng_states",
    "_set_cuda_rng_state",
)

# TransformerEngine is never used here: te_rng_tracker asks for what TE's tracker is,
# a tracker of graph-safe generator states (see initialize_rng_tracker).
HAVE_TE = False

# Megatron's module-level names of its stream names (rng_tracker._streams holds the names).
_MODEL_PARALLEL_RNG_TRACKER_NAME = MODEL_PARALLEL_RNG
_EXPERT_PARALLEL_RNG_TRACKER_NAME = EXPERT_PARALLEL_RNG
_DATA_PARALLEL_RNG_TRACKER_NAME = DATA_PARALLEL_RNG
_GTP_REMAT_RNG_TRACKER_NAME = GTP_REMAT_RNG
_EXPERT_GTP_REMAT_RNG_TRACKER_NAME = EXPERT_GTP_REMAT_RNG


# -- device generator states -------------------------------------------------------------
def _get_cuda_rng_state(
    device: int | str | torch.device | None = None, clone: bool = False, graph_safe: bool = False
) -> RNGState:
    """The state of ``device``'s default generator (default: the current device).

    ``graph_safe=False``: a uint8 state tensor. ``graph_safe=True``: a ``torch.Generator``
    - on CUDA the live graph-safe handle, or a clone of it with ``clone=True``; on
    devices without graph-safe states always a clone.
    """
    rng = device_rng(device, generator_states=graph_safe)
    return rng.snapshot() if clone else rng.live()


def _set_cuda_rng_state(
    new_state: RNGState, device: int | str | torch.device = -1, graph_safe: bool = False
) -> None:
    """Install ``new_state`` (a state tensor or a ``torch.Generator``) in ``device``'s
    default generator (-1: the current device). With ``graph_safe=True`` on CUDA a
    generator is installed by handle, as Megatron does; otherwise its state is copied."""
    target = None if isinstance(device, int) and device == -1 else device
    if graph_safe and isinstance(new_state, torch.Generator):
        handles = device_rng(target, generator_states=True)
        if handles.graph_safe and new_state.device.type == handles.device.type:
            handles.install(new_state)
            return
    copies = device_rng(target, generator_states=False)
    copies.install(copies.convert(new_state))  # convert refuses what is not a state of it


def convert_cuda_rng_state(state: RNGState, to_graphable: bool = False) -> RNGState:
    """``state`` as a ``torch.Generator`` (``to_graphable=True``) or as a uint8 state
    tensor; a state already in that form is returned as it is. The current device's
    generator is not touched."""
    to_graphable = _flag(to_graphable, "convert_cuda_rng_state(to_graphable=...)")
    if isinstance(state, torch.Generator):
        return state if to_graphable else state.get_state()
    if isinstance(state, torch.Tensor):
        if to_graphable:
            return device_rng(None, generator_states=True).convert(state)
        device_rng(None, generator_states=False).check(state)
        return state
    raise TrackerDeviceTypeError(
        f"convert_cuda_rng_state takes a torch.Tensor or a torch.Generator, got "
        f"{type(state).__name__}"
    )


# -- stream names ----------------------------------------------------------------------
def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the stream that varies over expert- and expert-tensor-parallel ranks."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the stream that is equal across tensor-parallel ranks."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_model_parallel_rng_tracker_name() -> str:
    """Name of the stream that varies over tensor-parallel ranks (not in Megatron)."""
    return _MODEL_PARALLEL_RNG_TRACKER_NAME


def get_gtp_remat_rng_tracker_name(is_expert: bool = False) -> str:
    """Name of the (expert) GTP-remat weight-init stream, which differs per GTP rank."""
    is_expert = _flag(is_expert, "get_gtp_remat_rng_tracker_name(is_expert=...)")
    return _EXPERT_GTP_REMAT_RNG_TRACKER_NAME if is_expert else _GTP_REMAT_RNG_TRACKER_NAME


# -- the tracker -------------------------------------------------------------------------
class CudaRNGStatesTracker(RNGStatesTracker):
    """Megatron's tracker: the streams of the current device's default generator.

    Args:
        use_cudagraphable_rng: the form of the saved states. True: ``torch.Generator``
            objects (graph-safe handles on CUDA, which CUDA graphs can register; clones on
            other devices). False: uint8 state tensors, on CUDA too. Forks draw the same
            values either way.
        is_inference_rng_tracker: kept as an attribute, as Megatron does; the inference
            behaviour comes from :func:`initialize_rng_tracker`.
    """

    def __init__(
        self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False
    ) -> None:
        use_cudagraphable_rng = _flag(use_cudagraphable_rng, "use_cudagraphable_rng")
        is_inference_rng_tracker = _flag(is_inference_rng_tracker, "is_inference_rng_tracker")
        super().__init__(None, generator_states=use_cudagraphable_rng)
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self._is_initialized = False

    @property
    def states_(self) -> Mapping[str, RNGState]:
        """Read-only view of the streams' stored states (Megatron's ``states_``); a stream
        with an open fork shows its state at fork entry. Use ``get_states()`` for copies."""
        return MappingProxyType(self._states)

    @property
    def seeds_(self) -> set[int]:
        """The seeds of the streams added since the last reset (Megatron's ``seeds_``)."""
        return set(self._seeds.values())

    def is_initialized(self) -> bool:
        """Whether ``add`` or ``set_states`` ran since the last reset (Megatron's meaning),
        or streams were loaded."""
        return self._is_initialized or bool(self._states)

    def reset(self) -> None:
        """Forget every stream."""
        super().reset()
        self._is_initialized = False

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` starting from ``seed``; the generator is untouched."""
        super().add(name, seed)
        self._is_initialized = True

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Replace every stream with copies of ``states`` (tensors or generators)."""
        super().set_states(states)
        self._is_initialized = True


class _InferenceCudaRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's inference tracker: ``add`` and ``set_states`` do nothing and ``fork`` is
    a no-op, so inference draws from the default generator."""

    def add(self, name: str, seed: int) -> None:
        """Do nothing (inference keeps no streams)."""

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Do nothing (inference keeps no streams)."""

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Any:
        """A context that changes nothing."""
        return contextlib.nullcontext()


def _flag(value: object, what: str) -> bool:
    """``value`` as a Megatron flag: a bool, or None for False (Megatron's own tests pass None);
    anything else raises :class:`~rng_tracker.errors.ArgumentTypeError`, since Megatron reads
    flags by truthiness (``force_reset="no"`` would reset)."""
    return False if value is None else checked_flag(value, what)


def _flags(**flags: object) -> tuple[bool, ...]:
    """The values of ``flags``, each a :func:`_flag`."""
    return tuple(_flag(value, name) for name, value in flags.items())


def _megatron_tracker() -> CudaRNGStatesTracker | None:
    """The process's tracker of the current device when Megatron's calls made it (it is then
    what :func:`rng_tracker.get_rng_tracker` returns too: one registry), else None."""
    tracker = process_tracker()
    return tracker if isinstance(tracker, CudaRNGStatesTracker) else None


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the process's Megatron tracker once (again with ``force_reset``).

    It becomes the process's tracker of the current device, what
    :func:`rng_tracker.get_rng_tracker` returns, with the streams that tracker held (seeded by
    ``rng_tracker.model_parallel_seed``, say), unless ``force_reset``. ``use_te_rng_tracker`` gives what
    TransformerEngine's tracker is, a tracker of graph-safe generator states (TE itself is not
    used); ``inference_rng_tracker`` a tracker whose ``add``/``set_states``/``fork`` do nothing.
    Each flag is a bool or None (:class:`~rng_tracker.errors.ArgumentTypeError` else, changing
    nothing).
    """
    use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset = _flags(
        use_te_rng_tracker=use_te_rng_tracker,
        inference_rng_tracker=inference_rng_tracker,
        use_cudagraphable_rng=use_cudagraphable_rng,
        force_reset=force_reset,
    )
    if not force_reset and _megatron_tracker() is not None:
        return
    cls = _InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    tracker = cls(
        use_cudagraphable_rng=use_cudagraphable_rng or use_te_rng_tracker,
        is_inference_rng_tracker=inference_rng_tracker,
    )
    found = process_tracker(tracker.device)
    if not (force_reset or inference_rng_tracker) and found is not None and found.names():
        # streams seeded through rng_tracker's own names (model_parallel_seed): one registry, so
        # Megatron's tracker takes them over rather than hiding them behind an empty one
        with disable_current_dispatch_modes():  # real state tensors, even under a trace
            tracker.load_state_dict(found.state_dict())
    set_process_tracker(tracker)


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> CudaRNGStatesTracker:
    """The process's Megatron tracker, created with these options on the first call."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    tracker = _megatron_tracker()
    assert tracker is not None
    return tracker


def get_all_rng_states() -> dict[str, RNGState]:
    """The stored state of every stream of the Megatron tracker, by reference.

    On a graph-safe CUDA tracker these are the generator handles its forks install (what a
    CUDA graph must register); use ``get_cuda_rng_tracker().get_states()`` for copies.
    """
    tracker = _megatron_tracker()
    if tracker is None:
        raise TrackerNotInitializedError(
            "get_all_rng_states(): the RNG tracker is not initialised; call "
            "get_cuda_rng_tracker() or model_parallel_cuda_manual_seed(seed) first"
        )
    return dict(tracker.states_)


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: Any) -> bool:
    """Whether the tracker keeps ``torch.Generator`` states (Megatron's graph-safe mode)."""
    if getattr(cuda_rng_tracker, "use_cudagraphable_rng", False):
        return True
    rng = getattr(cuda_rng_tracker, "_rng", None)
    return isinstance(cuda_rng_tracker, RNGStatesTracker) and bool(rng.generator_states)


# -- seeding -------------------------------------------------------------------------------
def _parallel_ranks(
    layout: ParallelLayout | None, tp_rank: int | None, ep_rank: int | None, etp_rank: int | None
) -> dict[str, int]:
    """The tp/ep/etp ranks: as given, else from ``layout``, else Megatron's virtual ranks
    (``parallel_state.set_*_rank``, which its getters read first), else 0 in one process."""
    given = {"tp": tp_rank, "ep": ep_rank, "etp": etp_rank}
    if layout is None:
        from rng_tracker.parallel._megatron_state import megatron_virtual_ranks  # lazy, as _layout

        virtual = megatron_virtual_ranks()
        given = {axis: virtual.get(axis) if rank is None else rank for axis, rank in given.items()}
    missing = [f"{axis}_rank" for axis, rank in given.items() if rank is None]
    found = ranks_from_layout(layout, missing, "model_parallel_cuda_manual_seed") if missing else {}
    return {axis: found[axis] if rank is None else rank for axis, rank in given.items()}


def _gtp_seed(
    axis: str, rank: int | None, world_size: int | None, base: int, offset: int
) -> int | None:
    """Megatron's GTP-remat stream seed, or None when the axis is inactive (world size None or
    1). A world size below 1, or a rank outside [0, world size), is refused even then."""
    size = (
        1
        if world_size is None
        else checked_size(
            world_size, f"{axis}_world_size", note="; pass None or 1 when the axis is not used"
        )
    )
    if rank is not None:
        rank = checked_rank(f"{axis}_rank", rank)
        if world_size is not None and rank >= size:
            raise RankError(
                f"{axis}_rank must be below {axis}_world_size={size}, got {rank}; pass this "
                f"rank's coordinate in [0, {size})"
            )
    if size <= 1:
        return None
    if rank is None:
        raise ParallelStateError(
            f"{axis}_world_size={size} needs {axis}_rank: rng_tracker's parallel state has no "
            f"{axis} axis, so pass the rank explicitly"
        )
    return base + offset + 65536 * (1 + rank)


def _keeps_streams(inference_rng_tracker: bool, force_reset: bool) -> bool:
    """Whether the tracker ``initialize_rng_tracker`` leaves with these flags keeps streams: an
    existing tracker stays (whatever the flag) unless ``force_reset``."""
    existing = _megatron_tracker()
    if existing is not None and not force_reset:
        return not isinstance(existing, _InferenceCudaRNGStatesTracker)
    return not inference_rng_tracker


def _megatron_seeds(
    seed: int,
    layout: ParallelLayout | None,
    tp_rank: int | None,
    ep_rank: int | None,
    etp_rank: int | None,
    gtp_remat_rank: int | None,
    egtp_remat_rank: int | None,
    gtp_remat_world_size: int | None,
    egtp_remat_world_size: int | None,
    keeps_streams: bool = True,
) -> tuple[SeedPlan, dict[str, int]]:
    """Megatron's seed plan and the GTP-remat seeds, checked; touches nothing.

    For a tracker that keeps no streams (Megatron's inference tracker adds none) the plan is
    the default seed alone: stream seeds that are never made cannot collide or overflow.
    """
    ranks = _parallel_ranks(layout, tp_rank, ep_rank, etp_rank)
    if not keeps_streams:
        _gtp_seed("gtp_remat", gtp_remat_rank, gtp_remat_world_size, 0, 0)  # checked all the same
        _gtp_seed("egtp_remat", egtp_remat_rank, egtp_remat_world_size, 0, 0)
        coordinates = {axis: checked_rank(f"{axis}_rank", ranks.get(axis, 0)) for axis in AXES}
        seed = validate_seed(seed)
        return SeedPlan("megatron", seed, seed, stream_seeds={}, coordinates=coordinates), {}
    plan = plan_seeds(seed, scheme="megatron", coordinates=ranks)  # validates, touches nothing
    extra = {
        name: value
        for name, value in (
            (
                _GTP_REMAT_RNG_TRACKER_NAME,
                _gtp_seed(
                    "gtp_remat",
                    gtp_remat_rank,
                    gtp_remat_world_size,
                    plan.stream_seeds[MODEL_PARALLEL_RNG],
                    0,
                ),
            ),
            (
                _EXPERT_GTP_REMAT_RNG_TRACKER_NAME,
                _gtp_seed(
                    "egtp_remat",
                    egtp_remat_rank,
                    egtp_remat_world_size,
                    plan.stream_seeds[EXPERT_PARALLEL_RNG],
                    32768,
                ),
            ),
        )
        if value is not None
    }
    used = {value: name for name, value in plan.stream_seeds.items()}
    for name, value in extra.items():
        if value >= 2**64:  # Megatron's arithmetic added offsets past the largest seed
            raise SeedOverflowError(
                f"Megatron's arithmetic gives {name!r} the seed {value} (the base seed {seed} "
                f"plus {value - seed}), beyond the largest seed 2**64-1; at these ranks pass a "
                f"seed of at most {2**64 - 1 - (value - seed)}"
            )
        if value in used:
            raise SeedReuseError(
                f"Megatron's arithmetic gives {name!r} the seed {value} of {used[value]!r}: "
                "they would draw identical values; change the ranks or the seed"
            )
        used[value] = name
    return plan, extra


# Megatron-LM's training loop seeds each pipeline stage with its own offset (its
# _set_random_seed: seed + 100 * pipeline rank); invariant mode recovers the seed from it.
_PIPELINE_SEED_STRIDE = 100


def _words(value: int) -> list[int]:
    """``value`` (in [0, 2**64)) as [hi, -hi, lo, -lo]: after an all-reduce MAX, equal on every
    rank iff each max equals its min."""
    hi, lo = value >> 32, value & 0xFFFFFFFF
    return [hi, -hi, lo, -lo]


def _equal(reduced: list[int]) -> bool:
    return reduced[0] == -reduced[1] and reduced[2] == -reduced[3]


def _invariant_seed(seed: int, layout: ParallelLayout | None, failure: Exception | None) -> int:
    """The keyed seed of invariant mode, the same on every rank; collective over the world.

    ``seed`` itself where every rank gave the same; the base of Megatron-LM's
    ``base + 100 * pipeline rank`` where the ranks gave exactly that (the pipeline rank from
    ``layout``); anything else raises :class:`InvariantSeedError`. ``failure`` (this rank's seed
    or ranks were refused) is raised after the agreement, and the other ranks raise too, so no
    rank waits and none changes its RNG state.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return seed
    rank = dist.get_rank()
    pp_rank: int | None = None
    if failure is None and layout is not None:
        try:
            pp_rank = layout.rank("pp")
        except RNGTrackerError:  # a parallel state without a pipeline axis
            pp_rank = None
    base = None if pp_rank is None else seed - _PIPELINE_SEED_STRIDE * pp_rank
    base_known = base is not None and base >= 0
    local = [1 if failure else 0, rank if failure else -1, 0 if base_known else 1]
    local += _words(0 if failure else seed) + _words(base if base_known else 0)
    data = torch.tensor(local, dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(data, op=dist.ReduceOp.MAX)
    reduced = [int(v) for v in data.cpu().tolist()]
    if failure is not None:
        raise failure
    if reduced[0]:
        raise InvariantSeedError(
            f"rank {reduced[1]} refused its model_parallel_cuda_manual_seed call (see its error), "
            "so no rank seeded: every RNG state is as it was"
        )
    if _equal(reduced[3:7]):
        return seed
    if not reduced[2] and _equal(reduced[7:11]):
        return base  # Megatron-LM's seed + 100 * pipeline rank: the run's seed is its base
    where = "no parallel state" if layout is None else f"pipeline rank {pp_rank}"
    raise InvariantSeedError(
        f"install(invariant=True): model_parallel_cuda_manual_seed got the seed {seed} on rank "
        f"{rank} ({where}) and another seed elsewhere; invariant mode keys init and every mask "
        "by one seed, so the ranks would draw different values. Pass every rank the same seed "
        "(Megatron-LM's seed + 100 * pipeline rank is recognised and its base used; its "
        "data_parallel_random_init, + 10 * data-parallel rank, cannot be invariant: turn it off). "
        "Nothing was seeded"
    )


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    gtp_remat_rank: int | None = None,
    egtp_remat_rank: int | None = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: int | None = None,
    egtp_remat_world_size: int | None = None,
) -> SeedPlan:
    """Megatron's seeding, bit for bit; ``seed`` already holds the pipeline offset.

    default generator and data-parallel-rng = seed; model-parallel-rng = seed + 2718 +
    tp_rank; expert-parallel-rng = seed + 1024 + 100 * ep_rank + etp_rank; the GTP-remat
    streams only where their world size is above 1. Ranks not given come from
    rng_tracker.parallel's parallel state, else are 0 when torch.distributed runs one rank
    (or none); several ranks without a parallel state raise :class:`ParallelStateError`.
    Seeds the CPU generator too. Nothing changes if the call raises. Returns the plan. Under an
    inference tracker, which adds no streams, only the default generators are seeded, so stream
    seeds that would collide or overflow are not refused (as in Megatron).

    In invariant mode (``install(invariant=True)``) the call also sets the keyed state to (the
    run's seed, step 0) and is collective: every rank calls it, and one all-reduce checks that
    the ranks gave one seed, or exactly Megatron-LM's ``seed + 100 * pipeline rank`` (the
    pipeline rank from the parallel state), whose base then keys init and masks; anything else
    raises :class:`~rng_tracker.errors.InvariantSeedError` on every rank, changing nothing.
    """
    layout: ParallelLayout | None = None
    invariant = invariant_installed()
    failure: Exception | None = None
    try:
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset_rng = _flags(
            te_rng_tracker=te_rng_tracker,
            inference_rng_tracker=inference_rng_tracker,
            use_cudagraphable_rng=use_cudagraphable_rng,
            force_reset_rng=force_reset_rng,
        )
        layout = process_layout()  # the facade is the edge: the process-wide layout, once
        plan, extra = _megatron_seeds(
            seed,
            layout,
            tp_rank,
            ep_rank,
            etp_rank,
            gtp_remat_rank,
            egtp_remat_rank,
            gtp_remat_world_size,
            egtp_remat_world_size,
            keeps_streams=_keeps_streams(inference_rng_tracker, force_reset_rng),
        )
        # what the tracker's generator cannot tell apart (on CPU, seeds equal modulo 2**32),
        # refused before initialize_rng_tracker may replace the tracker
        check_stream_seeds(default_device(), {**plan.stream_seeds, **extra})
    except Exception as exc:
        if not invariant:
            raise
        failure = exc  # every rank must reach the agreement on the keyed seed first
    keyed_seed = _invariant_seed(seed, layout, failure) if invariant else None
    initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = get_cuda_rng_tracker()
    apply_seed_plan(plan, tracker, extra)  # the plan made (and checked) above: planned once
    if keyed_seed is not None:  # invariant mode's keyed state is (the run's seed, step 0)
        get_keyed_rng().manual_seed(keyed_seed)
    with_extra = dataclasses.replace(plan, stream_seeds={**plan.stream_seeds, **extra})
    return _placed_on_mesh(with_extra, layout)  # every seed this rank set, the GTP-remat ones too


def set_step(step: int) -> None:
    """Move invariant mode's keyed randomness to optimizer step ``step`` (in [0, 2**32)).

    Call it once per optimizer step, with the same step on every rank, before the step's
    forwards: every keyed mask then depends on it, and on nothing else that changes per step.
    """
    get_keyed_rng().set_step(step)


def _placed_on_mesh(plan: SeedPlan, layout: ParallelLayout | None) -> SeedPlan:
    """The plan with ``layout``'s pp/dp/cp coordinates: Megatron folds them into ``seed`` before
    the call, so the plan records where the rank really is and verifies against the mesh."""
    if layout is None:
        return plan
    placed = {axis: layout.rank(axis) for axis in ("pp", "dp", "cp")}
    return dataclasses.replace(plan, coordinates={**plan.coordinates, **placed})


# -- whole-process RNG snapshots (Megatron's private helpers) ---------------------------------
def _get_all_rng_states() -> tuple[torch.Tensor, RNGState, dict[str, RNGState]]:
    """Copies of the CPU state, the current device's state and the Megatron tracker's streams."""
    tracker = get_cuda_rng_tracker()
    device_state = _get_cuda_rng_state(
        graph_safe=is_graph_safe_cuda_rng_tracker(tracker), clone=True
    )
    return torch.get_rng_state(), device_state, tracker.get_states()


def _set_all_rng_states(
    cpu_rng_state: torch.Tensor,
    cuda_rng_state: RNGState,
    cuda_rng_state_tracker: Mapping[str, RNGState],
) -> None:
    """Install what :func:`_get_all_rng_states` returned; all three are checked first, so a
    refused one (:class:`~rng_tracker.errors.TrackerDeviceError`) changes nothing."""
    _check_cpu_state(cpu_rng_state)
    device = device_rng(None, generator_states=False)
    device_state = device.convert(cuda_rng_state)
    get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)
    device.install(device_state)
    torch.set_rng_state(plain_state(cpu_rng_state))


def _check_cpu_state(state: object) -> None:
    if not isinstance(state, torch.Tensor):
        raise TrackerDeviceTypeError(
            f"the CPU RNG state is a uint8 tensor (what torch.get_rng_state() returns), got "
            f"{type(state).__name__}"
        )
    device_rng("cpu", generator_states=False).check(state)


@contextlib.contextmanager
def _fork_rng() -> Iterator[None]:
    """Run the body, then put every RNG state back as it was on entry."""
    states = _get_all_rng_states()
    try:
        yield
    finally:
        _set_all_rng_states(*states)


# -- checkpointing -------------------------------------------------------------------------
_cuda_graphs_module = OptionalModule("megatron.core.transformer.cuda_graphs")


def _megatron_graphs_warming_up(*, or_capturing: bool = False) -> bool:
    """Whether megatron-core's CUDA graphs are warming up (or capturing): its checkpoints then
    run the function plainly, since a recompute cannot run inside a captured graph. Its module
    is only looked up: a process that never imported it has no graphs of it."""
    graphs = _cuda_graphs_module()
    if graphs is None:
        return False
    return graphs.is_graph_warmup() or (or_capturing and graphs.is_graph_capturing())


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Megatron's positional checkpoint: reentrant, replaying every tracker stream.

    With ``distribute_saved_activations`` the caller's ``args[0].data`` keeps only this
    rank's 1/tp chunk until backward, as in Megatron. While megatron-core's CUDA graphs warm
    up or capture, the function runs plainly, as Megatron's checkpoint does.
    """
    distribute_saved_activations = _flag(
        distribute_saved_activations,
        "checkpoint(function, distribute_saved_activations, *args)'s flag",
    )
    if _megatron_graphs_warming_up(or_capturing=True):
        return function(*args)
    group = None
    if distribute_saved_activations:
        check_split_input(args)
        group = _tp_group_of_parallel_state()
    return reentrant_checkpoint(function, *args, split_group=group)


def _tp_group_of_parallel_state() -> torch.distributed.ProcessGroup:
    layout = process_layout()  # the facade is the edge
    if layout is None:
        raise CheckpointConfigError(
            "distribute_saved_activations=True needs an initialised parallel state "
            "(Megatron's parallel_state.initialize_model_parallel, or "
            "rng_tracker.parallel.init_model_parallel); or call "
            "rng_tracker.checkpoint(..., distribute_saved_activations=True, tp_group=...)"
        )
    return layout.group("tp")


class CheckpointFunction:
    """Megatron's autograd Function name: ``CheckpointFunction.apply(function,
    distribute_saved_activations, *args)`` is :func:`checkpoint`."""

    @staticmethod
    def apply(
        run_function: Callable[..., Any], distribute_saved_activations: bool, *args: Any
    ) -> Any:
        """Checkpoint ``run_function(*args)`` (see :func:`checkpoint`)."""
        return checkpoint(run_function, distribute_saved_activations, *args)


class CheckpointWithoutOutput(_without_output.CheckpointWithoutOutput):
    """Megatron's ``CheckpointWithoutOutput`` (:class:`rng_tracker.CheckpointWithoutOutput`). While
    megatron-core's CUDA graphs warm up, it checkpoints, discards and recomputes nothing, as
    Megatron's does (the discard may come in a separate warmup)."""

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without saving its output (see the base class)."""
        if _megatron_graphs_warming_up():
            return run_function(*args)
        return super().checkpoint(run_function, *args)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' memory now; refill it when backward reaches ``hook_tensor``."""
        if _megatron_graphs_warming_up():
            return
        super().discard_output_and_register_recompute(hook_tensor)

    def _recompute(self, grad: Any) -> None:
        if _megatron_graphs_warming_up():
            return
        super()._recompute(grad)


# -- routing megatron-core's own modules here ------------------------------------------------
def install(*, invariant: bool = False, allow_unknown_version: bool = False) -> None:
    """Make megatron-core's own code use this module on any device.

    Imports ``megatron.core.tensor_parallel.random`` and replaces its names that this module
    provides, in it and in every imported megatron module bound to the same objects (and
    megatron's CPU init helper, so experts draw from the expert-parallel stream). Modules
    imported afterwards bind the replacements. ``invariant=True`` also makes megatron-core's
    init and every dropout and jitter mask a pure function of (seed, step, site, global index):
    the same values on any layout (see docs/migrating.md, "Invariant mode"). Calling it again
    in the same mode does nothing; in the other mode it raises
    :class:`~rng_tracker.errors.MegatronInstallError` (``uninstall()`` first). Raises
    :class:`~rng_tracker.errors.MegatronVersionError` (changing nothing) when megatron-core is
    missing or of a version not in :data:`KNOWN_MEGATRON_CORE_VERSIONS` (for
    ``invariant=True``: not in :data:`KNOWN_KEY_SCHEMES`, whatever ``allow_unknown_version``
    says).
    """
    _megatron_install.install(
        {name: globals()[name] for name in (*__all__, *_MEGATRON_HELPERS)},
        invariant=invariant,
        allow_unknown_version=allow_unknown_version,
    )


def __getattr__(name: str) -> Any:
    # Megatron's module-level flag, read live (a plain global here would never change).
    if name == "IS_CHECKPOINTING":
        return is_checkpointing()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
