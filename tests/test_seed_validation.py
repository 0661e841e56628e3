"""Seeding refuses what it cannot honour: coordinates naming no axis (a misspelt axis would
silently seed as rank 0), ranks that are not ints >= 0, and a base seed that Megatron's
arithmetic would carry past 2**64 - 1. Each refusal names what to do and changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rng_tracker import (
    RNGStatesTracker,
    RNGTrackerError,
    SeedReuseError,
    get_rng_tracker,
    model_parallel_seed,
    plan_seeds,
)
from rng_tracker._seeds import AXES
from rng_tracker.errors import (
    InvalidSeedError,
    RankError,
    SeedCoordinateError,
    SeedCoordinateTypeError,
    SeedOverflowError,
)
from rng_tracker.megatron import model_parallel_cuda_manual_seed


def _state(tracker: RNGStatesTracker) -> tuple:
    streams = tracker.state_dict()["streams"]
    return (
        bytes(torch.get_rng_state().tolist()),
        [(n, e["seed"], bytes(e["state"].tolist())) for n, e in streams.items()],
    )


@pytest.mark.parametrize("scheme", ["hashed", "megatron"])
@pytest.mark.parametrize("coordinates", [{"xx": 3}, {"tp": 1, "tensor": 2}, {"TP": 1}, {0: 1}])
def test_unknown_coordinate_axes_are_refused(scheme, coordinates):
    """{'xx': 3} was ignored, seeding as if every rank were 0."""
    with pytest.raises(SeedCoordinateError) as info:
        plan_seeds(7, scheme=scheme, coordinates=coordinates)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, KeyError)
    message = str(info.value)
    assert "unknown coordinate axis" in message and ", ".join(AXES) in message


@pytest.mark.parametrize(
    ("coordinates", "error", "builtin", "words"),
    [
        ([("tp", 1)], SeedCoordinateTypeError, TypeError, "mapping of axis name to rank"),
        ("tp=1", SeedCoordinateTypeError, TypeError, "got str"),
        ({"tp": -1}, RankError, ValueError, "tp_rank must be >= 0"),
        ({"pp": 1.0}, RankError, ValueError, "pp_rank must be an int"),
        ({"dp": True}, RankError, ValueError, "dp_rank must be an int"),
        ({"ep": "2"}, RankError, ValueError, "ep_rank must be an int"),
    ],
)
def test_bad_coordinates_are_typed_errors(coordinates, error, builtin, words):
    with pytest.raises(error) as info:
        plan_seeds(7, coordinates=coordinates)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert words in str(info.value)


def test_megatron_seed_past_two_to_the_64_is_refused_naming_the_largest_seed():
    """--seed 2**64-1 with the megatron scheme named a derived seed (18446744073709554333) the
    user never passed, with no way to tell which seed would work."""
    with pytest.raises(SeedOverflowError) as info:
        plan_seeds(2**64 - 1, scheme="megatron")
    assert isinstance(info.value, InvalidSeedError) and isinstance(info.value, ValueError)
    message = str(info.value)
    largest = 2**64 - 1 - 2718
    assert f"pass a seed of at most {largest}" in message and "'model-parallel-rng'" in message
    plan = plan_seeds(largest, scheme="megatron")
    assert max(plan.stream_seeds.values()) == 2**64 - 1


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    coordinates=st.fixed_dictionaries({axis: st.integers(0, 300) for axis in AXES}),
    dp_random_init=st.booleans(),
    below=st.integers(0, 2**16),
)
def test_the_named_largest_seed_is_exactly_the_boundary(coordinates, dp_random_init, below):
    """The seed the error names works and one more does not, at any coordinates."""
    kwargs = dict(
        scheme="megatron", coordinates=coordinates, data_parallel_random_init=dp_random_init
    )
    with pytest.raises(SeedOverflowError) as info:
        plan_seeds(2**64 - 1, **kwargs)  # Megatron adds at least 1024 to some stream
    largest = int(str(info.value).rsplit("at most ", 1)[1])
    try:
        plan = plan_seeds(largest - below, **kwargs)
    except SeedReuseError:  # Megatron's arithmetic collides at these ranks, whatever the seed
        pass
    else:
        assert max(plan.default_seed, *plan.stream_seeds.values()) <= 2**64 - 1
        if below == 0:
            assert max(plan.stream_seeds.values()) == 2**64 - 1
    with pytest.raises(SeedOverflowError):
        plan_seeds(largest + 1, **kwargs)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: model_parallel_seed(
            2**64 - 1, scheme="megatron", tracker=t, **{f"{a}_rank": 0 for a in AXES}
        ),
        lambda t: model_parallel_cuda_manual_seed(2**64 - 1, tp_rank=0, ep_rank=0, etp_rank=0),
        lambda t: model_parallel_cuda_manual_seed(  # the base passes, its GTP-remat stream not
            2**64 - 1 - 2718,
            tp_rank=0,
            ep_rank=0,
            etp_rank=0,
            gtp_remat_rank=0,
            gtp_remat_world_size=2,
        ),
    ],
)
def test_seeding_calls_refuse_the_overflow_before_touching_anything(call, tracker):
    """model_parallel_seed and Megatron's model_parallel_cuda_manual_seed (which drives the
    process tracker) leave every generator and stream as they were."""
    tracker.add("mine", 5)
    process = get_rng_tracker()
    before = _state(tracker), _state(process)
    with pytest.raises(SeedOverflowError, match="pass a seed of at most"):
        call(tracker)
    assert (_state(tracker), _state(process)) == before
