"""Seed derivation: Megatron's exact arithmetic, the collision-free hashed scheme, real ranks.

Seeding refuses what it cannot honour: coordinates naming no axis (a misspelt axis would
silently seed as rank 0), ranks that are not ints >= 0, and a base seed that Megatron's
arithmetic would carry past 2**64 - 1. Each refusal names what to do and changes nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rng_tracker import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    RNGTrackerError,
    SeedReuseError,
    get_rng_tracker,
    model_parallel_seed,
    plan_seeds,
)
from rng_tracker import _seeds as seeds_module
from rng_tracker import megatron as mg
from rng_tracker._streams import AXES
from rng_tracker.errors import (
    ArgumentTypeError,
    InvalidSeedError,
    InvalidSeedTypeError,
    RankError,
    RankTypeError,
    SeedCoordinateError,
    SeedCoordinateTypeError,
    SeedOverflowError,
    SeedSchemeError,
    StreamNameError,
)
from rng_tracker.megatron import model_parallel_cuda_manual_seed
from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
from rng_tracker.parallel.testing import run_distributed

STREAMS = (DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG)
LIMITS = {"tp": 64, "pp": 64, "ep": 256, "etp": 8, "dp": 1024}


def test_megatron_scheme_reproduces_megatrons_numbers():
    """default = s + 100 pp + 10 dp; mp = default + 2718 + tp; ep = default + 1024 + 100 ep + etp."""
    coords = {"tp": 3, "pp": 2, "dp": 5, "ep": 4, "etp": 1}
    plan = plan_seeds(1234, scheme="megatron", coordinates=coords, data_parallel_random_init=True)
    assert plan.default_seed == 1234 + 200 + 50
    assert plan.stream_seeds == {
        DATA_PARALLEL_RNG: 1484,
        MODEL_PARALLEL_RNG: 1484 + 2718 + 3,
        EXPERT_PARALLEL_RNG: 1484 + 1024 + 400 + 1,
    }
    without = plan_seeds(1234, scheme="megatron", coordinates=coords)
    assert without.default_seed == 1434


def test_megatron_compat_seeding_draws_megatrons_streams():
    """model_parallel_cuda_manual_seed seeds the streams exactly as Megatron would."""
    tracker = mg.get_cuda_rng_tracker()
    plan = mg.model_parallel_cuda_manual_seed(42, tp_rank=1, ep_rank=2, etp_rank=0)
    assert plan.stream_seeds[MODEL_PARALLEL_RNG] == 42 + 2718 + 1
    assert tracker is get_rng_tracker() and tracker.names() == list(STREAMS)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(42)))
    with tracker.fork(mg.get_expert_parallel_rng_tracker_name()):
        drawn = torch.rand(4)
    assert torch.equal(
        drawn, torch.rand(4, generator=torch.Generator().manual_seed(42 + 1024 + 200))
    )


def test_megatron_collision_is_reported_and_changes_nothing():
    """ep_rank 17, tp_rank 6: Megatron gives mp and ep streams one seed; we refuse it."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("keep", 1)
    cpu_before = torch.get_rng_state()
    with pytest.raises(SeedReuseError, match=r"model-parallel-rng.*expert-parallel-rng"):
        model_parallel_seed(
            7,
            scheme="megatron",
            tp_rank=6,
            ep_rank=17,
            etp_rank=0,
            pp_rank=0,
            dp_rank=0,
            tracker=tracker,
        )
    assert tracker.names() == ["keep"] and torch.equal(torch.get_rng_state(), cpu_before)
    with pytest.raises(SeedReuseError) as info:
        mg.model_parallel_cuda_manual_seed(7, tp_rank=6, ep_rank=17, etp_rank=0)
    # the advice holds where the call has no scheme to change (it said "use scheme='hashed'")
    assert "rng_tracker.model_parallel_seed(seed, scheme='hashed')" in str(info.value)


def test_ranks_too_large_for_megatrons_arithmetic_are_named_not_the_seed():
    """With tp_rank=2**64 no base seed fits; the error advised "a seed of at most -2719"."""
    with pytest.raises(SeedOverflowError) as info:
        plan_seeds(0, scheme="megatron", coordinates={"tp": 2**64})
    message = str(info.value)
    assert "at most -" not in message
    assert "tp=18446744073709551616" in message and "too large for its arithmetic" in message


