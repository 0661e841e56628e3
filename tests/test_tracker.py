"""The tracker of named streams: fork semantics, snapshots, state dicts, typed errors.

The tracker's edges: state dicts refuse what add() refuses, fork order is checked in every
mode (python -O too), names of the wrong type or of any size give short typed errors, and a
device this build lacks is named. Every refusal leaves every RNG state as it was.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import rng_tracker._device_rng as device_rng_module
import rng_tracker._tracker as tracker_module
from rng_tracker import (
    RNGStatesTracker,
    RNGTrackerError,
    SeedReuseError,
    UnknownStreamError,
    get_rng_tracker,
)
from rng_tracker._device_rng import default_generator
from rng_tracker.errors import (
    ArgumentTypeError,
    DuplicateStreamError,
    ForkOrderError,
    InvalidSeedError,
    InvalidSeedTypeError,
    StateDictError,
    StateDictTypeError,
    StreamNameError,
    TrackerBusyError,
    TrackerDeviceError,
    TrackerDeviceTypeError,
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
        (lambda t: t.fork("nope").__enter__(), UnknownStreamError, KeyError, "known: 'a'"),
        (lambda t: t.add("a", 99), DuplicateStreamError, KeyError, "already exists"),
        (lambda t: t.add("b", 1), SeedReuseError, ValueError, "already used by stream 'a'"),
        (lambda t: t.add("b", -1), InvalidSeedError, ValueError, "[0, 2**64)"),
        (lambda t: t.add("b", 2**64), InvalidSeedError, ValueError, "[0, 2**64)"),
        (lambda t: t.add("b", True), InvalidSeedTypeError, TypeError, "bool"),
        (lambda t: t.add("b", 1.5), InvalidSeedTypeError, TypeError, "float"),
        (lambda t: t.add("b", torch.tensor(True)), InvalidSeedTypeError, TypeError, "the bool"),
        (lambda t: t.add("", 3), StreamNameError, TypeError, "non-empty str"),
        (
            lambda t: t.set_states({"a": torch.zeros(3)}),
            TrackerDeviceError,
            ValueError,
            "generator state",
        ),
        (
            lambda t: t.set_states({"a": 1234}),  # an int for a state: the TypeError subclass
            TrackerDeviceTypeError,
            TypeError,
            "torch.Tensor or a torch.Generator",
        ),
        (
            lambda t: t.set_states({"a": "garbage"}),
            TrackerDeviceTypeError,
            TypeError,
            "stream 'a'",
        ),
        (lambda t: t.set_states([("a", 1)]), TrackerDeviceError, ValueError, "mapping"),
        (lambda t: t.set_states({7: torch.get_rng_state()}), StreamNameError, TypeError, "str"),
        (lambda t: t.load_state_dict({"version": 99}), StateDictError, ValueError, "version 99"),
        (lambda t: t.load_state_dict([1]), StateDictTypeError, TypeError, "got list"),
        (
            lambda t: t.load_state_dict({**t.state_dict(), "streams": [1]}),
            StateDictTypeError,
            TypeError,
            "no 'streams' mapping (got list)",
        ),
        (
            lambda t: t.load_state_dict(
                {**t.state_dict(), "streams": {"a": {"seed": 1, "state": torch.zeros(5056)}}}
            ),
            StateDictTypeError,
            TypeError,
            "must be a uint8 tensor, got torch.float32",
        ),
        # restore_states puts no state in that a later fork or get_states() could not use
        (
            lambda t: t.restore_states({"a": "garbage"}),
            StateDictTypeError,
            TypeError,
            "stream 'a': a generator state is a torch.Tensor or a torch.Generator, got str",
        ),
        (
            lambda t: t.restore_states([("a", torch.get_rng_state())]),
            StateDictTypeError,
            TypeError,
            "takes a mapping of stream name to state",
        ),
        (
            lambda t: t.restore_states({7: torch.get_rng_state()}),
            StreamNameError,
            TypeError,
            "non-empty str, got 7",
        ),
        (
            lambda t: t.restore_states({"a": torch.zeros(3)}),
            StateDictError,
            ValueError,
            "not a cpu generator state (dtype torch.float32",
        ),
        (
            lambda t: t.restore_states({"a": torch.zeros(3, dtype=torch.uint8)}),
            StateDictError,
            ValueError,
            "3 elements; a cpu state is a CPU uint8 tensor of",
        ),
        (
            lambda t: t.restore_states({"a": t.get_states()["a"], "b": None}),
            StateDictTypeError,
            TypeError,
            "stream 'b'",
        ),
        (
            lambda t: t.load_state_dict(
                {**t.state_dict(), "streams": {**t.state_dict()["streams"], 7: {"state": None}}}
            ),
            StateDictTypeError,
            TypeError,
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
            StateDictTypeError,
            TypeError,
            "got ('a',)",
        ),
        (
            lambda t: t.load_state_dict({**t.state_dict(), "device_type": "cuda"}),
            StateDictError,
            ValueError,
            "'cuda'",
        ),
        (
            lambda t: t.register_graph(object()),  # CUDA graphs register graph-safe states only
            TrackerDeviceError,
            ValueError,
            "needs graph-safe CUDA generator states",
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


@pytest.mark.parametrize("generator_states", [False, True])
def test_set_states_refuses_one_state_for_two_streams_changing_nothing(generator_states):
    """Two streams given one state would draw identical values, which add() and
    load_state_dict() refuse; set_states accepted it (and the tracker's own state_dict then
    failed to load). Refused with SeedReuseError, in either form (one Generator object for two
    streams too), with the streams as they were; distinct states still load."""
    tracker = RNGStatesTracker("cpu", generator_states=generator_states)
    tracker.add("a", 1)
    tracker.add("b", 2)
    before = full_state(tracker)
    one = torch.Generator().manual_seed(5)
    for state in (one.get_state(), one):
        with pytest.raises(SeedReuseError, match="'a' and 'b'"):
            tracker.set_states({"a": state, "b": state})
        assert full_state(tracker) == before
    tracker.set_states({"a": one, "b": torch.Generator().manual_seed(6)})
    tracker.load_state_dict(tracker.state_dict())  # the round trip holds


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


def _seeded(generator_states: bool | None = None) -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu", generator_states=generator_states)
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        torch.rand(3)
    return tracker


def _refused(tracker: RNGStatesTracker, call, error: type, builtin: type) -> RNGTrackerError:
    before = full_state(tracker)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert full_state(tracker) == before
    return info.value


# -- state dicts refuse what add() refuses -----------------------------------------------------


@pytest.mark.parametrize("generator_states", [False, True])
def test_load_state_dict_refuses_two_streams_of_one_seed_and_state(generator_states):
    """Two streams saved with one seed and state would draw identical values; add() refuses
    them, so load_state_dict does too."""
    tracker = _seeded(generator_states)
    saved = tracker.state_dict()
    a = saved["streams"]["a"]
    twin = {**saved, "streams": {"a": a, "b": {"seed": a["seed"], "state": a["state"].clone()}}}
    error = _refused(tracker, lambda: tracker.load_state_dict(twin), SeedReuseError, ValueError)
    assert "'a' and 'b'" in str(error) and "identical values" in str(error)
    tracker.load_state_dict(saved)  # a valid state dict still loads


def test_load_state_dict_refuses_a_reused_seed_or_a_shared_state_alone():
    tracker = _seeded()
    saved = tracker.state_dict()
    a, b = saved["streams"]["a"], saved["streams"]["b"]
    same_seed = {**saved, "streams": {"a": a, "b": {**b, "seed": a["seed"]}}}
    error = _refused(
        tracker, lambda: tracker.load_state_dict(same_seed), SeedReuseError, ValueError
    )
    assert f"same seed {a['seed']}" in str(error)
    same_state = {
        **saved,
        "streams": {"a": {**a, "seed": None}, "b": {"seed": None, "state": a["state"].clone()}},
    }
    error = _refused(
        tracker, lambda: tracker.load_state_dict(same_state), SeedReuseError, ValueError
    )
    assert "same generator state" in str(error)


# -- fork order, in every mode -----------------------------------------------------------------


def test_out_of_order_fork_exit_is_refused_and_changes_nothing():
    tracker = _seeded()
    outer, inner = tracker.fork("a"), tracker.fork("b")
    outer.__enter__()
    inner.__enter__()
    error = _refused(
        tracker, lambda: outer.__exit__(None, None, None), ForkOrderError, RuntimeError
    )
    assert "'a'" in str(error) and "innermost open fork is 'b'" in str(error)
    # The stack is intact: closing in order still gives each stream its own draws.
    b_draw = torch.rand(4)
    inner.__exit__(None, None, None)
    a_draw = torch.rand(4)
    outer.__exit__(None, None, None)
    reference_b = torch.Generator().manual_seed(2)
    assert torch.equal(b_draw, torch.rand(4, generator=reference_b))
    reference_a = torch.Generator().manual_seed(1)
    torch.rand(3, generator=reference_a)
    assert torch.equal(a_draw, torch.rand(4, generator=reference_a))
    with pytest.raises(ForkOrderError, match="no fork is open"):
        outer.__exit__(None, None, None)


def test_fork_order_is_checked_under_python_dash_O():
    """An assert vanishes under -O; the check must not (it guarded against corrupting streams)."""
    script = textwrap.dedent(
        """
        import sys, torch
        from rng_tracker import RNGStatesTracker
        from rng_tracker.errors import ForkOrderError

        if sys.flags.optimize != 1:
            raise SystemExit("not run under -O")
        t = RNGStatesTracker("cpu")
        t.add("a", 1)
        t.add("b", 2)
        outer, inner = t.fork("a"), t.fork("b")
        outer.__enter__()
        inner.__enter__()
        before = t.state_dict()
        try:
            outer.__exit__(None, None, None)
        except ForkOrderError:
            after = t.state_dict()
            same = t.open_forks() == ("a", "b") and all(
                torch.equal(before["streams"][n]["state"], after["streams"][n]["state"])
                for n in ("a", "b")
            )
            raise SystemExit(0 if same else "state changed")
        raise SystemExit("out-of-order exit accepted")
        """
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


# -- names of the wrong type, and of any size -----------------------------------------------------


@pytest.mark.parametrize("name", [["a"], ("a",), 7, None, b"a"])
def test_non_str_names_are_stream_name_errors(name):
    tracker = _seeded()
    _refused(tracker, lambda: tracker.fork(name).__enter__(), StreamNameError, TypeError)
    _refused(tracker, lambda: name in tracker, StreamNameError, TypeError)


def test_a_huge_stream_name_is_cut_in_error_messages():
    """A 100 kB name (from a bug upstream) must not print whole; the message stays readable
    and still shows how the name starts and how long it is."""
    tracker = _seeded()
    huge = "layer." + "x" * 100_000
    bad_state = {**tracker.state_dict(), "streams": {huge: {"seed": 5, "state": None}}}
    for call, error, builtin in (
        (lambda: tracker.fork(huge).__enter__(), UnknownStreamError, KeyError),
        (lambda: tracker.set_states({huge: 1234}), TrackerDeviceTypeError, TypeError),
        (lambda: tracker.load_state_dict(bad_state), StateDictError, ValueError),
    ):
        message = str(_refused(tracker, call, error, builtin))
        assert len(message) < 400, (error, len(message))
    message = str(
        _refused(tracker, lambda: tracker.fork(huge).__enter__(), UnknownStreamError, KeyError)
    )
    assert "'layer.xxx" in message and "100006 chars" in message
    tracker.add(huge, 3)
    for call, error, builtin in (
        (lambda: tracker.fork("nope").__enter__(), UnknownStreamError, KeyError),  # known names
        (lambda: tracker.add(huge, 4), DuplicateStreamError, KeyError),
        (lambda: tracker.add("c", 3), SeedReuseError, ValueError),
    ):
        message = str(_refused(tracker, call, error, builtin))
        assert len(message) < 600, (error, len(message))
    many = RNGStatesTracker("cpu")
    for i in range(1000):
        many.add(f"s{i}", i)
    message = str(
        _refused(many, lambda: many.fork("nope").__enter__(), UnknownStreamError, KeyError)
    )
    assert len(message) < 600 and "980 more" in message


# -- a device this build or machine lacks ---------------------------------------------------------


def _unavailable_device_types() -> list[str]:
    missing = []
    for kind in ("cuda", "xpu", "mps", "mtia", "hpu", "meta"):
        try:
            module = torch.get_device_module(kind)
        except RuntimeError:
            missing.append(kind)
            continue
        if not module.is_available():
            missing.append(kind)
    return missing


@pytest.mark.parametrize("kind", _unavailable_device_types())
def test_a_tracker_of_an_unavailable_device_is_a_typed_error(kind):
    """RNGStatesTracker('cuda') on a CPU-only build raised torch's bare AssertionError."""
    before = torch.get_rng_state()
    for call in (
        lambda: RNGStatesTracker(kind),
        lambda: RNGStatesTracker(f"{kind}:0"),
        lambda: get_rng_tracker(kind),
        lambda: default_generator(kind),
    ):
        with pytest.raises(TrackerDeviceError) as info:
            call()
        assert isinstance(info.value, ValueError)
        message = str(info.value)
        assert f"'{kind}" in message and "not available" in message and "device='cpu'" in message
    assert torch.equal(torch.get_rng_state(), before)


