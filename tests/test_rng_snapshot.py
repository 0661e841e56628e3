"""RNGSnapshot: copies that never alias live state; swap_in/replaying put back what they found."""

from __future__ import annotations

import pytest
import torch

from rng_tracker import RNGStatesTracker, RNGTrackerError
from rng_tracker._rng_snapshot import RNGSnapshot, replaying
from rng_tracker.errors import ArgumentTypeError


def _tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 11)
    return tracker


def _draw(tracker: RNGStatesTracker) -> torch.Tensor:
    with tracker.fork("s"):
        inside = torch.rand(3)
    return torch.cat([inside, torch.rand(2)])


def test_swap_in_installs_the_snapshot_and_returns_what_it_replaced() -> None:
    tracker = _tracker()
    snapshot = RNGSnapshot.capture((), [tracker])
    first = _draw(tracker)
    before_swap = RNGSnapshot.capture((), [tracker])
    found = snapshot.swap_in((), [tracker])
    assert found.differences(before_swap) == []
    assert torch.equal(_draw(tracker), first)  # replays the snapshot's draws
    assert snapshot.differences(RNGSnapshot.capture((), [tracker]))  # the draws moved on...
    found.restore()
    assert found.differences(RNGSnapshot.capture((), [tracker])) == []
    again = snapshot.swap_in((), [tracker])  # ...but the snapshot did not: no aliasing
    assert torch.equal(_draw(tracker), first)
    again.restore()


def test_replaying_restores_the_states_found_on_entry_even_when_the_body_raises() -> None:
    tracker = _tracker()
    snapshot = RNGSnapshot.capture((), [tracker])
    first = _draw(tracker)
    entry = RNGSnapshot.capture((), [tracker])
    with pytest.raises(RuntimeError, match="early stop"), replaying(snapshot, (), [tracker]):
        assert torch.equal(_draw(tracker), first)
        raise RuntimeError("early stop")
    assert entry.differences(RNGSnapshot.capture((), [tracker])) == []


@pytest.mark.parametrize(
    ("devices", "trackers", "match"),
    [
        (["cuda"], [], r"devices must hold only torch\.device objects .*got str 'cuda'"),
        ([], [5], "trackers must hold only RNGStatesTracker objects .*got int 5"),
        (None, [], r"devices must be an iterable of torch\.device objects"),
        ((), 5, "trackers must be an iterable of RNGStatesTracker objects"),
    ],
)
def test_capture_refuses_what_is_not_devices_and_trackers_typed(devices, trackers, match) -> None:
    tracker = _tracker()
    before = (torch.get_rng_state(), tracker.get_states())
    with pytest.raises(ArgumentTypeError, match=match) as info:
        RNGSnapshot.capture(devices, trackers)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    with pytest.raises(ArgumentTypeError, match=match):
        RNGSnapshot.capture((), [tracker]).swap_in(devices, trackers)
    assert torch.equal(before[0], torch.get_rng_state())
    after = tracker.get_states()
    assert after.keys() == before[1].keys()
    assert all(torch.equal(after[k], before[1][k]) for k in after)


def test_differences_refuses_what_is_not_a_snapshot() -> None:
    with pytest.raises(ArgumentTypeError, match="another RNGSnapshot, got dict") as info:
        RNGSnapshot.capture((), []).differences({})
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)


def test_differences_refuses_snapshots_of_other_trackers_or_devices() -> None:
    """Snapshots of other trackers were compared tracker by tracker in order: the same count
    reported the first tracker's streams as the second's ("stream 'q' of the cpu tracker"),
    another count raised zip()'s bare ValueError. Refused with TrackerDeviceError (a
    ValueError), naming both; the same trackers still compare."""
    from rng_tracker.errors import TrackerDeviceError

    first, second = _tracker(), RNGStatesTracker("cpu")
    second.add("q", 3)
    mine = RNGSnapshot.capture((), [first])
    for other in (
        RNGSnapshot.capture((), [second]),
        RNGSnapshot.capture((), [first, second]),
        RNGSnapshot(mine.cpu, ((torch.device("cpu"), mine.cpu),), mine.streams),  # by hand
    ):
        with pytest.raises(TrackerDeviceError, match="same devices and trackers") as info:
            mine.differences(other)
        assert isinstance(info.value, ValueError)
    assert mine.differences(RNGSnapshot.capture((), [first])) == []