def test_seeds_one_to_the_cpu_generator_are_refused_before_anything_changes():
    """Megatron's arithmetic at etp_rank 2**32 + 1694 gives model-parallel-rng and
    expert-parallel-rng seeds 2**32 apart: distinct, but one seed to torch's CPU generator (it
    uses a seed's low 32 bits), so the two streams drew identical masks. Seeding a CPU tracker
    refuses them, and leaves the tracker and the CPU generator as they were."""
    ranks = {"tp_rank": 0, "ep_rank": 0, "etp_rank": 2**32 + 1694, "pp_rank": 0, "dp_rank": 0}
    plan = plan_seeds(7, scheme="megatron", coordinates={"etp": ranks["etp_rank"]})
    mp, ep = plan.stream_seeds[MODEL_PARALLEL_RNG], plan.stream_seeds[EXPERT_PARALLEL_RNG]
    assert ep - mp == 2**32  # the plan itself is unchanged: only the CPU tracker refuses it
    tracker = RNGStatesTracker("cpu")
    tracker.add("keep", 1)
    cpu_before = torch.get_rng_state()
    with pytest.raises(SeedReuseError, match=r"equal modulo 2\*\*32") as info:
        model_parallel_seed(7, scheme="megatron", tracker=tracker, **ranks)
    assert MODEL_PARALLEL_RNG in str(info.value) and EXPERT_PARALLEL_RNG in str(info.value)
    assert tracker.names() == ["keep"] and torch.equal(torch.get_rng_state(), cpu_before)


def _inverse_feistel64(key: bytes, value: int) -> int:
    import hashlib

    left, right = value >> 32, value & 0xFFFFFFFF
    for round_index in reversed(range(4)):
        digest = hashlib.blake2b(
            bytes((round_index,)) + left.to_bytes(4, "little"), digest_size=4, key=key
        ).digest()
        left, right = right ^ int.from_bytes(digest, "little"), left
    return (left << 32) | right


def test_hashed_scheme_is_injective_over_the_claimed_ranges():
    """Distinct (stream, coordinates) never share a seed for tp<=64, pp<=64, ep<=256, etp<=8, dp<=1024.

    The seed is P_k(encode(stream, coords)): encode packs each rank in a fixed-width field
    under a stream id, so it is injective while every rank fits its field, and P_k is a
    Feistel network, a permutation of 64-bit words. We check both parts (the field widths
    cover the ranges; P_k inverts exactly), then compute seeds directly on large grids.
    """
    for axis, limit in LIMITS.items():
        assert limit - 1 < 1 << seeds_module._FIELD_BITS[axis]
    for stream in seeds_module._STREAM_IDS:
        axes = seeds_module.stream_axes(stream, data_parallel_random_init=True)
        assert 4 + sum(seeds_module._FIELD_BITS[a] for a in axes) <= 64, stream
    key = bytes(range(32))
    rng = random.Random(0)
    for value in [0, 2**64 - 1, *(rng.getrandbits(64) for _ in range(5000))]:
        assert _inverse_feistel64(key, seeds_module._feistel64(key, value)) == value

    seen: dict[int, tuple] = {}
    key = seeds_module._seed_key(1234)

    def record(stream: str, coords: dict[str, int], dp_random_init: bool) -> None:
        axes = seeds_module.stream_axes(stream, data_parallel_random_init=dp_random_init)
        ident = (stream, *(coords[a] for a in axes))
        seed = seeds_module._hashed_seed(key, stream, coords, axes)
        assert seen.setdefault(seed, ident) == ident, f"{ident} and {seen[seed]} share seed {seed}"

    zero = dict.fromkeys(seeds_module.AXES, 0)
    for tp, pp in itertools.product(range(64), range(64)):
        record(MODEL_PARALLEL_RNG, {**zero, "tp": tp, "pp": pp}, False)
    for ep, etp, pp in itertools.product(range(256), range(8), (0, 63)):
        record(EXPERT_PARALLEL_RNG, {**zero, "ep": ep, "etp": etp, "pp": pp}, False)
    for stream in ("default", DATA_PARALLEL_RNG):
        for pp, dp in itertools.product(range(64), range(0, 1024, 8)):
            record(stream, {**zero, "pp": pp, "dp": dp}, True)
    for _ in range(20000):
        coords = {axis: rng.randrange(limit) for axis, limit in LIMITS.items()} | {"cp": 0}
        record(rng.choice((MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG)), coords, True)


def test_megatron_arithmetic_collides_where_hashed_does_not():
    """Over tp<64 and ep<256 Megatron's formulas map distinct stream coordinates to one seed."""
    megatron = {2718 + tp for tp in range(64)} & {
        1024 + 100 * ep + etp for ep in range(256) for etp in range(8)
    }
    assert megatron  # e.g. 2724 = 2718 + 6 = 1024 + 100 * 17 + 0
    plan = plan_seeds(0, coordinates={"tp": 6, "ep": 17})
    assert len(set(plan.stream_seeds.values())) == 3