# -- device indices and flags of the wrong kind ---------------------------------------------------


def _registries() -> tuple:
    return set(tracker_module._PROCESS_TRACKERS), set(device_rng_module._DEVICE_RNGS)


@pytest.mark.parametrize("index", [-1, -5, 128, 2**70])
def test_a_device_index_out_of_range_is_a_typed_error(index):
    """get_rng_tracker(-1) raised torch's bare RuntimeError, 2**70 a bare ValueError, and 256
    wrapped round to device 0; all are refused and no tracker is made."""
    before, registries = torch.get_rng_state(), _registries()
    for call in (lambda: get_rng_tracker(index), lambda: RNGStatesTracker(index)):
        with pytest.raises(TrackerDeviceError, match=r"device index must be in \[0, 127\]") as info:
            call()
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
        assert f"got {index}" in str(info.value) and "visible device" in str(info.value)
    assert torch.equal(torch.get_rng_state(), before) and _registries() == registries


@pytest.mark.parametrize("flag", ["no", "", 1, 0, torch.tensor(True)])
def test_generator_states_must_be_a_bool_or_none(flag):
    """generator_states='no' made a tracker of generator states (a non-empty str is true)."""
    registries = _registries()
    with pytest.raises(ArgumentTypeError, match="generator_states must be a bool") as info:
        RNGStatesTracker("cpu", generator_states=flag)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert _registries() == registries


