"""RNGSnapshot: copies that never alias live state; swap_in/replaying put back what they found."""

from __future__ import annotations

import torch

from rng_tracker import RNGStatesTracker
from rng_tracker._rng_snapshot import RNGSnapshot, replaying


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
    try:
        with replaying(snapshot, (), [tracker]):
            assert torch.equal(_draw(tracker), first)
            raise RuntimeError("early stop")
    except RuntimeError:
        pass
    assert entry.differences(RNGSnapshot.capture((), [tracker])) == []
