"""BatchPosition checks a hand-made position as batch_position(...) checks its arguments."""

from __future__ import annotations

import pytest
import torch

from rng_tracker import RNGTrackerError, batch_position, get_rng_tracker
from rng_tracker._batch_position import BatchPosition, batch_context, current_batch_position
from rng_tracker.errors import BatchPositionError, BatchPositionTypeError, ParallelConfigError


def _states() -> tuple:
    streams = {n: s.clone() for n, s in get_rng_tracker("cpu").get_states().items()}
    return torch.get_rng_state(), streams


def _assert_unchanged(before: tuple) -> None:
    cpu, streams = _states()
    assert torch.equal(cpu, before[0]) and streams.keys() == before[1].keys()
    assert all(torch.equal(streams[n], before[1][n]) for n in streams)


@pytest.mark.parametrize(
    ("args", "error", "builtin", "match"),
    [
        ((5, 2), BatchPositionError, ValueError,
         r"BatchPosition\(sample_offset=5, global_batch=2\): the offset must be below the global "
         "batch"),
        ((2, 2), BatchPositionError, ValueError, "the offset must be below the global batch"),
        ((1, 0), BatchPositionError, ValueError, "the offset must be below the global batch"),
        ((0, -1), BatchPositionError, ValueError, "global_batch must be >= 0, got -1"),
        ((-1, 2), BatchPositionError, ValueError, "sample_offset must be >= 0, got -1"),
        (("0", 2), BatchPositionTypeError, TypeError, "sample_offset must be an int"),
        ((0, 2.0), BatchPositionTypeError, TypeError, "global_batch must be an int"),
    ],
)  # fmt: skip
def test_a_hand_made_position_outside_its_batch_is_refused(args, error, builtin, match):
    """BatchPosition(5, 2) was accepted, though its docstring says a hand-made one is checked."""
    before = _states()
    with pytest.raises(error, match=match) as info:
        BatchPosition(*args)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert isinstance(info.value, ParallelConfigError)
    assert batch_context().position is None
    _assert_unchanged(before)


def test_positions_the_library_builds_are_still_accepted():
    """Every position below its batch, and the empty batch a local batch of 0 samples is."""
    assert BatchPosition(0, 0) == BatchPosition(0, 0)
    assert BatchPosition(3, 4).sample_offset == 3
    assert current_batch_position(0) == BatchPosition(0, 0)
    with batch_position(1, 2) as position:
        assert position == BatchPosition(1, 2) and batch_context().position == position
    for args in ((2, 2), (5, 2)):  # batch_position's own message, as before
        match = r"^batch_position\(sample_offset="
        with pytest.raises(BatchPositionError, match=match), batch_position(*args):
            pass
    match = "global_batch must be a positive int"
    with pytest.raises(BatchPositionError, match=match), batch_position(0, 0):
        pass
