"""Snapshots of every RNG a region of code may draw from, and their exact replay.

A snapshot holds the CPU generator, the default generators of the given devices and
every stream of the given trackers: copies, or for a stream's uint8 state the tracker's own
tensor, which no draw writes in place (a stream's state is replaced, not modified).
:func:`replaying` installs a snapshot for a body and puts back, afterwards, exactly what was
there before.
"""

from __future__ import annotations

import copy
import reprlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from rng_tracker._device_rng import RNGState, device_rng, plain_state
from rng_tracker._tracker import HeldContext, RNGStatesTracker
from rng_tracker.errors import (
    ArgumentTypeError,
    CheckpointUsageError,
    StateDictError,
    StateDictTypeError,
    TrackerDeviceError,
)

_CPU = torch.device("cpu")
_T = TypeVar("_T")
_DEVICES = "torch.device objects (torch.device('cuda'), not 'cuda')"
_TRACKERS = "RNGStatesTracker objects (e.g. get_rng_tracker('cuda'))"


def accelerators(
    devices: Iterable[torch.device], trackers: Iterable[RNGStatesTracker]
) -> list[torch.device]:
    """The devices other than CPU among ``devices`` and the trackers', each once, by name
    (not meta: it has no generator, and torch's checkpoint runs meta tensors without one).

    Runs at every checkpointed call: ``d != _CPU`` first, since reading ``d.type`` builds a
    string (most of a microsecond) and the devices are mostly the CPU."""
    found: list[torch.device] = []
    for device in (*devices, *(t.device for t in trackers)):
        if device != _CPU and device.type not in ("cpu", "meta") and device not in found:
            found.append(device)
    return sorted(found, key=str) if len(found) > 1 else found


def _all_of(values: Iterable[_T], kind: type[_T], what: str, wanted: str) -> tuple[_T, ...]:
    """``values`` as a tuple, each a ``kind``, else :class:`ArgumentTypeError` naming the
    argument ``what`` and the ``wanted`` items."""
    if not isinstance(values, (tuple, list)) and not isinstance(values, Iterable):  # ABC: slow
        raise ArgumentTypeError(
            f"{what} must be an iterable of {wanted}, got {type(values).__name__}"
        )
    items = tuple(values)
    for item in items:
        if type(item) is not kind and not isinstance(item, kind):
            raise ArgumentTypeError(
                f"{what} must hold only {wanted}, got {type(item).__name__} {reprlib.repr(item)}"
            )
    return items