@pytest.mark.parametrize(
    ("states", "error"),
    [
        ({"s": "garbage"}, "StateDictTypeError"),
        ({3: torch.zeros(5, dtype=torch.uint8)}, "StreamNameError"),
    ],
)
def test_restore_of_a_snapshot_built_by_hand_checks_its_streams(states, error) -> None:
    """A snapshot built by hand may hold anything: restore() checks each tracker's states as
    restore_states() does and refuses with a typed error, leaving every state as it was, the
    trackers restored before the refused one and the CPU generator included (the unchecked
    restore is for snapshots RNGSnapshot.take made, a checkpoint's own)."""
    from rng_tracker import errors

    first, second = _tracker(), _tracker()
    other = RNGSnapshot.capture((), [first])  # a valid state of first's, different from now
    _draw(first)
    torch.manual_seed(99)
    before = (torch.get_rng_state(), first.get_states(), second.get_states())
    built = RNGSnapshot(other.cpu, (), (*other.streams, (second, states)))
    assert not torch.equal(other.streams[0][1]["s"], before[1]["s"])  # restoring would change it
    assert not torch.equal(other.cpu, before[0])
    with pytest.raises(getattr(errors, error)):
        built.restore()
    assert torch.equal(before[0], torch.get_rng_state())
    for tracker, states_before in zip((first, second), before[1:], strict=True):
        after = tracker.get_states()
        assert after.keys() == states_before.keys()
        assert all(torch.equal(after[n], states_before[n]) for n in after)


@pytest.mark.parametrize(
    ("build", "error", "builtin", "words"),
    [
        (lambda cpu, streams: RNGSnapshot(5, (), streams), "StateDictTypeError", TypeError, "CPU"),
        (
            lambda cpu, streams: RNGSnapshot(torch.zeros(3, dtype=torch.uint8), (), streams),
            "StateDictError",
            ValueError,
            "3 elements",
        ),
        (
            lambda cpu, streams: RNGSnapshot(cpu, (("cpu", cpu),), streams),
            "StateDictTypeError",
            TypeError,
            "(torch.device, state) pairs",
        ),
        (
            lambda cpu, streams: RNGSnapshot(cpu, ((torch.device("cpu"), "x"),), streams),
            "StateDictTypeError",
            TypeError,
            "the cpu state",
        ),
        (
            lambda cpu, streams: RNGSnapshot(cpu, (), (("tracker", {}),)),
            "StateDictTypeError",
            TypeError,
            "(RNGStatesTracker, dict of states) pairs",
        ),
    ],
)
def test_restore_of_a_malformed_snapshot_is_a_typed_error(build, error, builtin, words) -> None:
    """A hand-built snapshot whose CPU or device state is no generator state (an int, 3 bytes),
    or whose parts are no pairs, raised torch's bare TypeError / RuntimeError (or an
    AttributeError); each is now a typed error, and nothing changes."""
    from rng_tracker import errors

    tracker = _tracker()
    built = build(torch.get_rng_state(), ((tracker, tracker.get_states()),))
    _draw(tracker)
    before = (torch.get_rng_state(), tracker.get_states()["s"])
    with pytest.raises(getattr(errors, error)) as info:
        built.restore()
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert words in str(info.value)
    assert torch.equal(before[0], torch.get_rng_state())
    assert torch.equal(before[1], tracker.get_states()["s"])


def test_restore_installs_a_cpu_state_view_at_a_storage_offset() -> None:
    """torch's set_state misreads a state tensor that is a view at a storage offset ("Invalid
    mt19937 state" here); a hand-built snapshot's CPU state is installed by its values."""
    state = torch.Generator().manual_seed(3).get_state()
    view = torch.cat([torch.zeros(7, dtype=torch.uint8), state])[7:]
    RNGSnapshot(view, (), ()).restore()
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(3)))


def test_a_deep_copy_restores_into_the_live_tracker_and_pickling_is_refused() -> None:
    """A deep copy (or pickle) of a snapshot cloned its trackers, so restore() put back the CPU
    generator but replayed the streams into the clone: the live tracker stayed advanced, and
    nothing said so. A deep copy now restores into the live trackers; pickling, which cannot
    keep them, is refused (a snapshot of no tracker pickles)."""
    import copy
    import pickle

    tracker = _tracker()
    snapshot = copy.deepcopy(RNGSnapshot.capture([], [tracker]))
    want = _draw(tracker)
    snapshot.restore()
    assert torch.equal(_draw(tracker), want)
    with pytest.raises(ArgumentTypeError, match="cannot be pickled"):
        pickle.dumps(RNGSnapshot.capture([], [tracker]))
    plain = RNGSnapshot.capture([], [])
    assert torch.equal(pickle.loads(pickle.dumps(plain)).cpu, plain.cpu)
