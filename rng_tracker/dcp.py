"""RNG state in any checkpoint, resumable on any layout, O(1) bytes per rank, checked end to end.

Put an :class:`RNGStateful` in the state dict given to ``dcp.save``/``dcp.load``, at its top level
or inside a ``Stateful`` there (or in torchtitan's ``CheckpointManager`` states, or accelerate's
``register_for_checkpointing``): it saves this
process's default generators (CPU and accelerator), the rng_tracker streams and the keyed RNG
state. docs/resume.md has the whole story; in short:

- **Entries.** ``shared`` holds the keyed state and every generator or stream that is equal on
  every rank (the same bytes on each rank: DCP keeps one copy, pytorch#120356, so it is written
  once); ``rank<r>`` holds rank r's own states (the parts that differ between ranks) and is
  written by rank r. Under DCP each rank returns ``shared`` and its own entry: O(1) bytes per rank
  at any world size. Where only the main process writes (accelerate's ``save_state``, a
  ``torch.save`` on rank 0) the entries are gathered to it: O(world) there, O(1) elsewhere; where
  each node writes (accelerate's ``save_on_each_node=True``), to every process: O(world) on each.
- **Checks.** Every entry carries a BLAKE2b checksum over its key and bytes. A load parses and
  checks everything it was given and what it will restore, then all ranks agree (one small
  all-reduce) before any rank changes anything. A save refuses, before writing, what no load could
  restore (ranks with different streams, keyed states or layouts).
- **Layouts.** The same layout (world size, ``layout=`` and each rank's coordinates) restores
  every state bitwise. On another layout the keyed state and the shared states are restored, and
  each per-rank part is re-derived from (the run's seed, the saved step, the rank's new
  coordinates on the axes that part varied over when saved), with one
  :class:`RNGStateRederivedWarning` naming them; so is a shared stream of the library's seeding
  policy that must now vary over an axis that had one rank at the save. ``strict=True`` raises
  :class:`RNGStateLayoutError` instead.

:class:`RankStates` is the lower-level container (given ranks' states under ``rank<r>`` keys
and the keyed state as JSON) for a job that gathers states itself and saves from one process,
as the demo trainer does.
"""

from __future__ import annotations

import copy
import hashlib
import io
import operator
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from rng_tracker._accelerate_context import accelerate_saves_on_each_node
from rng_tracker._collective import as_bytes, as_uint8, collective_device
from rng_tracker._dcp_context import find_dcp_call, saved_keys
from rng_tracker._device_rng import default_device, default_generator, device_rng
from rng_tracker._keyed import KeyedRNG, get_keyed_rng
from rng_tracker._layout import ParallelLayout, process_layout
from rng_tracker._rng_entries import (
    FORMAT,
    MAX_RANK,
    canonical,
    check_rank_entry,
    check_shared_header,
    decode_entry,
    encode_entry,
    format1_parts,
    is_entry_key,
    is_rank_key,
    split_blob,
)
from rng_tracker._streams import DEFAULT_STREAM, POLICY_STREAMS, stream_axes
from rng_tracker._tracker import STATE_DICT_VERSION as TRACKER_STATE_VERSION
from rng_tracker._tracker import RNGStatesTracker, all_trackers, get_rng_tracker
from rng_tracker._validate import (
    checked_flag,
    checked_instance,
    checked_int,
    checked_size,
    refuse_repeat,
    shown_value,
)
from rng_tracker.errors import (
    ArgumentTypeError,
    ParallelConfigTypeError,
    RankError,
    RNGStateConfigError,
    RNGStateConfigTypeError,
    RNGStateLayoutError,
    RNGStateRederivedWarning,
    RNGStateSaveError,
    RNGTrackerError,
    StateDictError,
    StateDictTypeError,
    TrackerBusyError,
)

__all__ = ["FORMAT", "RNGStateful", "RankStates", "SavedBy"]

SavedBy = Literal["auto", "each_rank", "main_process", "each_node"]
_SAVED_BY = ("auto", "each_rank", "main_process", "each_node")
_AXES = ("tp", "cp", "dp", "pp", "ep", "etp")  # a ParallelState's axes, in a fixed order
_WORD = (1 << 62) - 1  # digest words are 62-bit, so -word fits an int64 (MAX gives min and max)


class RankStates:
    """Several ranks' RNG states and the keyed state, as a DCP ``Stateful``.

    ``per_rank`` maps a global rank to its states (any nest of dicts of tensors); each lands
    under its own key ``rank<r>``, so DCP's deduplication of equal keys cannot drop a rank.
    ``keyed`` (the keyed RNG's state, e.g. as JSON) is the same on every rank and stored once.
    """

    def __init__(
        self, per_rank: dict[int, dict[str, Any]] | None = None, keyed: str | None = None
    ) -> None:
        _check_per_rank(per_rank)
        _check_keyed_text(keyed)
        self.per_rank = per_rank or {}
        self.keyed = keyed

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f"rank{operator.index(r)}": states for r, states in self.per_rank.items()
        }
        if self.keyed is not None:
            out["keyed"] = self.keyed
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise StateDictTypeError(
                f"expected the mapping RankStates.state_dict() returns, got "
                f"{type(state_dict).__name__}"
            )
        unknown = [k for k in state_dict if k != "keyed" and not is_rank_key(k)]
        if unknown:
            raise StateDictError(
                f"RankStates entries are 'rank<r>' (r a global rank) and 'keyed'; got "
                f"{', '.join(sorted(map(repr, unknown))[:8])}: it was not written by "
                "RankStates.state_dict()"
            )
        per_rank = {int(key[4:]): value for key, value in state_dict.items() if key != "keyed"}
        _check_per_rank(per_rank)
        keyed = state_dict.get("keyed")
        _check_keyed_text(keyed)
        self.per_rank = per_rank
        self.keyed = keyed


