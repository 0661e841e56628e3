"""The tracker of named streams: fork semantics, snapshots, state dicts, typed errors."""

from __future__ import annotations

import pytest
import torch

from rng_tracker import (
    RNGStatesTracker,
    RNGTrackerError,
    SeedReuseError,
    UnknownStreamError,
    get_rng_tracker,
)
from rng_tracker.errors import (
    DuplicateStreamError,
    InvalidSeedError,
    InvalidSeedTypeError,
    StateDictError,
    StreamNameError,
    TrackerBusyError,
    TrackerDeviceError,
)
from rng_tracker.parallel.testing import run_distributed


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def full_state(tracker: RNGStatesTracker) -> tuple:
    """Every RNG state a failed call must leave alone, as comparable plain values."""
    streams = tracker.state_dict()["streams"]
    return (
        bytes(torch.get_rng_state().tolist()),
        tracker.open_forks(),
        [(name, entry["seed"], bytes(entry["state"].tolist())) for name, entry in streams.items()],
    )


def test_fork_draws_from_the_stream_and_restores_the_default_state(tracker):
    """Inside fork the default generator draws the stream; outside it continues untouched."""
    torch.manual_seed(0)
    tracker.add("a", 11)
    inside = []
    with tracker.fork("a"):
        inside.append(torch.rand(5))
    outside = torch.rand(5)
    with tracker.fork("a"):
        inside.append(torch.rand(5))
    ref_a = fresh(11)
    assert torch.equal(inside[0], torch.rand(5, generator=ref_a))
    assert torch.equal(inside[1], torch.rand(5, generator=ref_a))
    assert torch.equal(outside, torch.rand(5, generator=fresh(0)))


def test_fork_restores_state_when_the_body_raises(tracker):
    """An exception in the body still restores the outer state and keeps the stream's advance."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    tracker.add("a", 5)
    with pytest.raises(ZeroDivisionError), tracker.fork("a"):
        torch.rand(7)
        raise ZeroDivisionError
    assert torch.equal(torch.get_rng_state(), before)
    assert tracker.open_forks() == ()
    ref = fresh(5)
    torch.rand(7, generator=ref)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), torch.rand(3, generator=ref))


def test_nested_forks_keep_each_stream_continuous(tracker):
    """a → b → a nesting: every stream draws exactly its own sequence, in call order."""
    torch.manual_seed(1)
    tracker.add("a", 100)
    tracker.add("b", 200)
    ref_a, ref_b, ref_default = fresh(100), fresh(200), fresh(1)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_a))
        with tracker.fork("b"):
            assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_b))
            with tracker.fork("a"):
                assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_a))
            assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_b))
        assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_a))
    assert torch.equal(torch.rand(4), torch.rand(4, generator=ref_default))


def test_reentering_the_same_stream_continues_it(tracker):
    """fork(a) inside fork(a) neither replays nor skips draws of a."""
    tracker.add("a", 9)
    ref = fresh(9)
    with tracker.fork("a"):
        first = torch.rand(3)
        with tracker.fork("a"):
            second = torch.rand(3)
        third = torch.rand(3)
    for got in (first, second, third):
        assert torch.equal(got, torch.rand(3, generator=ref))


def test_snapshots_never_alias(tracker):
    """get_states() copies: later draws and in-place edits of the snapshot change nothing else."""
    tracker.add("a", 1)
    snapshot = tracker.get_states()
    kept = {k: v.clone() for k, v in snapshot.items()}
    with tracker.fork("a"):
        torch.rand(10)
    assert torch.equal(snapshot["a"], kept["a"])
    live = tracker.get_states()
    assert not torch.equal(live["a"], kept["a"])
    live["a"].zero_()
    with tracker.fork("a"):
        value = torch.rand(2)
    ref = fresh(1)
    torch.rand(10, generator=ref)
    assert torch.equal(value, torch.rand(2, generator=ref))


def test_get_states_inside_a_fork_is_live_and_set_states_replays(tracker):
    """A snapshot taken inside fork(a) holds a's advanced state; set_states replays from it."""
    tracker.add("a", 4)
    with tracker.fork("a"):
        torch.rand(6)
        snapshot = tracker.get_states()
        expected = torch.rand(5)
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(5), expected)