@pytest.mark.parametrize("generator_states", [False, True])
def test_a_refused_restore_leaves_every_stream_usable(generator_states):
    """restore_states({'a': 'garbage'}) used to drop stream 'b' and leave 'a' a str that made
    get_states(), state_dict() and fork() raise AttributeError; now it changes nothing, and a
    real snapshot still restores in both state forms."""
    tracker = _seeded(generator_states)
    snapshot = tracker.get_states()
    if generator_states:  # a str where a generator state goes: the wrong type
        bad, error, builtin = {"a": "garbage"}, StateDictTypeError, TypeError
    else:  # a float tensor where a uint8 state goes: the wrong value
        bad, error, builtin = {"a": torch.zeros(3)}, StateDictError, ValueError
    _refused(tracker, lambda: tracker.restore_states(bad), error, builtin)
    assert tracker.names() == ["a", "b"]
    with tracker.fork("a"):
        torch.rand(3)
    tracker.restore_states(snapshot)
    assert full_state(tracker)[2] == full_state(_seeded(generator_states))[2]


@pytest.mark.parametrize("generator_states", [False, True], ids=["uint8 states", "generators"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_or_pickled_tracker_forks_the_default_generator(generator_states, how):
    """A copy (an EMA copy of a model that holds the tracker, a pickle) copied the device's
    generator too, so its forks swapped states into a generator nothing draws from: its
    dropout drew the default generator's values, silently. Now it forks the same default
    generator, from copies of the streams (an open fork's live state), with no fork open, and
    checkpoints replay it; Megatron's tracker copies that way too. The facade's attributes
    stay."""
    import copy
    import pickle

    from rng_tracker import megatron as mg
    from rng_tracker._tracker import all_trackers

    tracker = mg.CudaRNGStatesTracker(use_cudagraphable_rng=generator_states)
    tracker.add("a", 1)
    tracker.add("b", 2)
    with tracker.fork("a"):
        torch.rand(3)  # the live state of "a" is past its stored one
        copied = (
            copy.deepcopy(tracker) if how == "deepcopy" else pickle.loads(pickle.dumps(tracker))
        )
        expected = torch.rand(4)
    assert copied.open_forks() == () and copied.seeds() == {"a": 1, "b": 2}
    assert copied.use_cudagraphable_rng is generator_states and copied.is_initialized()
    assert copied.generator is torch.default_generator and copied in all_trackers()
    torch.manual_seed(0)
    with copied.fork("a"):
        drawn = torch.rand(4)
    after = torch.rand(4)  # the default generator is back where the fork found it
    assert torch.equal(drawn, expected)
    assert torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(0)))