def test_bad_scheme_and_ranks_are_typed_errors():
    with pytest.raises(
        SeedSchemeError, match=r"^scheme must be 'hashed' or 'megatron', got str 'md5'"
    ):
        plan_seeds(1, scheme="md5")
    with pytest.raises(SeedSchemeError, match="got list"):
        plan_seeds(1, scheme=["hashed"])
    with pytest.raises(RankError, match="tp_rank must be >= 0"):
        plan_seeds(1, coordinates={"tp": -1})
    with pytest.raises(RankError, match="exceeds"):
        plan_seeds(1, coordinates={"etp": 256})


def _seeded_draws(scheme: str) -> dict:
    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    plan = model_parallel_seed(2024, scheme=scheme)
    tracker = get_rng_tracker("cpu")
    draws = {"default": torch.rand(16)}
    for name in STREAMS:
        with tracker.fork(name):
            draws[name] = torch.rand(16)
    gathered = {}
    for name, value in draws.items():
        out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(out, value)
        gathered[name] = out
    destroy_model_parallel()
    return {"plan": plan, "draws": gathered, "tp": state.rank("tp"), "dp": state.rank("dp")}


@pytest.mark.parametrize("scheme", ["hashed", "megatron"])
def test_model_parallel_seed_on_4_ranks(scheme):
    """tp=2, dp=2: default and data-parallel streams agree across TP; model-parallel differs.

    The expert stream differs too: with expert=1 the expert-tensor-parallel rank is the TP rank.
    """
    results = run_distributed(_seeded_draws, world_size=4, args=(scheme,))
    draws = results[0]["draws"]
    tp_groups = [[0, 1], [2, 3]]  # tp is the fastest-varying axis
    for group in tp_groups:
        a, b = group
        assert (results[a]["tp"], results[b]["tp"]) == (0, 1)
        for name in ("default", DATA_PARALLEL_RNG):
            assert torch.equal(draws[name][a], draws[name][b]), name
        for name in (MODEL_PARALLEL_RNG, EXPERT_PARALLEL_RNG):
            assert not torch.equal(draws[name][a], draws[name][b]), name
    if scheme == "megatron":
        for result in results:
            assert result["plan"].default_seed == 2024
            assert result["plan"].stream_seeds[MODEL_PARALLEL_RNG] == 2024 + 2718 + result["tp"]
            assert result["plan"].coordinates["dp"] == result["dp"]


def test_a_seed_of_the_wrong_type_is_also_an_invalid_seed(tracker):
    """`except InvalidSeedError` catches every bad seed, of a bad value or a bad type."""
    for bad in (1.5, True, "7", None):
        with pytest.raises(InvalidSeedError, match="seed must be an int"):
            tracker.add("a", bad)
    with pytest.raises(InvalidSeedError):
        plan_seeds(2.0)
    assert tracker.names() == []


class _Ranks:
    """A ParallelState-like layout: just the ranks."""

    def __init__(self, **ranks: int) -> None:
        self.ranks = ranks

    def rank(self, axis: str) -> int:
        return self.ranks.get(axis, 0)


def test_the_process_layout_is_read_only_at_the_entry_point_and_only_when_needed(monkeypatch):
    """model_parallel_seed(layout=...) seeds from the layout it is given; the process-wide
    layout is looked up once, at the entry point, and only when ranks are missing."""
    import rng_tracker.parallel._megatron_state as megatron_state

    lookups: list[int] = []
    monkeypatch.setattr(megatron_state, "current_layout", lambda: lookups.append(1))
    plan = model_parallel_seed(3, layout=_Ranks(tp=1, dp=2), tracker=RNGStatesTracker("cpu"))
    assert (plan.coordinates["tp"], plan.coordinates["dp"]) == (1, 2) and lookups == []
    every_rank = {f"{axis}_rank": 0 for axis in ("tp", "pp", "dp", "ep", "etp", "cp")}
    model_parallel_seed(3, tracker=RNGStatesTracker("cpu"), **every_rank)
    assert lookups == []
    model_parallel_seed(3, tracker=RNGStatesTracker("cpu"))  # ranks missing: one lookup
    assert lookups == [1]


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
    assert "coordinates names the unknown axis" in message and ", ".join(AXES) in message