@dataclass(frozen=True, slots=True)
class RNGSnapshot:
    """The CPU generator, device generators and tracker streams at one moment (copies, or
    states no draw modifies); treat it as read-only. ``contexts``: each tracker's open forks
    and seeds then, which a checkpoint's replay puts back with the streams (:meth:`restore`
    leaves a tracker's forks as they are)."""

    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, RNGState], ...]
    streams: tuple[tuple[RNGStatesTracker, dict[str, RNGState]], ...]
    contexts: tuple[HeldContext, ...] = ()

    @classmethod
    def capture(
        cls, devices: Iterable[torch.device], trackers: Iterable[RNGStatesTracker]
    ) -> RNGSnapshot:
        """Copy the current states (CPU always; ``devices`` other than CPU; every stream)."""
        devices = _all_of(devices, torch.device, "devices", _DEVICES)
        trackers = _all_of(trackers, RNGStatesTracker, "trackers", _TRACKERS)
        return cls.take(accelerators(devices, trackers), trackers)

    @classmethod
    def take(
        cls, wanted: Sequence[torch.device], trackers: Sequence[RNGStatesTracker]
    ) -> RNGSnapshot:
        """:meth:`capture` of checked arguments, ``wanted`` being their :func:`accelerators`: a
        checkpoint computes those once and snapshots at its forward and every recompute."""
        device_states: tuple[tuple[torch.device, RNGState], ...] = ()
        if wanted:
            if any(d.type == "cuda" for d in wanted) and torch.cuda.is_current_stream_capturing():
                raise CheckpointUsageError(
                    "a CUDA graph is capturing, and torch cannot copy a CUDA generator state "
                    "during capture, so the checkpoint cannot keep its RNG for the recompute; "
                    "draw the block's randomness with keyed dropout (rng_tracker.kernels."
                    "dropout(..., seed=...)), whose mask needs no saved state, and pass "
                    "preserve_rng_state=False"
                )
            device_states = tuple((d, device_rng(d).snapshot()) for d in wanted)
        return cls(
            torch.default_generator.get_state(),
            device_states,
            tuple([(t, t.held_states()) for t in trackers]),
            tuple([t.held_context() for t in trackers]),
        )

    def __copy__(self) -> RNGSnapshot:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RNGSnapshot:
        """Copies of the states that restore into the same trackers: a tracker is where a
        snapshot is restored, as a device is, so the live trackers are kept, not cloned."""
        memo.update((id(tracker), tracker) for tracker, _ in self.streams)
        return RNGSnapshot(*(copy.deepcopy(getattr(self, f.name), memo) for f in fields(self)))

    def __getstate__(self) -> tuple[Any, ...]:
        if self.streams:
            raise ArgumentTypeError(
                "an RNGSnapshot of tracker streams restores into this process's trackers and "
                "cannot be pickled (unpickled, it would restore into copies of them); save "
                "tracker.state_dict(), or rng_tracker.dcp.RNGStateful, instead"
            )
        return tuple(getattr(self, f.name) for f in fields(self))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for f, value in zip(fields(self), state, strict=True):
            object.__setattr__(self, f.name, value)

    def restore(self) -> None:
        """Install the snapshot: streams first, then the generators (which may host a stream).
        Each tracker's states are checked, as :meth:`RNGStatesTracker.restore_states` does (a
        snapshot built by hand may hold anything), and so are the generators' (before anything
        changes): a part of the wrong type raises :class:`StateDictTypeError`, a state that does
        not fit :class:`StateDictError`. Where one is refused, every state is as it was before."""
        self._check_parts()
        found = RNGSnapshot.take(
            tuple(device for device, _ in self.devices), [t for t, _ in self.streams]
        )
        try:
            self._install(checked=True)
        except BaseException:
            found._install(checked=False)
            raise

    def _check_parts(self) -> None:
        """Refuse what a hand-built snapshot holds that is no generator state or no pair of
        (device, state) or (tracker, streams); the streams' states :meth:`restore` checks."""
        cpu = device_rng(_CPU, generator_states=False)
        try:
            cpu.check(self.cpu, type_error=StateDictTypeError, value_error=StateDictError)
        except StateDictError as error:
            raise type(error)(f"RNGSnapshot.restore(): the CPU state: {error}") from None
        for kind, parts, pairs in (
            (torch.device, self.devices, "(torch.device, state) pairs"),
            (RNGStatesTracker, self.streams, "(RNGStatesTracker, dict of states) pairs"),
        ):
            if not isinstance(parts, tuple) or not all(
                isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], kind)
                for part in parts
            ):
                raise StateDictTypeError(
                    f"RNGSnapshot.restore(): a snapshot holds a tuple of {pairs}, got "
                    f"{reprlib.repr(parts)}; take one with RNGSnapshot.capture()"
                )
        for device, state in self.devices:
            try:
                device_rng(device).check(
                    state, type_error=StateDictTypeError, value_error=StateDictError
                )
            except StateDictError as error:
                raise type(error)(f"RNGSnapshot.restore(): the {device} state: {error}") from None

    def _install(self, *, checked: bool) -> None:
        contexts = self.contexts or (None,) * len(self.streams)  # built by hand: none
        for (tracker, states), context in zip(self.streams, contexts, strict=True):
            if checked:
                tracker.restore_states(states)
            else:
                tracker.restore_held(states, context)
        for device, state in self.devices:
            device_rng(device).install(device_rng(device).copy(state))
        torch.default_generator.set_state(plain_state(self.cpu) if checked else self.cpu)

    def swap_in(
        self, devices: Iterable[torch.device], trackers: Iterable[RNGStatesTracker]
    ) -> RNGSnapshot:
        """Install this snapshot and return a snapshot of what it replaced (of ``devices`` and
        ``trackers``), to :meth:`restore` once the replayed code has run."""
        found = RNGSnapshot.capture(devices, trackers)
        self.restore()
        return found

    def differences(self, other: RNGSnapshot) -> list[str]:
        """Names of the generators and streams whose states differ between two snapshots."""
        if not isinstance(other, RNGSnapshot):
            raise ArgumentTypeError(
                f"differences() compares with another RNGSnapshot, got {type(other).__name__}"
            )
        mine = ([d for d, _ in self.devices], [id(t) for t, _ in self.streams])
        theirs = ([d for d, _ in other.devices], [id(t) for t, _ in other.streams])
        if mine != theirs:
            raise TrackerDeviceError(
                f"differences() compares snapshots of the same devices and trackers; this one "
                f"holds the devices {mine[0]} and {len(mine[1])} tracker(s), the other "
                f"{theirs[0]} and {len(theirs[1])}, not the same objects: capture both with the "
                "same devices and trackers"
            )
        names = []
        if not torch.equal(self.cpu, other.cpu):
            names.append("the CPU generator")
        for (device, mine), (_, theirs) in zip(self.devices, other.devices, strict=True):
            if not device_rng(device).equal(mine, theirs):
                names.append(f"the default generator of {device}")
        for (tracker, mine), (_, theirs) in zip(self.streams, other.streams, strict=True):
            rng = device_rng(tracker.device)
            for name in sorted(set(mine) | set(theirs)):
                if (
                    name not in mine
                    or name not in theirs
                    or not rng.equal(mine[name], theirs[name])
                ):
                    names.append(f"stream {name!r} of the {tracker.device} tracker")
        return names


def restore_taken(snapshot: RNGSnapshot) -> None:
    """:meth:`RNGSnapshot.restore` of a snapshot :meth:`RNGSnapshot.take` made, its streams
    unchecked: a checkpoint puts back its own snapshots at every recompute."""
    snapshot._install(checked=False)


@contextmanager
def replaying(
    snapshot: RNGSnapshot, wanted: Sequence[torch.device], trackers: Sequence[RNGStatesTracker]
) -> Iterator[None]:
    """Run the body from ``snapshot``'s states; afterwards restore the states found on entry
    (:meth:`RNGSnapshot.take` of ``wanted``, as :func:`accelerators` gave them, and
    ``trackers``: the snapshot's own, checked when it was taken)."""
    found = RNGSnapshot.take(wanted, trackers)
    restore_taken(snapshot)
    try:
        yield
    finally:
        restore_taken(found)