def test_a_fork_decorates_a_function_as_megatrons_does():
    """Megatron's fork is a @contextmanager, so ``@tracker.fork()`` decorates a function; ours
    raised "'_Fork' object is not callable". Each call runs in its own fork: a recursive call
    re-enters the open stream and continues it."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 1)
    twin = RNGStatesTracker("cpu")
    twin.add("model-parallel-rng", 1)

    @tracker.fork()
    def draw(times: int) -> list[torch.Tensor]:
        return [torch.rand(2), *(draw(times - 1) if times > 1 else [])]

    torch.manual_seed(0)
    decorated = draw(3)
    outside = torch.rand(2)
    torch.manual_seed(0)
    with twin.fork():
        expected = [torch.rand(2) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(decorated, expected, strict=True))
    assert torch.equal(outside, torch.rand(2)) and tracker.open_forks() == ()
    assert draw.__name__ == "draw"


def test_a_tracker_without_streams_is_true_as_megatrons_is():
    """len() counts the streams, but an empty tracker (an inference one, one before seeding)
    was false: ``if tracker:`` and ``tracker or fallback`` differed from Megatron's."""
    from rng_tracker import megatron as mg

    empty = RNGStatesTracker("cpu")
    assert len(empty) == 0 and bool(empty) is True
    assert bool(mg.CudaRNGStatesTracker()) is True