@pytest.mark.parametrize(
    ("coordinates", "error", "builtin", "words"),
    [
        ([("tp", 1)], SeedCoordinateTypeError, TypeError, "mapping of axis name to rank"),
        ("tp=1", SeedCoordinateTypeError, TypeError, "got str"),
        ({"tp": -1}, RankError, ValueError, "tp_rank must be >= 0"),
        # a rank of the wrong type is a TypeError as in Megatron's arithmetic, and a RankError
        ({"pp": 1.0}, RankTypeError, TypeError, "pp_rank must be an int"),
        ({"dp": True}, RankTypeError, TypeError, "dp_rank must be an int"),
        ({"ep": "2"}, RankTypeError, TypeError, "ep_rank must be an int"),
        ({"tp": torch.tensor(True)}, RankTypeError, TypeError, "tp_rank must be an int, got the"),
    ],
)
def test_bad_coordinates_are_typed_errors(coordinates, error, builtin, words):
    with pytest.raises(RankError if error is RankTypeError else error) as info:
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


class _NoRanks:
    """Not a layout: no rank(axis)."""

    world_size = 1


@pytest.mark.parametrize(
    ("kwargs", "error", "builtin", "words"),
    [
        ({"layout": object()}, ArgumentTypeError, TypeError, "got object, which has no rank(axis)"),
        ({"layout": _NoRanks()}, ArgumentTypeError, TypeError, "got _NoRanks"),
        ({"state": "tp=1"}, ArgumentTypeError, TypeError, "takes a parallel layout"),
        ({"tracker": "x"}, ArgumentTypeError, TypeError, "tracker=...) takes an RNGStatesTracker"),
        ({"data_parallel_random_init": "no"}, ArgumentTypeError, TypeError, "got str 'no'"),
        ({"data_parallel_random_init": 1}, ArgumentTypeError, TypeError, "must be a bool"),
        ({"tp_rank": torch.tensor(True)}, RankError, ValueError, "got the bool tensor(True)"),
    ],
)
def test_model_parallel_seed_refuses_bad_arguments_before_seeding(
    kwargs, error, builtin, words, tracker
):
    """layout=object() and tracker='x' ended in AttributeError; data_parallel_random_init='no'
    turned DP random init on and stored 'no' in the plan. Each is a typed error now, and no
    generator or stream changes (the process tracker's neither)."""
    tracker.add("mine", 5)
    process = get_rng_tracker()
    before = _state(tracker), _state(process), process.names()
    kwargs = {"tracker": tracker, **kwargs}
    renamed = pytest.warns(DeprecationWarning) if "state" in kwargs else contextlib.nullcontext()
    with renamed, pytest.raises(error) as info:
        model_parallel_seed(3, **kwargs)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert words in str(info.value)
    assert (_state(tracker), _state(process), process.names()) == before


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(False)])
def test_plan_seeds_refuses_a_bool_tensor_seed_and_non_bool_flags(bad):
    """plan_seeds(torch.tensor(True)) planned base seed 1: a 0-dim bool tensor read as an int."""
    with pytest.raises(InvalidSeedTypeError, match="seed must be an int, got the bool") as info:
        plan_seeds(bad)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    with pytest.raises(ArgumentTypeError, match="data_parallel_random_init must be a bool"):
        plan_seeds(1, data_parallel_random_init="no")
    assert plan_seeds(1, data_parallel_random_init=np.True_).data_parallel_random_init is True
    assert plan_seeds(1, data_parallel_random_init=np.True_) == plan_seeds(
        1, data_parallel_random_init=True
    )


_FAKE_FIRST_SEEDING = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from rng_tracker import get_rng_tracker, megatron, model_parallel_seed

with FakeTensorMode():  # a memory estimate that runs the training set-up under fake tensors
    model_parallel_seed(1234, tp_rank=0)
    get_rng_tracker("cpu").add("extra", 99)
    megatron.get_cuda_rng_tracker()  # the facade takes the process's streams over
with get_rng_tracker("cpu").fork("extra"):
    got = torch.rand(3)
with megatron.get_cuda_rng_tracker().fork():
    megatron_draw = torch.rand(3)
get_rng_tracker("cpu").reset()
model_parallel_seed(1234, tp_rank=0)
with get_rng_tracker("cpu").fork():
    want = torch.rand(3)
print(torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(99))),
      torch.equal(megatron_draw, want))
"""


def test_a_process_whose_first_seeding_runs_under_fake_tensors_seeds_the_streams():
    """In a fresh process, the first seeding (whose one-time probe of torch's CPU seed layout
    runs torch ops) and the Megatron facade's first tracker run under FakeTensorMode: they work,
    and the streams then draw what the same seeds draw outside the mode."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _FAKE_FIRST_SEEDING], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]


def _live_rng_states() -> tuple:
    """The CPU generator and the process tracker's streams, bitwise."""
    streams = {name: state.clone() for name, state in get_rng_tracker("cpu").get_states().items()}
    return torch.get_rng_state(), streams