def _check_per_rank(per_rank: object) -> None:
    """Refuse a ``per_rank`` that is not a mapping of global rank to a mapping of states."""
    if per_rank is None:
        return
    checked_instance(
        per_rank,
        Mapping,
        "per_rank must map each global rank to its states (a dict)",
        error=StateDictTypeError,
    )
    for rank, states in per_rank.items():
        checked_int(
            rank,
            "a per_rank key (a global rank)",
            type_error=StateDictTypeError,
            value_error=RankError,
            minimum=0,
            maximum=MAX_RANK,
        )
        checked_instance(
            states,
            Mapping,
            f"per_rank[{rank!r}] must be a mapping of states (a dict of tensors)",
            error=StateDictTypeError,
        )


def _check_keyed_text(keyed: object) -> None:
    if keyed is not None and not isinstance(keyed, str):
        raise StateDictTypeError(
            f"keyed must be the keyed RNG's state as a str (e.g. JSON) or None, got "
            f"{type(keyed).__name__}"
        )


def _layout_text(layout: object) -> str:
    if layout is None:
        return ""
    if isinstance(layout, str):
        return layout
    if isinstance(layout, Mapping):
        return ",".join(
            f"{_axis_name(k)}={checked_size(v, f'layout[{k!r}] (an axis size)')}"
            for k, v in layout.items()
        )
    shape = getattr(layout, "shape", None)  # a DeviceMesh
    if shape is not None:
        names = getattr(layout, "mesh_dim_names", None) or [f"dim{i}" for i in range(len(shape))]
        return ",".join(f"{n}={int(s)}" for n, s in zip(names, shape, strict=True))
    raise StateDictTypeError(
        f"layout must be a str, a mapping of axis sizes, a DeviceMesh or a ParallelLayout (e.g. "
        f"rng_tracker.parallel.ParallelState), got {type(layout).__name__}"
    )


def _axis_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ParallelConfigTypeError(
            f"layout's axis names must be non-empty strs (e.g. {{'tp': 2}}), got {name!r}"
        )
    return name


# --- collectives, counted (scripts/bench_rng_checkpoint.py reads the counts) -----------------

# Process-wide: a count of this process's traffic, whichever thread saved or loaded.
_COMM = {"sent": 0, "received": 0}


def comm_bytes() -> dict[str, int]:
    """Bytes this process's RNGStateful collectives sent and received so far (an all-reduce of n
    bytes counts 2n each way: the bound of a ring all-reduce)."""
    return dict(_COMM)


def _all_reduce_max(values: list[int], group: Any) -> list[int]:
    data = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(data, op=dist.ReduceOp.MAX, group=group)
    _COMM["sent"] += 2 * data.nbytes
    _COMM["received"] += 2 * data.nbytes
    return [int(v) for v in data.cpu().tolist()]


