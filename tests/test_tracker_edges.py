"""The tracker's edges: state dicts refuse what add() refuses, fork order is checked in every
mode (python -O too), names of the wrong type or of any size give short typed errors, and a
device this build lacks is named. Every refusal leaves every RNG state as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from rng_tracker import (
    RNGStatesTracker,
    RNGTrackerError,
    SeedReuseError,
    UnknownStreamError,
    get_rng_tracker,
)
from rng_tracker._device_rng import default_generator
from rng_tracker.errors import (
    DuplicateStreamError,
    ForkOrderError,
    StateDictError,
    StreamNameError,
    TrackerDeviceError,
)


def full_state(tracker: RNGStatesTracker) -> tuple:
    """Every RNG state a refused call must leave alone, as comparable plain values."""
    streams = tracker.state_dict()["streams"]
    return (
        bytes(torch.get_rng_state().tolist()),
        tracker.open_forks(),
        [(name, entry["seed"], bytes(entry["state"].tolist())) for name, entry in streams.items()],
    )


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
    _refused(tracker, lambda: tracker.fork(name), StreamNameError, TypeError)
    _refused(tracker, lambda: name in tracker, StreamNameError, TypeError)


def test_a_huge_stream_name_is_cut_in_error_messages():
    """A 100 kB name (from a bug upstream) must not print whole; the message stays readable
    and still shows how the name starts and how long it is."""
    tracker = _seeded()
    huge = "layer." + "x" * 100_000
    bad_state = {**tracker.state_dict(), "streams": {huge: {"seed": 5, "state": None}}}
    for call, error, builtin in (
        (lambda: tracker.fork(huge), UnknownStreamError, KeyError),
        (lambda: tracker.set_states({huge: 1234}), TrackerDeviceError, ValueError),
        (lambda: tracker.load_state_dict(bad_state), StateDictError, ValueError),
    ):
        message = str(_refused(tracker, call, error, builtin))
        assert len(message) < 400, (error, len(message))
    message = str(_refused(tracker, lambda: tracker.fork(huge), UnknownStreamError, KeyError))
    assert "'layer.xxx" in message and "100006 chars" in message
    tracker.add(huge, 3)
    for call, error, builtin in (
        (lambda: tracker.fork("nope"), UnknownStreamError, KeyError),  # lists the known names
        (lambda: tracker.add(huge, 4), DuplicateStreamError, KeyError),
        (lambda: tracker.add("c", 3), SeedReuseError, ValueError),
    ):
        message = str(_refused(tracker, call, error, builtin))
        assert len(message) < 600, (error, len(message))
    many = RNGStatesTracker("cpu")
    for i in range(1000):
        many.add(f"s{i}", i)
    message = str(_refused(many, lambda: many.fork("nope"), UnknownStreamError, KeyError))
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