def test_state_dict_round_trip_is_bitwise(tracker):
    """load_state_dict(state_dict()) restores every stream exactly, on another tracker too."""
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("b"):
        torch.rand(33)
    saved = tracker.state_dict()
    with tracker.fork("a"):
        expected_a = torch.rand(4)
    with tracker.fork("b"):
        expected_b = torch.rand(4)
    other = RNGStatesTracker("cpu")
    other.load_state_dict(saved)
    assert other.names() == ["a", "b"] and other.seeds() == {"a": 1, "b": 2}
    with other.fork("a"):
        assert torch.equal(torch.rand(4), expected_a)
    with other.fork("b"):
        assert torch.equal(torch.rand(4), expected_b)


def _draw_after_restore(path: str) -> list[torch.Tensor]:
    tracker = RNGStatesTracker("cpu")
    tracker.load_state_dict(torch.load(path, weights_only=True))
    out = []
    for name in tracker.names():
        with tracker.fork(name):
            out.append(torch.rand(6))
    return out


def test_state_dict_restores_exactly_in_a_new_process(tracker, tmp_path):
    """A state dict saved to a file restores bitwise in a freshly started process."""
    tracker.add("model-parallel-rng", 77)
    tracker.add("data-parallel-rng", 78)
    with tracker.fork("model-parallel-rng"):
        torch.rand(100)
    path = tmp_path / "tracker.pt"
    torch.save(tracker.state_dict(), path)
    expected = []
    for name in tracker.names():
        with tracker.fork(name):
            expected.append(torch.rand(6))
    (restored,) = run_distributed(_draw_after_restore, world_size=1, args=(str(path),))
    assert all(torch.equal(a, b) for a, b in zip(restored, expected, strict=True))


def test_get_rng_tracker_is_one_per_device():
    assert get_rng_tracker("cpu") is get_rng_tracker(torch.device("cpu"))


@pytest.mark.parametrize(
    ("call", "error", "builtin", "words"),
    [
        (lambda t: t.fork("nope"), UnknownStreamError, KeyError, "known: 'a'"),
        (lambda t: t.add("a", 99), DuplicateStreamError, KeyError, "already exists"),
        (lambda t: t.add("b", 1), SeedReuseError, ValueError, "already used by stream 'a'"),
        (lambda t: t.add("b", -1), InvalidSeedError, ValueError, "[0, 2**64)"),
        (lambda t: t.add("b", 2**64), InvalidSeedError, ValueError, "[0, 2**64)"),
        (lambda t: t.add("b", True), InvalidSeedTypeError, TypeError, "bool"),
        (lambda t: t.add("b", 1.5), InvalidSeedTypeError, TypeError, "float"),
        (lambda t: t.add("", 3), StreamNameError, TypeError, "non-empty str"),
        (
            lambda t: t.set_states({"a": torch.zeros(3)}),
            TrackerDeviceError,
            ValueError,
            "generator state",
        ),
        (
            lambda t: t.set_states({"a": 1234}),
            TrackerDeviceError,
            ValueError,
            "torch.Tensor or a torch.Generator",
        ),
        (lambda t: t.set_states([("a", 1)]), TrackerDeviceError, ValueError, "mapping"),
        (lambda t: t.set_states({7: torch.get_rng_state()}), StreamNameError, TypeError, "str"),
        (lambda t: t.load_state_dict({"version": 99}), StateDictError, ValueError, "version 99"),
        (
            lambda t: t.load_state_dict(
                {**t.state_dict(), "streams": {**t.state_dict()["streams"], 7: {"state": None}}}
            ),
            StateDictError,
            ValueError,
            "non-empty str, got 7",
        ),
        (
            lambda t: t.load_state_dict(
                {
                    **t.state_dict(),
                    "streams": {
                        "b": {"seed": None, "state": torch.get_rng_state()},
                        ("a",): t.state_dict()["streams"]["a"],
                    },
                }
            ),
            StateDictError,
            ValueError,
            "got ('a',)",
        ),
        (
            lambda t: t.load_state_dict({**t.state_dict(), "device_type": "cuda"}),
            StateDictError,
            ValueError,
            "'cuda'",
        ),
        (
            lambda t: t.load_state_dict(
                {
                    **t.state_dict(),
                    "streams": {"a": {"seed": 1, "state": torch.zeros(7, dtype=torch.uint8)}},
                }
            ),
            StateDictError,
            ValueError,
            "does not decode",
        ),
    ],
)
def test_bad_input_raises_a_typed_error_and_changes_nothing(tracker, call, error, builtin, words):
    """Each mistake gets its typed error (also the builtin) and leaves every state as it was."""
    torch.manual_seed(5)
    tracker.add("a", 1)
    with tracker.fork("a"):
        torch.rand(3)
    before = full_state(tracker)
    with pytest.raises(error) as info:
        call(tracker)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert words in str(info.value)
    assert full_state(tracker) == before