def test_a_fork_checks_its_stream_on_entry_as_megatrons_does():
    """Megatron's @contextmanager fork checks the name when its body runs, so a function may
    be decorated before its stream is added; ours refused at decoration time. An unknown name or
    one of the wrong type is refused on entry, with or without a decorator, changing nothing."""
    tracker = RNGStatesTracker("cpu")

    @tracker.fork("late")
    def draw() -> torch.Tensor:
        return torch.rand(4)

    unknown, badly_named = tracker.fork("nope"), tracker.fork(7)  # type: ignore[arg-type]
    tracker.add("other", 2)
    _refused(tracker, draw, UnknownStreamError, KeyError)
    _refused(tracker, unknown.__enter__, UnknownStreamError, KeyError)
    _refused(tracker, badly_named.__enter__, StreamNameError, TypeError)
    tracker.add("late", 3)
    torch.manual_seed(0)
    drawn, after = draw(), torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=fresh(3)))
    assert torch.equal(after, torch.rand(4, generator=fresh(0)))


def test_cpu_seeds_equal_modulo_two_to_the_32_are_one_seed():
    """torch's CPU generator (mt19937) uses only a seed's low 32 bits: streams of seeds 5 and
    5 + 2**32 drew identical values, and add() took them as distinct. add() and
    load_state_dict() refuse such seeds, and two states that differ only in the seed they store."""
    high = 5 + 2**32
    assert torch.equal(torch.rand(8, generator=fresh(5)), torch.rand(8, generator=fresh(high)))
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 5)
    error = _refused(tracker, lambda: tracker.add("b", high), SeedReuseError, ValueError)
    assert "equal modulo 2**32" in str(error) and "low 32 bits" in str(error)
    tracker.add("b", 6)
    saved = tracker.state_dict()
    a, b = saved["streams"]["a"], saved["streams"]["b"]
    same_low_bits = {**saved, "streams": {"a": a, "b": {**b, "seed": high}}}
    error = _refused(
        tracker, lambda: tracker.load_state_dict(same_low_bits), SeedReuseError, ValueError
    )
    assert f"the seeds 5 and {high}" in str(error)
    twin = {"seed": None, "state": fresh(high).get_state()}  # a's state, another stored seed
    same_draws = {**saved, "streams": {"a": {**a, "seed": None}, "b": twin}}
    error = _refused(
        tracker, lambda: tracker.load_state_dict(same_draws), SeedReuseError, ValueError
    )
    assert "same generator state" in str(error)
    tracker.load_state_dict(saved)  # a valid state dict still loads