def _gather(payload: bytes, group: Any, *, everywhere: bool) -> list[bytes] | None:
    """Every rank's ``payload``: on the group's rank 0 only (None elsewhere), O(world) there; or,
    ``everywhere``, on every rank (an all-gather: O(world) on each)."""
    (longest,) = _all_reduce_max([len(payload)], group)
    device = collective_device(group)
    data = torch.zeros(8 + longest, dtype=torch.uint8, device=device)
    data[:8] = as_uint8(len(payload).to_bytes(8, "little"), device)
    data[8 : 8 + len(payload)] = as_uint8(payload, device)
    world = dist.get_world_size(group)
    if everywhere:
        parts = [torch.empty_like(data) for _ in range(world)]
        dist.all_gather(parts, data, group=group)
        _COMM["sent"] += data.nbytes * (world - 1)  # the bound of a ring all-gather
    else:
        main = dist.get_rank(group) == 0
        parts = [torch.empty_like(data) for _ in range(world)] if main else []
        dist.gather(data, parts or None, group=group, group_dst=0)
        if not main:
            _COMM["sent"] += data.nbytes
            return None
    _COMM["received"] += data.nbytes * (world - 1)
    out = []
    for part in parts:
        raw = as_bytes(part)
        out.append(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return out


def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _digest(data: bytes) -> tuple[int, int]:
    raw = hashlib.blake2b(data, digest_size=16, person=b"rng_tracker.same").digest()
    return int.from_bytes(raw[:8], "little") & _WORD, int.from_bytes(raw[8:], "little") & _WORD


def _spread(words: tuple[int, int]) -> list[int]:
    """A digest as [w0, -w0, w1, -w1]: after an all-reduce MAX, equal everywhere iff max == min."""
    return [words[0], -words[0], words[1], -words[1]]


def _same(reduced: list[int]) -> bool:
    return reduced[0] == -reduced[1] and reduced[2] == -reduced[3]


# --- this rank's states ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Part:
    """One generator state: ``cpu``, ``device`` or ``stream/<name>``, its bytes, a stream's seed."""

    name: str
    state: bytes
    seed: int | None = None

    @property
    def label(self) -> str:
        if self.name == "cpu":
            return "the CPU default generator"
        if self.name == "device":
            return "the device default generator"
        return f"tracker stream {self.name[len('stream/') :]!r}"


def _label(name: str) -> str:
    return _Part(name, b"").label


def _policy_axes(name: str) -> tuple[str, ...]:
    """The axes the library's seeding varies part ``name`` over (a default generator as the
    default stream); () for a stream with no declared policy."""
    stream = DEFAULT_STREAM if name in ("cpu", "device") else name[len("stream/") :]
    return stream_axes(stream) if stream in POLICY_STREAMS else ()


Coordinates = dict[str, tuple[int, int, Any]]  # axis -> (this rank's coordinate, size, group)


def _placed(coordinates: Coordinates) -> dict[str, int]:
    """This rank's coordinates on the axes of size > 1 (where a rank order shows)."""
    return {axis: c for axis, (c, size, _) in coordinates.items() if size > 1}


def _fresh_state(seed: int) -> bytes:
    return as_bytes(torch.Generator().manual_seed(seed).get_state())


def _refuse_equal_streams(parts: list[_Part], device: torch.device) -> None:
    """Refuse, as every load would, two streams of one state (only a forged snapshot given to
    ``restore_states`` gets a tracker there): they would draw identical values. Compared by what
    is drawn (a CPU state's stored seed aside)."""
    rng = device_rng(device)
    refuse_repeat(
        (
            (p.name, rng.drawn_key(as_uint8(p.state, torch.device("cpu"))))
            for p in parts
            if p.name.startswith("stream/")
        ),
        lambda first, second, _: (
            f"{_label(first)} and {_label(second)} hold the same generator state, which no "
            "load restores (they would draw identical values); give each stream its own seed"
        ),
    )


@dataclass
class _Plan:
    """What a load will install, chosen and checked before anything changes."""

    cpu: torch.Tensor | None = None
    device: torch.Tensor | None = None
    tracker: dict[str, Any] | None = None
    keyed: dict[str, Any] | None = None
    rederived: list[str] = field(default_factory=list)


@dataclass
class _Choice:
    """The states a load takes from the checkpoint, and the parts it must re-derive instead."""

    states: dict[str, tuple[bytes, int | None]]
    shared: dict[str, Any]
    rederive: list[str]
    coordinates: Coordinates  # this rank's on the load's layout, which re-derivation uses


class RNGStateful:
    """This process's RNG state as a checkpoint ``Stateful``: default generators, streams, keyed.

    Args:
        tracker: the rng_tracker tracker whose streams to save; None means the process's
            tracker for the default device (``get_rng_tracker()``) at each save and load, so a
            reseed that replaces it (Megatron's ``force_reset_rng=True``) is followed.
        keyed: the keyed RNG; None means ``get_keyed_rng()`` at each save and load (saved only
            once seeded).
        layout: what makes two runs' per-rank states interchangeable: a str, a mapping of
            axis sizes (``{"tp": 2, "dp": 2}``), the DeviceMesh (whose named axes then also
            give each rank's coordinates) or a :class:`~rng_tracker.ParallelLayout` (its axis
            sizes and this rank's coordinates, as for the process's). The world size always
            counts. None: the process's parallel state (rng_tracker's or Megatron's) when one is
            set up.
        strict: on another layout, raise :class:`RNGStateLayoutError` instead of re-deriving the
            per-rank parts that cannot move.
        step: the trainer's step (a callable, e.g. ``lambda: train_state.step``): saved as the
            step re-derivation uses, and a save refuses a keyed step that is not it.
        saved_by: who writes the entries: ``"each_rank"`` (DCP: every rank its own, O(1) per
            rank), ``"main_process"`` (gathered to rank 0, e.g. accelerate's ``save_state``),
            ``"each_node"`` (every rank's on every process, for a trainer that writes a file on
            each node: accelerate's ``save_on_each_node=True``), or ``"auto"``: ``"each_rank"``
            inside ``dcp.save``/``async_save``, ``"each_node"`` inside accelerate's ``save_state``
            with ``save_on_each_node=True``, else ``"main_process"``.

    ``state_dict()`` and ``load_state_dict()`` are collective where torch.distributed is
    initialised (every rank calls them, as ``dcp.save``/``dcp.load`` and accelerate do).
    """

    def __init__(
        self,
        tracker: RNGStatesTracker | None = None,
        keyed: KeyedRNG | None = None,
        *,
        layout: object = None,
        strict: bool = False,
        step: Callable[[], int] | None = None,
        saved_by: SavedBy = "auto",
    ) -> None:
        if not isinstance(saved_by, str) or saved_by not in _SAVED_BY:
            raise (RNGStateConfigError if isinstance(saved_by, str) else RNGStateConfigTypeError)(
                f"saved_by must be one of {', '.join(map(repr, _SAVED_BY))}, got "
                f"{shown_value(saved_by)}"
            )
        if step is not None and not callable(step):
            raise RNGStateConfigTypeError(
                f"step must be a callable returning the trainer's step (e.g. lambda: "
                f"train_state.step), got {type(step).__name__}"
            )
        strict = checked_flag(strict, "strict", type_error=RNGStateConfigTypeError)
        if tracker is not None:
            checked_instance(
                tracker,
                RNGStatesTracker,
                "tracker must be an RNGStatesTracker (e.g. get_rng_tracker()) or None",
            )
        if keyed is not None:
            checked_instance(
                keyed, KeyedRNG, "keyed must be a KeyedRNG (e.g. get_keyed_rng()) or None"
            )
        # a ParallelLayout is read at each save and load, as the process's is without one
        self._parallel_layout = layout if isinstance(layout, ParallelLayout) else None
        self.layout = "" if self._parallel_layout is not None else _layout_text(layout)
        self._device = default_device()
        self._tracker, self._keyed = tracker, keyed  # None: the process's, at each save and load
        self._mesh = layout if getattr(layout, "mesh_dim_names", None) is not None else None
        self.strict = strict
        self.saved_by: SavedBy = saved_by
        self._step = step

    def __deepcopy__(self, memo: dict[int, Any]) -> RNGStateful:
        """A copy that saves and loads the same tracker, keyed RNG and layout: they are this
        process's, like the generators, and a clone of them would restore nothing that draws."""
        for live in (self._tracker, self._keyed, self._parallel_layout, self._mesh):
            if live is not None:
                memo[id(live)] = live
        twin = object.__new__(RNGStateful)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin

    def __getstate__(self) -> dict[str, Any]:
        if self._tracker is not None or self._keyed is not None:
            raise ArgumentTypeError(
                "RNGStateful(tracker=..., keyed=...) saves and loads this process's own objects "
                "and cannot be pickled (unpickled, it would load into copies of them); pickle its "
                "state_dict(), or make it with tracker=None and keyed=None (the process's, found "
                "at each save and load)"
            )
        return self.__dict__

    @property
    def tracker(self) -> RNGStatesTracker:
        """The tracker saved and loaded: the one given, else the process's at this moment (a
        reseed that replaces it, as ``force_reset_rng=True`` does, is followed)."""
        return self._tracker if self._tracker is not None else get_rng_tracker(self._device)

    @property
    def keyed(self) -> KeyedRNG:
        """The keyed RNG saved and loaded: the one given, else the process's at this moment."""
        return self._keyed if self._keyed is not None else get_keyed_rng(self._device)

    def _open_forks_over_generators(self) -> str | None:
        """The open forks of any tracker of the saved generators' devices, described, or None.
        Inside one, a default generator holds a stream's state, not its own."""
        devices = {torch.device("cpu"), self._device}
        busy = [
            f"{list(t.open_forks())} of the {t.device} tracker"
            for t in all_trackers()
            if t.open_forks() and t.device in devices
        ]
        return "; ".join(busy) if busy else None

    # -- where this rank sits -------------------------------------------------------------
    def _coordinates(self, group: Any) -> Coordinates:
        """Axis -> (coordinate, size, group) from ``layout``'s DeviceMesh, else the process's
        parallel state; {} when neither describes the whole world."""
        world = _world(group)[1]
        if world == 1:
            return {}
        mesh = self._mesh
        if mesh is not None and mesh.size() == world and mesh.get_coordinate() is not None:
            coordinate = mesh.get_coordinate()
            return {
                str(name): (int(coordinate[i]), int(mesh.size(i)), mesh.get_group(i))
                for i, name in enumerate(mesh.mesh_dim_names)
            }
        state = self._parallel_layout or process_layout()
        if state is None or state.world_size != world:
            return {}
        out = {}
        for axis in _AXES:
            try:
                out[axis] = (state.rank(axis), state.size(axis), state.group(axis))
            except Exception:  # an axis this parallel state does not have
                continue
        return out

    def _layout_key(self) -> str:
        """``layout=`` as given; without one, the axis sizes of the process's parallel state, so
        that a save at TP=2 x PP=2 is not taken for one at TP=4 of the same world size."""
        if self.layout:
            return self.layout
        state = self._parallel_layout or process_layout()
        if state is None:
            return ""
        sizes = []
        for axis in _AXES:
            try:
                sizes.append(f"{axis}={state.size(axis)}")
            except Exception:  # an axis this parallel state does not have
                continue
        return ",".join(sizes)

    def _trainer_step(self) -> int | None:
        if self._step is None:
            return None
        return checked_int(
            self._step(),
            "the trainer's step",
            type_error=RNGStateConfigTypeError,
            value_error=RNGStateConfigError,
            minimum=0,
        )

    def _parts(self) -> list[_Part]:
        parts = [_Part("cpu", as_bytes(torch.get_rng_state()))]
        if self._device.type != "cpu":
            parts.append(_Part("device", as_bytes(default_generator(self._device).get_state())))
        streams = self.tracker.state_dict()["streams"]
        for name in sorted(streams):
            entry = streams[name]
            parts.append(_Part(f"stream/{name}", as_bytes(entry["state"]), entry["seed"]))
        return parts

    # -- save -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, bytes]:
        """``shared`` and this rank's ``rank<r>`` entry (all ranks' on the main process when it
        alone writes, on every process when each node writes); inside ``dcp.load``, the entries
        of the checkpoint this rank will read."""
        call = find_dcp_call(self)
        if call is not None and call.kind == "load":
            return self._load_template(call)
        group = call.process_group if call is not None else None
        single = call is not None and call.no_dist
        saved_by = self.saved_by
        if saved_by == "auto" and call is not None:
            saved_by = "each_rank"
        elif saved_by == "auto":
            saved_by = "each_node" if accelerate_saves_on_each_node(self) else "main_process"
        shared, mine, rank = self._entries(group, single=single)
        if saved_by != "each_rank" and not single and _world(group)[1] > 1:
            everyone = _gather(mine, group, everywhere=saved_by == "each_node")
            if everyone is not None:
                return {"shared": shared, **{f"rank{r}": e for r, e in enumerate(everyone)}}
        return {"shared": shared, f"rank{rank}": mine}

    def _entries(self, group: Any, *, single: bool) -> tuple[bytes, bytes, int]:
        rank, world = (0, 1) if single else _world(group)
        layout, parts, keyed, trainer_step = "", [], None, None
        problem, cause = None, None
        forks = self._open_forks_over_generators()
        try:  # any failure here is agreed on below, so that every rank refuses
            if forks is not None:
                raise TrackerBusyError(
                    f"cannot save RNG state inside open fork(s) {forks}: the generator then "
                    "holds a stream's state, not its own; save outside any fork"
                )
            layout = self._layout_key()
            parts = self._parts()
            _refuse_equal_streams(parts, self.tracker.device)
            keyed = self.keyed.state_dict() if self.keyed.seed is not None else None
            trainer_step = self._trainer_step()
        except Exception as exc:
            cause = exc
            problem = (
                str(exc) if isinstance(exc, RNGTrackerError) else f"{type(exc).__name__}: {exc}"
            )
        if keyed is not None and trainer_step is not None and keyed["step"] != trainer_step:
            problem = (
                f"the keyed step {keyed['step']} is not the trainer's step {trainer_step}: a resume "
                "would draw the masks of another step; drive the keyed step from the trainer "
                "(keyed.set_step(train_state.step) before each step)"
            )
        fields = {
            "generators and tracker streams": [p.name for p in parts] + [self.tracker.device.type],
            "keyed RNG states (seed, step or sites)": keyed,
            "layouts (world size, layout=)": [world, layout],
            "trainer steps": trainer_step,
        }
        local = [1 if problem else 0, rank if problem else -1]
        for value in fields.values():
            local += _spread(_digest(canonical(value)))
        nonce = os.urandom(16) if rank == 0 else b""  # not torch's RNG: saving must not draw
        seed = self.keyed.seed if keyed is not None else torch.initial_seed()
        if rank == 0:
            local += [
                int.from_bytes(nonce[:8], "little") >> 2,
                int.from_bytes(nonce[8:], "little") >> 2,
            ]
            local += [seed >> 32, seed & 0xFFFFFFFF]
        else:
            local += [-1, -1, -1, -1]
        agreed = local if world == 1 else _all_reduce_max(local, group)
        if agreed[0]:
            if problem:
                raise RNGStateSaveError(f"{problem}; nothing was written") from cause
            raise RNGStateSaveError(
                f"rank {agreed[1]} refused to save its RNG state (see its error); nothing was "
                "written by any rank"
            )
        for index, what in enumerate(fields):
            if not _same(agreed[2 + 4 * index : 6 + 4 * index]):
                raise RNGStateSaveError(
                    f"the ranks hold different {what}, so no load could restore them (a rank "
                    "would take another rank's copy); give every rank the same tracker streams, "
                    "keyed seed and step, and layout= before saving. Nothing was written"
                )
        tail = agreed[2 + 4 * len(fields) :]
        nonce_hex = (tail[0].to_bytes(8, "little") + tail[1].to_bytes(8, "little")).hex()
        run_seed = (tail[2] << 32) | tail[3]

        coordinates = self._coordinates(group)
        placed = _placed(coordinates)
        replicated, axes = self._variation(parts, group, world, coordinates)
        # A policy axis of size 1 here shows nothing: a part equal across it now must still vary
        # over it where a resume gives it more ranks (model-parallel-rng saved at TP=1).
        for p in parts:
            measured = axes.get(p.name, [])
            axes[p.name] = measured + [
                a for a in _policy_axes(p.name) if a not in placed and a not in measured
            ]
        shared_parts = [p for p in parts if replicated[p.name]]
        own = [p for p in parts if not replicated[p.name]]
        step = keyed["step"] if keyed is not None else trainer_step
        shared_header = {
            "kind": "shared",
            "format": FORMAT,
            "nonce": nonce_hex,
            "world": world,
            "layout": layout,
            "run_seed": run_seed,
            "step": step,
            "trainer_step": trainer_step,
            "keyed": keyed,
            "tracker": {"version": TRACKER_STATE_VERSION, "device_type": self.tracker.device.type},
            "parts": [
                {
                    "name": p.name,
                    "replicated": replicated[p.name],
                    "nbytes": len(p.state) if replicated[p.name] else 0,
                    "seed": p.seed if replicated[p.name] else None,
                    "axes": axes.get(p.name, []),
                }
                for p in parts
            ],
        }
        shared = encode_entry("shared", shared_header, [p.state for p in shared_parts])
        mine_header = {
            "kind": "rank",
            "format": FORMAT,
            "rank": rank,
            "world": world,
            "nonce": nonce_hex,
            "shared": hashlib.blake2b(shared, digest_size=32).hexdigest(),
            "parts": [{"name": p.name, "nbytes": len(p.state), "seed": p.seed} for p in own],
            "at": placed,
        }
        mine = encode_entry(f"rank{rank}", mine_header, [p.state for p in own])
        return shared, mine, rank

    def _variation(
        self, parts: list[_Part], group: Any, world: int, coordinates: Coordinates
    ) -> tuple[dict[str, bool], dict[str, list[str]]]:
        """Which parts are equal on every rank, and for the others the axes they vary over."""
        if world == 1:
            return {p.name: True for p in parts}, {}
        digests = [_digest(p.state + canonical(p.seed)) for p in parts]
        local = [w for d in digests for w in _spread(d)]
        reduced = _all_reduce_max(local, group)
        replicated = {p.name: _same(reduced[4 * i : 4 * i + 4]) for i, p in enumerate(parts)}
        varying = [i for i, p in enumerate(parts) if not replicated[p.name]]
        if not varying:
            return replicated, {}
        names = sorted(a for a, (_, size, _) in coordinates.items() if size > 1)
        flags = []
        for axis in names:
            sub = _all_reduce_max(
                [w for i in varying for w in _spread(digests[i])], coordinates[axis][2]
            )
            flags += [0 if _same(sub[4 * j : 4 * j + 4]) else 1 for j in range(len(varying))]
        flags = _all_reduce_max(flags, group) if flags else []
        axes = {}
        for j, i in enumerate(varying):
            over = [axis for a, axis in enumerate(names) if flags[a * len(varying) + j]]
            axes[parts[i].name] = over or ["rank"]
        return replicated, axes

    # -- load -------------------------------------------------------------------------------
    def _load_template(self, call: Any) -> dict[str, bytes]:
        """The entries this rank reads in ``call``: ``shared``, and its own one where the
        checkpoint has as many ranks as this run (another world re-derives per-rank parts)."""
        keys = saved_keys(call, is_entry_key)
        rank, world = (0, 1) if call.no_dist else _world(call.process_group)
        if "shared" in keys:
            saved_world = sum(1 for key in keys if is_rank_key(key))
            own = f"rank{rank}"
            wanted = ["shared"] + ([own] if saved_world == world and own in keys else [])
            return dict.fromkeys(wanted, b"")
        if keys == {"blob"}:
            return {"blob": b""}
        where = f"{'inside' if call.nested else 'under'} {call.key!r}"
        raise StateDictError(
            f"the checkpoint holds no RNG state {where} (it has {sorted(keys)[:8] or 'no'} "
            f"entries there): it was saved without RNGStateful, or under another key; load it "
            f"without {call.key!r}, or from a checkpoint that has it"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore by the rules of the module docstring; on any refusal nothing changes on any rank."""
        call = find_dcp_call(self)
        group = call.process_group if call is not None else None
        single = call is not None and call.no_dist
        rank, world = (0, 1) if single else _world(group)
        plan: _Plan | None = None
        error: BaseException | None = None
        moved_here: tuple[dict[str, int], dict[str, int]] | None = None
        moved_plan: _Plan | None = None
        try:
            choice, if_moved = self._plan(state_dict, rank, world, group)
            if isinstance(choice, _Plan):  # format 1
                plan = choice
            else:
                plan = self._decide(choice, rank, group)
                if if_moved is not None:
                    moved_here = if_moved[1]
                    if not self.strict:  # checked now, so every rank can take it if one moved
                        moved_plan = self._decide(if_moved[0], rank, group)
        except Exception as exc:  # every rank must reach the agreement below, whatever failed
            error = exc
        moved = moved_here is not None
        if world > 1:
            bad, who, moved_flag = _all_reduce_max(
                [1 if error else 0, rank if error else -1, 1 if moved else 0], group
            )
            moved = bool(moved_flag)
            if bad and error is None:
                error = StateDictError(
                    f"rank {who} refused the RNG state (see its error), so no rank restores "
                    "any of it: every generator, stream and keyed state is as it was"
                )
        if error is not None:
            raise error
        assert plan is not None
        if moved:
            if moved_plan is None:  # strict
                where = (
                    ""
                    if moved_here is None
                    else f" (rank {rank}: {moved_here[0]}, now {moved_here[1]})"
                )
                raise RNGStateLayoutError(
                    "the checkpoint was saved with this run's world size and axis sizes but in "
                    f"another rank order{where}, so each rank's own RNG states belong to another "
                    "position; resume in the saved rank order, or pass strict=False to re-derive "
                    "them"
                )
            plan = moved_plan
        self._apply(plan)
        if plan.rederived:
            warnings.warn(
                "the checkpoint was saved on another layout (or rank order): re-derived "
                f"{', '.join(_label(n) for n in plan.rederived)} from the run's seed, the saved "
                "step and this rank's coordinates (they differed between the saved ranks, or "
                "must differ here along an axis that had one rank there, so they cannot move); "
                "the keyed state and the other shared states were restored. Pass strict=True to "
                "refuse instead",
                RNGStateRederivedWarning,
                stacklevel=2,
            )

    def _plan(
        self, state_dict: object, rank: int, world: int, group: Any
    ) -> tuple[_Choice | _Plan, tuple[_Choice, tuple[Any, Any] | None] | None]:
        """What this rank would restore, and, on the saved layout with per-rank parts, what it
        would restore if any rank sits elsewhere than at the save (with this rank's own move)."""
        if not isinstance(state_dict, Mapping):
            raise StateDictTypeError(
                f"expected the mapping RNGStateful.state_dict() returns, got "
                f"{type(state_dict).__name__}"
            )
        forks = self._open_forks_over_generators()
        if forks is not None:
            raise TrackerBusyError(
                f"cannot load RNG state inside open fork(s) {forks}: the generators restored "
                "would go into a stream; load outside any fork"
            )
        if "blob" in state_dict:
            return self._plan_format1(state_dict, rank, world), None
        unknown = [k for k in state_dict if k != "shared" and not is_rank_key(k)]
        if unknown or "shared" not in state_dict:
            raise StateDictError(
                f"an RNG state has the entries 'shared' and 'rank<r>'; got {sorted(map(str, state_dict))[:8]}"
                ": it was not written by RNGStateful.state_dict()"
            )
        header, blob, _ = decode_entry("shared", state_dict["shared"])
        shared = check_shared_header(header)
        shared_sum = hashlib.blake2b(state_dict["shared"], digest_size=32).hexdigest()
        pieces = split_blob(
            "shared", blob, [p["nbytes"] for p in shared["parts"] if p["replicated"]]
        )
        states: dict[str, tuple[bytes, int | None]] = {}
        replicated = [p for p in shared["parts"] if p["replicated"]]
        for part, piece in zip(replicated, pieces, strict=True):
            states[part["name"]] = (piece, part["seed"])
        per_rank = [p["name"] for p in shared["parts"] if not p["replicated"]]
        # every rank entry handed to this load is checked, each by one of this run's ranks
        own_key = f"rank{rank}"
        entries = {}
        for key in state_dict:
            if key != "shared" and (key == own_key or int(key[4:]) % world == rank):
                entries[key] = check_rank_entry(key, state_dict[key], shared, shared_sum, per_rank)
        layout = self._layout_key()
        coordinates = self._coordinates(group)
        here = _placed(coordinates)
        # on another layout: the per-rank parts, and the shared ones that must now vary over an
        # axis that had one rank at the save
        moving = per_rank + [
            p["name"]
            for p in shared["parts"]
            if p["replicated"] and any(a in here for a in p["axes"])
        ]
        elsewhere = _Choice(states, shared, moving, coordinates)
        if not (shared["world"] == world and shared["layout"] == layout):
            return elsewhere, None
        if not per_rank:
            return _Choice(states, shared, [], coordinates), None
        if own_key not in entries:
            held = sorted(int(key[4:]) for key in state_dict if key != "shared")
            raise StateDictError(
                f"the RNG state lacks this rank's entry {own_key!r}: it holds rank(s) "
                f"{held[:8]} of the {shared['world']} saved, so a process that held only some "
                "entries wrote it (e.g. accelerate's save_on_each_node=True with "
                "saved_by='main_process'); save with saved_by='each_node' where each node writes "
                "its own file, or resume from the main process's file"
            )
        own, at = entries[own_key]
        moved = None if at is None or at == here else (at, here)
        return _Choice({**states, **own}, shared, [], coordinates), (elsewhere, moved)

    def _decide(self, choice: _Choice, rank: int, group: Any) -> _Plan:
        """The checked plan of ``choice``; its parts that cannot move are re-derived, or refused
        with ``strict``."""
        if choice.rederive:
            shared = choice.shared
            if self.strict:
                raise RNGStateLayoutError(
                    f"{_label(choice.rederive[0])} differs between the {shared['world']} saved "
                    f"ranks (layout {shared['layout']!r}), or must differ here where it did not "
                    f"there, so it can only be restored on the saved layout; this run has "
                    f"{_world(group)[1]} ranks, layout {self._layout_key()!r}; parts that cannot "
                    f"move: {', '.join(_label(n) for n in choice.rederive)}. Resume on the saved "
                    "layout, pass strict=False to re-derive them, or use replicated streams / "
                    "keyed randomness, which reshard"
                )
            fresh = self._rederive(shared, choice.rederive, rank, choice.coordinates)
            states = {**choice.states, **fresh}
        else:
            states = choice.states
        return self._checked_plan(
            states, choice.shared["tracker"], choice.shared["keyed"], choice.rederive
        )

    def _rederive(
        self, shared: dict[str, Any], names: list[str], rank: int, coordinates: Coordinates
    ) -> dict[str, tuple[bytes, int | None]]:
        """Fresh states of the parts ``names`` for this rank at ``coordinates`` of the new
        layout."""
        out = {}
        for part in shared["parts"]:
            if part["name"] not in names:
                continue
            axes = part["axes"]
            if coordinates and "rank" not in axes:  # an axis the layout lacks has one rank
                at = {a: coordinates[a][0] if a in coordinates else 0 for a in axes}
            else:  # the rank's place along those axes is unknown here: its global rank decides
                at = {"rank": rank}
            moment = (
                {"step": shared["step"]}
                if shared["step"] is not None
                else {"checkpoint": shared["nonce"]}
            )
            record = {"seed": shared["run_seed"], "part": part["name"], "at": at, **moment}
            digest = hashlib.blake2b(canonical(record), digest_size=8, person=b"rng_tracker.redo")
            seed = int.from_bytes(digest.digest(), "little")
            if part["name"] == "cpu":
                out["cpu"] = (_fresh_state(seed), None)
            elif part["name"] == "device":
                rng = device_rng(self._device)
                out["device"] = (as_bytes(rng.to_bytes(rng.fresh(seed))), None)
            else:
                rng = device_rng(self.tracker.device)
                out[part["name"]] = (as_bytes(rng.to_bytes(rng.fresh(seed))), seed)
        return out

    def _checked_plan(
        self,
        states: dict[str, tuple[bytes, int | None]],
        tracker_info: Mapping[str, Any],
        keyed: Mapping[str, Any] | None,
        rederived: list[str],
    ) -> _Plan:
        """The plan of ``states``, every piece tried on scratch objects: nothing live changes."""
        plan = _Plan(rederived=rederived)
        cpu = states.get("cpu")
        if cpu is None:
            raise StateDictError("the RNG state holds no CPU default generator state")
        plan.cpu = torch.frombuffer(bytearray(cpu[0]), dtype=torch.uint8).clone()
        try:
            torch.Generator().set_state(plan.cpu)
        except RuntimeError as exc:
            raise StateDictError(f"the saved CPU generator state does not decode: {exc}") from None
        if "device" in states and self._device.type != "cpu":
            plan.device = as_uint8(states["device"][0], torch.device("cpu")).clone()
            try:
                device_rng(self._device).from_bytes(plan.device)
            except RuntimeError as exc:
                raise StateDictError(
                    f"the saved device generator state does not decode: {exc}"
                ) from None
        plan.tracker = {
            "version": tracker_info["version"],
            "device_type": tracker_info["device_type"],
            "streams": {
                name[len("stream/") :]: {
                    "seed": seed,
                    "state": torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
                    if data
                    else torch.empty(0, dtype=torch.uint8),
                }
                for name, (data, seed) in sorted(states.items())
                if name.startswith("stream/")
            },
        }
        RNGStatesTracker(self.tracker.device).load_state_dict(plan.tracker)  # refuses typed
        if keyed is not None:
            scratch = KeyedRNG(self.keyed.device)
            scratch.load_state_dict(self.keyed.state_dict())  # the sites registered here
            scratch.load_state_dict(keyed)  # refuses bad values and collisions, typed
            plan.keyed = dict(keyed)
        return plan

    def _apply(self, plan: _Plan) -> None:
        generator = default_generator(self._device)
        before = (
            torch.get_rng_state(),
            generator.get_state() if plan.device is not None else None,
            self.tracker.state_dict(),
            self.keyed.state_dict(),
        )
        try:
            if plan.keyed is not None:
                self.keyed.load_state_dict(plan.keyed)
            self.tracker.load_state_dict(plan.tracker)
            torch.set_rng_state(plan.cpu)
            if plan.device is not None:
                device_rng(self._device).install(device_rng(self._device).from_bytes(plan.device))
        except BaseException:  # checked on scratch objects first: this is a last resort
            torch.set_rng_state(before[0])
            if before[1] is not None:
                generator.set_state(before[1])
            self.tracker.load_state_dict(before[2])
            self.keyed.load_state_dict(before[3])
            raise

    # -- format 1 ---------------------------------------------------------------------------
    def _plan_format1(self, state_dict: Mapping[str, Any], rank: int, world: int) -> _Plan:
        """A format-1 checkpoint (one blob of every rank): the same layout restores everything;
        another layout restores the keyed and shared states, and refuses per-rank ones."""
        blob = state_dict["blob"]
        if set(state_dict) != {"blob"} or not isinstance(blob, bytes | bytearray):
            raise StateDictError("a format-1 RNG state is {'blob': bytes}; this one is malformed")
        try:
            payload = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
            ranks = payload["ranks"]
            saved = [ranks[r] for r in sorted(ranks)]
            parts_of = [format1_parts(s) for s in saved]
            same = payload["world"] == world and payload["layout"] == self.layout
            names = list(parts_of[0])
            keyed = payload["keyed"]
            tracker = saved[0]["tracker"]
            tracker_info = {"version": tracker["version"], "device_type": tracker["device_type"]}
        except Exception as exc:
            raise StateDictError(
                f"a format-1 RNG state (rng_tracker <= da7a863) that does not decode "
                f"({type(exc).__name__}: {exc}); format 1 has no checksum: resume from another "
                "checkpoint"
            ) from None
        if any(list(p) != names for p in parts_of) or len(parts_of) != payload["world"]:
            raise StateDictError(
                "the format-1 RNG state's ranks hold different streams; it cannot be restored"
            )
        states = {}
        for name in names:
            values = [p[name] for p in parts_of]
            if all(v == values[0] for v in values):
                states[name] = values[0]
            elif same:
                states[name] = parts_of[rank][name]
            else:
                raise RNGStateLayoutError(
                    f"{_label(name)} differs between the {payload['world']} saved ranks of this "
                    f"format-1 checkpoint (layout {payload['layout']!r}); format 1 holds no "
                    "run seed or coordinates to re-derive it on another layout, so it restores "
                    f"only on the saved layout (this run: {world} ranks, layout {self.layout!r}). "
                    "To convert: load it on the saved layout and save again (format 2)"
                )
        return self._checked_plan(states, tracker_info, keyed, [])