def _assert_rng_states_are(before: tuple) -> None:
    cpu, streams = _live_rng_states()
    assert torch.equal(cpu, before[0])
    assert streams.keys() == before[1].keys()
    assert all(torch.equal(streams[name], before[1][name]) for name in streams)


_PLAN = {"scheme": "hashed", "base_seed": 1, "default_seed": 2, "stream_seeds": {}}


@pytest.mark.parametrize(
    ("changed", "error", "builtin", "match"),
    [
        ({"coordinates": None}, SeedCoordinateTypeError, TypeError,
         r"SeedPlan\.coordinates must be a mapping of axis name to rank.*got NoneType"),
        ({"coordinates": ["tp"]}, SeedCoordinateTypeError, TypeError, r"got list"),
        ({"coordinates": {"tp": "a"}}, RankTypeError, TypeError,
         r"SeedPlan\.coordinates\['tp'\] must be an int, got str 'a'"),
        ({"coordinates": {"tp": True}}, RankTypeError, TypeError, r"must be an int, got the bool"),
        ({"coordinates": {"pp": -1}}, RankError, ValueError,
         r"SeedPlan\.coordinates\['pp'\] must be >= 0, got -1"),
        ({"coordinates": {"tpx": 0}}, SeedCoordinateError, KeyError,
         r"SeedPlan\.coordinates names the unknown axis 'tpx'"),
        ({"scheme": "md5"}, SeedSchemeError, ValueError,
         r"SeedPlan\.scheme must be 'hashed' or 'megatron', got str 'md5'"),
        ({"base_seed": -1}, InvalidSeedError, ValueError, r"SeedPlan\.base_seed must be in"),
        ({"base_seed": "1"}, InvalidSeedTypeError, TypeError, r"SeedPlan\.base_seed must be an int"),
        ({"default_seed": 2**64}, InvalidSeedError, ValueError, r"SeedPlan\.default_seed"),
        ({"stream_seeds": None}, ArgumentTypeError, TypeError,
         r"SeedPlan\.stream_seeds must be a mapping of stream name to seed.*NoneType"),
        ({"stream_seeds": {5: 1}}, StreamNameError, TypeError,
         r"SeedPlan\.stream_seeds names must be non-empty str, got int 5"),
        ({"stream_seeds": {"": 1}}, StreamNameError, TypeError, r"got str ''"),
        ({"stream_seeds": {"s": 1.5}}, InvalidSeedTypeError, TypeError,
         r"SeedPlan\.stream_seeds\['s'\] must be an int"),
        ({"data_parallel_random_init": "yes"}, ArgumentTypeError, TypeError,
         r"SeedPlan\.data_parallel_random_init must be a bool"),
    ],
)  # fmt: skip
def test_a_hand_made_seed_plan_is_checked_field_by_field(changed, error, builtin, match):
    """SeedPlan checked nothing: coordinates=None reached verify_rng_consistency as an
    AttributeError, and {"tp": "a"} was taken (and reported as a failed check)."""
    from rng_tracker import SeedPlan

    fields = {**_PLAN, "coordinates": {"tp": 0}, **changed}
    before = _live_rng_states()
    with pytest.raises(error, match=match) as info:
        SeedPlan(**fields)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    _assert_rng_states_are(before)


def test_a_seed_plan_holds_every_axis_as_an_int():
    """A hand-made plan's left-out axes are rank 0 (as plan_seeds counts them) and its ranks and
    seeds plain ints; what plan_seeds, the Megatron facade and dataclasses.replace build still
    builds, unchanged."""
    import dataclasses

    from rng_tracker import SeedPlan

    plan = SeedPlan(**_PLAN, coordinates={"tp": np.int64(3)})
    assert plan.coordinates == {**dict.fromkeys(AXES, 0), "tp": 3}
    assert all(type(rank) is int for rank in plan.coordinates.values())
    assert plan.data_parallel_random_init is False
    made = plan_seeds(7, coordinates={"tp": 1, "dp": 2}, data_parallel_random_init=True)
    assert dataclasses.replace(made) == made
    assert made.coordinates == {**dict.fromkeys(AXES, 0), "tp": 1, "dp": 2}
    megatron_plan = plan_seeds(7, scheme="megatron", coordinates={"tp": 1})
    extra = dataclasses.replace(megatron_plan, stream_seeds={**megatron_plan.stream_seeds, "x": 5})
    assert extra.stream_seeds["x"] == 5 and extra.coordinates == megatron_plan.coordinates
    with pytest.raises(RankError):
        dataclasses.replace(made, coordinates={"tp": -2})