def _state_views() -> tuple[torch.Tensor, torch.Tensor]:
    """The states of seeds 1 and 2 as views into one buffer at storage offsets 7 and 7 + n, as
    torch.load gives states saved as views (torch's set_state misreads such a view)."""
    one, two = fresh(1).get_state(), fresh(2).get_state()
    flat = torch.cat([torch.zeros(7, dtype=torch.uint8), one, two])
    n = one.numel()
    return flat[7 : 7 + n], flat[7 + n :]


@pytest.mark.parametrize("generator_states", [False, True], ids=["uint8 states", "generators"])
def test_state_views_at_a_storage_offset_install_their_own_bytes(generator_states):
    """A state tensor that is a view at a storage offset was handed to torch as it was: torch
    read other bytes ("Invalid mt19937 state", wrong draws, or a crash). set_states,
    restore_states and load_state_dict now install exactly the view's values."""
    one, two = _state_views()
    expected = {"a": torch.rand(5, generator=fresh(1)), "b": torch.rand(5, generator=fresh(2))}
    sd = {
        "version": 1,
        "device_type": "cpu",
        "streams": {"a": {"seed": None, "state": one}, "b": {"seed": None, "state": two}},
    }
    for put in (
        lambda t: t.set_states({"a": one, "b": two}),
        lambda t: t.restore_states({"a": one, "b": two}),
        lambda t: t.load_state_dict(sd),
    ):
        tracker = RNGStatesTracker("cpu", generator_states=generator_states)
        put(tracker)
        for name, values in expected.items():
            with tracker.fork(name):
                assert torch.equal(torch.rand(5), values)
    strided = torch.stack([one.clone(), two.clone()], dim=1).flatten()[::2]  # seed 1's, strided
    tracker = RNGStatesTracker("cpu", generator_states=generator_states)
    tracker.set_states({"a": strided})
    with tracker.fork("a"):
        assert torch.equal(torch.rand(5), expected["a"])


def _fork_grads(run: str) -> tuple[torch.Tensor, list[str]]:
    """x's gradient through a fork's dropout, checkpointed as ``run`` says, and the warnings."""
    import warnings

    import torch.utils.checkpoint as torch_checkpoint

    from rng_tracker import checkpoint, rng_context_fn

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 5)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(x, 0.5)

    runs = {
        "eager": block,
        "torch": lambda x: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
        "torch_with_rng_context_fn": lambda x: torch_checkpoint.checkpoint(
            block, x, use_reentrant=False, context_fn=rng_context_fn(tracker)
        ),
        "rng_tracker": lambda x: checkpoint(block, x, tracker=tracker),
        "torch_inside_rng_tracker": lambda x: checkpoint(runs["torch"], x, tracker=tracker),
    }
    x = torch.ones(64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (runs[run](x) * torch.arange(64.0)).sum().backward()
    return x.grad, [type(w.message).__name__ for w in caught]


def test_a_fork_in_torchs_own_checkpoint_warns_that_its_recompute_draws_other_values() -> None:
    """torch's checkpoint replays the default generators, not the tracker's streams: a fork in
    its forward recomputes from the stream's advanced state (gradients of another mask, which
    the test shows), so the fork warns ForkNotReplayedWarning. Under rng_tracker's checkpoint,
    or torch's with rng_context_fn, the gradients are the eager ones and nothing warns."""
    eager, warned = _fork_grads("eager")
    assert warned == []
    for run in ("torch", "torch_inside_rng_tracker"):  # the inner torch one replays no stream
        grad, warned = _fork_grads(run)
        assert warned == ["ForkNotReplayedWarning"] and not torch.equal(grad, eager), run
    for run in ("torch_with_rng_context_fn", "rng_tracker"):
        grad, warned = _fork_grads(run)
        assert warned == [] and torch.equal(grad, eager), run


def test_the_fork_warning_raised_as_an_error_leaves_no_fork_open() -> None:
    """Under -W error the warning raises from the fork's entry: the fork is closed again and
    the generator is where it was, so the tracker is usable (reset() works)."""
    import warnings

    import torch.utils.checkpoint as torch_checkpoint

    from rng_tracker.errors import ForkNotReplayedWarning

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 5)
    state = torch.get_rng_state()

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error", ForkNotReplayedWarning)
        with pytest.raises(ForkNotReplayedWarning):
            torch_checkpoint.checkpoint(
                block, torch.ones(2, requires_grad=True), use_reentrant=False
            )
    assert tracker.open_forks() == () and torch.equal(torch.get_rng_state(), state)
    tracker.reset()