@pytest.mark.parametrize("generator_states", [False, True])
def test_both_state_forms_draw_the_same_streams(generator_states):
    """generator_states picks the form of saved states (uint8 tensors or torch.Generator
    objects); forks, nesting and snapshots draw bitwise the same values in either form."""
    plain = RNGStatesTracker("cpu", generator_states=False)
    other = RNGStatesTracker("cpu", generator_states=generator_states)
    draws = []
    for t in (plain, other):
        t.add("a", 11)
        t.add("b", 12)
        torch.manual_seed(0)
        with t.fork("a"):
            x = torch.rand(4)
            with t.fork("b"):
                y = torch.rand(4)
            snapshot = t.get_states()
            z = torch.rand(4)
        t.set_states(snapshot)
        with t.fork("a"):
            replay = torch.rand(4)
        draws.append((x, y, z, replay, torch.rand(4)))
    kind = torch.Generator if generator_states else torch.Tensor
    assert all(isinstance(state, kind) for state in other.get_states().values())
    for mine, theirs in zip(*draws, strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(draws[1][2], draws[1][3])


@pytest.mark.parametrize("generator_states", [False, True])
def test_set_states_converts_the_other_form(generator_states):
    """set_states takes a state tensor or a torch.Generator (what Megatron's and TE's
    trackers store) and keeps a copy in its own form: later draws do not touch the input."""
    tracker = RNGStatesTracker("cpu", generator_states=generator_states)
    source = torch.Generator().manual_seed(77)
    given = source.get_state() if generator_states else source.clone_state()
    tracker.set_states({"s": given})
    kind = torch.Generator if generator_states else torch.Tensor
    assert isinstance(tracker.get_states()["s"], kind)
    with tracker.fork("s"):
        drawn = torch.rand(5)
    assert torch.equal(drawn, torch.rand(5, generator=torch.Generator().manual_seed(77)))
    reread = given if isinstance(given, torch.Tensor) else given.get_state()
    assert torch.equal(reread, torch.Generator().manual_seed(77).get_state())


def test_reset_inside_a_fork_is_refused(tracker):
    tracker.add("a", 1)
    with tracker.fork("a"):
        before = full_state(tracker)
        with pytest.raises(TrackerBusyError):
            tracker.reset()
        assert full_state(tracker) == before


def test_open_forks_names_the_open_forks_and_active_is_its_deprecated_alias(tracker):
    tracker.add("a", 5)
    tracker.add("b", 6)
    with tracker.fork("a"), tracker.fork("b"):
        assert tracker.open_forks() == ("a", "b")
        with pytest.warns(DeprecationWarning, match=r"use open_forks\(\)"):
            assert tracker.active() == ("a", "b")
    assert tracker.open_forks() == ()
