"""rng_tracker.dcp.RNGStateful through plain torch.distributed.checkpoint on 4 gloo ranks.

Claims: ``dcp.save`` keeps every rank's states (DCP's equal-key dedup, pytorch#120356, drops
none); ``dcp.load`` on the saved layout restores each rank's own default generator, tracker
streams and keyed state; on another layout it restores the keyed state and the replicated
(equal on every rank) states, and with ``strict=True`` refuses per-rank states with
RNGStateLayoutError, changing nothing (without it they are re-derived: tests/test_dcp_resume_anywhere.py).
"""

from __future__ import annotations

import pytest
import torch

from rng_tracker.errors import RNGStateLayoutError, RNGTrackerError


def _draws(tracker, keyed) -> list[torch.Tensor]:
    with tracker.fork("per-rank"):
        a = torch.rand(4)
    with tracker.fork("shared"):
        b = torch.rand(4)
    return [torch.rand(4), a, b, torch.tensor([keyed.step])]


@pytest.mark.distributed(world_size=4, timeout=300)
def test_dcp_save_at_one_layout_load_at_another(rank: int, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from rng_tracker._keyed import KeyedRNG
    from rng_tracker._tracker import RNGStatesTracker
    from rng_tracker.dcp import RNGStateful

    torch.manual_seed(1)  # replicated: the same on every rank
    tracker = RNGStatesTracker("cpu")
    tracker.add("per-rank", 100 + rank)  # differs between ranks
    tracker.add("shared", 7)
    keyed = KeyedRNG("cpu", seed=3)
    keyed.set_step(5)
    tp2 = {"dp": 2, "tp": 2}
    dcp.save({"rng": RNGStateful(tracker, keyed, layout=tp2)}, checkpoint_id=str(tmp_path / "a"))
    want = _draws(tracker, keyed)  # what the run draws right after the save

    # same layout: every rank gets its own states back (none was lost to dedup)
    keyed.set_step(9)
    dcp.load({"rng": RNGStateful(tracker, keyed, layout=tp2)}, checkpoint_id=str(tmp_path / "a"))
    got = _draws(tracker, keyed)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

    # another layout: the per-rank stream cannot be placed; nothing changes
    before = (torch.get_rng_state(), tracker.state_dict(), keyed.state_dict())
    tp4 = {"dp": 1, "tp": 4}
    with pytest.raises(RNGStateLayoutError, match="tracker stream 'per-rank' differs") as info:
        dcp.load(
            {"rng": RNGStateful(tracker, keyed, layout=tp4, strict=True)},
            checkpoint_id=str(tmp_path / "a"),
        )
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert keyed.state_dict() == before[2]
    for name, entry in tracker.state_dict()["streams"].items():
        assert torch.equal(entry["state"], before[1]["streams"][name]["state"])

    # replicated streams and keyed state reshard: save at tp=2, load at tp=4
    torch.manual_seed(2)
    shared = RNGStatesTracker("cpu")
    shared.add("per-rank", 50)  # the same on every rank this time
    shared.add("shared", 8)
    keyed.set_step(11)
    dcp.save({"rng": RNGStateful(shared, keyed, layout=tp2)}, checkpoint_id=str(tmp_path / "b"))
    want = _draws(shared, keyed)
    torch.manual_seed(99)
    keyed.set_step(0)
    dcp.load({"rng": RNGStateful(shared, keyed, layout=tp4)}, checkpoint_id=str(tmp_path / "b"))
    got = _draws(shared, keyed)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