def test_the_fork_warning_names_the_users_line_with_or_without_a_decorator() -> None:
    """ForkNotReplayedWarning points at the line that forks: the ``with`` statement, or the call
    of a function decorated with ``@tracker.fork()``, never a line of rng_tracker."""
    import inspect
    import warnings

    import torch.utils.checkpoint as torch_checkpoint

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 5)

    @tracker.fork()
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    lines = {}

    def block(x: torch.Tensor) -> torch.Tensor:
        lines["with"] = inspect.currentframe().f_lineno + 1
        with tracker.fork():
            x = x * 2
        lines["decorated"] = inspect.currentframe().f_lineno + 1
        return scaled(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_checkpoint.checkpoint(block, torch.ones(2, requires_grad=True), use_reentrant=False)
    sites = [(w.filename, w.lineno) for w in caught if w.category.__name__.startswith("ForkNot")]
    assert sites == [(__file__, lines["with"]), (__file__, lines["decorated"])]


class _ForkedDropout(torch.nn.Module):
    def __init__(self, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker.fork():
            return torch.nn.functional.dropout(x, 0.5, training=self.training)


class _DecoratedForkDropout(torch.nn.Module):
    def __init__(self, tracker: RNGStatesTracker) -> None:
        super().__init__()
        self.dropout = tracker.fork()(torch.nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x)


def test_a_fork_under_strict_export_is_refused_on_entry_with_the_way_out() -> None:
    """Dynamo cannot trace a fork's swap of generator states and export allows no graph break:
    a fork under strict export failed with "Failed to convert args/kwargs to proxy" (drawing or
    not), a decorated one with "Skip calling torch.compiler.disable()d function"; both are
    refused on entry, nothing changed, naming strict=False and the keyed seed."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 5)
    before = tracker.get_states()
    for module in (
        _ForkedDropout(tracker),
        _ForkedDropout(tracker).eval(),
        _DecoratedForkDropout(tracker),
    ):
        with pytest.raises(torch._dynamo.exc.Unsupported, match="strict=False") as caught:
            torch.export.export(module, (torch.ones(4, 8),), strict=True)
        # Dynamo wraps the refusal (a ForkTracedError) in its own error; the message is ours
        assert "ForkTracedError" in str(caught.value) and "keyed" in str(caught.value)
        assert tracker.open_forks() == ()
        assert torch.equal(tracker.get_states()["model-parallel-rng"], before["model-parallel-rng"])


class _DrawBeforeTheFork(_ForkedDropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.dropout(x, 0.5)  # the default generator's draw, traced as such
        with self.tracker.fork():
            return y + 1


def test_a_draw_inside_a_fork_under_a_graph_trace_is_refused_and_a_drawless_fork_traces() -> None:
    """make_fx and torch.export (strict=False) record a fork's draws but not its swap of
    generator states, so the traced program would draw from the default generator: a draw in
    a fork there raises ForkTracedError (the fork closed, the stream where it was). An eval
    export, whose fork draws nothing, traces; and a traced program run inside a fork draws the
    stream, as eager does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from rng_tracker.errors import ForkTracedError

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 5)
    module, x = _ForkedDropout(tracker), torch.ones(4, 8)
    before = tracker.get_states()
    for trace in (
        lambda: make_fx(module)(x),
        lambda: torch.export.export(module, (x,), strict=False),
    ):
        with pytest.raises(ForkTracedError, match="keyed seed"):
            trace()
        assert tracker.open_forks() == ()
        assert torch.equal(tracker.get_states()["model-parallel-rng"], before["model-parallel-rng"])
    program = torch.export.export(module.eval(), (x,), strict=False).module()
    assert torch.equal(program(x), x)
    dropout = torch.export.export(torch.nn.Dropout(0.5).train(), (x,), strict=False).module()
    with tracker.fork():
        traced = dropout(x)
    tracker.set_states(before)
    with tracker.fork():
        eager = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(traced, eager)
    # only what the trace records inside the fork counts: a draw before it is not the fork's
    from torch.fx.experimental.proxy_tensor import make_fx as trace

    graph = trace(_DrawBeforeTheFork(tracker))(x).graph
    seeded = torch.Tag.nondeterministic_seeded
    assert any(seeded in getattr(node.target, "tags", ()) for node in graph.nodes)


def test_a_state_dict_version_given_as_a_bool_is_a_type_error():
    """version=True (and 1.0) equals 1 and was loaded as version 1; a version is an int."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    saved = tracker.state_dict()
    with tracker.fork("a"):
        torch.rand(2)
    before, cpu = tracker.get_states(), torch.get_rng_state()
    for version in (True, False, 1.0, "1"):
        kind = type(version).__name__
        with pytest.raises(StateDictTypeError, match=f"version {version!r} is a {kind}") as info:
            tracker.load_state_dict({**saved, "version": version})
        assert isinstance(info.value, StateDictError) and isinstance(info.value, TypeError)
        assert isinstance(info.value, RNGTrackerError)
        after = tracker.get_states()
        assert after.keys() == before.keys() and torch.equal(after["a"], before["a"])
        assert torch.equal(torch.get_rng_state(), cpu)
    with pytest.raises(StateDictError, match="version 2 is not supported") as value:
        tracker.load_state_dict({**saved, "version": 2})
    assert not isinstance(value.value, TypeError)


def test_a_cpu_device_index_other_than_0_is_refused():
    """get_rng_tracker("cpu:3") gave the CPU tracker: torch keeps the index of torch.device
    ("cpu:3") but allocates and draws on the one CPU device (its tensors and generators say
    "cpu"), so a per-rank "cpu:<rank>" would silently share one generator across the "devices".
    torch.cpu.device_count() is 1, so, as for "cuda:5" on one GPU, an index past it is refused,
    by every entry that takes a device; "cpu:0" is that device."""
    assert torch.cpu.device_count() == 1
    cpu = get_rng_tracker("cpu")
    streams = {n: s.clone() for n, s in cpu.get_states().items()}
    state = torch.get_rng_state()
    from rng_tracker import RNGStatesTracker, get_keyed_rng

    for device in ("cpu:3", torch.device("cpu", 1)):
        for make in (get_rng_tracker, RNGStatesTracker, get_keyed_rng):  # one rule, every entry
            with pytest.raises(
                TrackerDeviceError, match="does not exist: there is one cpu"
            ) as info:
                make(device)
            assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    assert get_rng_tracker("cpu:0") is cpu and get_rng_tracker(torch.device("cpu", 0)) is cpu
    assert torch.equal(torch.get_rng_state(), state)
    after = cpu.get_states()
    assert after.keys() == streams.keys()
    assert all(torch.equal(after[n], streams[n]) for n in streams)


def test_the_cpu_generator_warning_names_the_users_line_of_a_with_and_of_a_decorated_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork of an accelerator's tracker warns where the CPU generator moved inside it, at the
    user's line (the with, or the call of a decorated function), once per line. The CUDA tests
    run it on a GPU; here a CPU tracker's fork is made to compare the CPU generator against a
    state it never had, so the warning's site is checked on every machine."""
    import inspect
    import warnings

    from rng_tracker.errors import CPURNGChangedWarning

    open_fork = tracker_module._Fork._open

    def open_as_on_an_accelerator(self, frames_to_user: int = 1) -> None:
        open_fork(self, frames_to_user)
        self._cpu_before = torch.zeros_like(torch.default_generator.get_state())

    monkeypatch.setattr(tracker_module._Fork, "_open", open_as_on_an_accelerator)
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 5)

    @tracker.fork("a")
    def decorated() -> None:
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_line = inspect.currentframe().f_lineno + 2
        for _ in range(2):
            with tracker.fork("a"):
                pass
        call_line = inspect.currentframe().f_lineno + 1
        decorated()
        decorated()
    sites = [(w.filename, w.lineno) for w in caught if issubclass(w.category, CPURNGChangedWarning)]
    assert sites == [(__file__, with_line), (__file__, call_line), (__file__, call_line + 1)]
