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


def _unchanged_since(before: torch.Tensor, states: object, keyed: object) -> None:
    from rng_tracker.dcp import RankStates

    assert torch.equal(torch.get_rng_state(), before)
    assert isinstance(states, RankStates)
    assert states.state_dict() == {"rank0": {"cpu": 1}, "keyed": keyed}


_BAD_CONTAINERS = [
    ({"per_rank": [1, 2]}, "StateDictTypeError", TypeError, "per_rank must map each global rank"),
    ({"per_rank": {-1: {}}}, "RankError", ValueError, r"global rank\) must be in \[0, 999999999\]"),
    ({"per_rank": {"0": {}}}, "StateDictTypeError", TypeError, "must be an int, got str '0'"),
    ({"per_rank": {True: {}}}, "StateDictTypeError", TypeError, "the bool True"),
    ({"per_rank": {0: 5}}, "StateDictTypeError", TypeError, r"per_rank\[0\] must be a mapping"),
    ({"keyed": 5}, "StateDictTypeError", TypeError, "keyed must be the keyed RNG's state as a str"),
]


@pytest.mark.parametrize(("kwargs", "error", "builtin", "match"), _BAD_CONTAINERS)
def test_rank_states_refuses_bad_ranks_and_states_when_built(
    kwargs: dict, error: str, builtin: type, match: str
) -> None:
    """per_rank={-1: ...} wrote a key 'rank-1' and a list failed in state_dict(); now typed."""
    from rng_tracker import errors
    from rng_tracker.dcp import RankStates

    before = torch.get_rng_state()
    with pytest.raises(getattr(errors, error), match=match) as info:
        RankStates(**kwargs)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert torch.equal(torch.get_rng_state(), before)


_BAD_LOADS = [
    (None, "StateDictTypeError", TypeError, "expected the mapping RankStates.state_dict"),
    ({"rankX": {}}, "StateDictError", ValueError, "'rankX': it was not written by RankStates"),
    ({"rank-1": {}}, "StateDictError", ValueError, "'rank-1'"),
    ({"other": 1}, "StateDictError", ValueError, "'other'"),
    ({"rank0": 5}, "StateDictTypeError", TypeError, r"per_rank\[0\] must be a mapping"),
    ({"keyed": 5}, "StateDictTypeError", TypeError, "keyed must be the keyed RNG's state"),
]


@pytest.mark.parametrize(("state_dict", "error", "builtin", "match"), _BAD_LOADS)
def test_rank_states_refuses_a_malformed_state_dict_and_keeps_its_own(
    state_dict: object, error: str, builtin: type, match: str
) -> None:
    """load_state_dict({'rankX': ...}) raised a bare ValueError, None an AttributeError."""
    from rng_tracker import errors
    from rng_tracker.dcp import RankStates

    states = RankStates({0: {"cpu": 1}}, '{"seed": 3}')
    before = torch.get_rng_state()
    with pytest.raises(getattr(errors, error), match=match) as info:
        states.load_state_dict(state_dict)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    _unchanged_since(before, states, '{"seed": 3}')


def test_rank_states_round_trips_its_state_dict() -> None:
    from rng_tracker.dcp import RankStates

    saved = RankStates({0: {"cpu": torch.arange(3)}, 12: {"cpu": torch.ones(2)}}, '{"seed": 3}')
    loaded = RankStates()
    loaded.load_state_dict(saved.state_dict())
    assert sorted(loaded.per_rank) == [0, 12] and loaded.keyed == '{"seed": 3}'
    assert torch.equal(loaded.per_rank[12]["cpu"], torch.ones(2))
    assert RankStates().state_dict() == {}


def test_a_deep_copied_stateful_loads_into_the_tracker_it_was_given() -> None:
    """copy.deepcopy(RNGStateful(tracker=t)) cloned t, so its load_state_dict restored the CPU
    generator but put the streams into the clone, silently. The copy now keeps t; pickling one
    that holds a tracker is refused (with tracker=None it pickles: the tracker is found at load)."""
    import copy
    import pickle

    from rng_tracker import RNGStatesTracker
    from rng_tracker.dcp import RNGStateful
    from rng_tracker.errors import ArgumentTypeError

    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 5)
    stateful = RNGStateful(tracker=tracker)
    saved = stateful.state_dict()
    with tracker.fork("s"):
        want = torch.rand(3)
    twin = copy.deepcopy(stateful)
    assert twin.tracker is tracker
    twin.load_state_dict(saved)
    with tracker.fork("s"):
        assert torch.equal(torch.rand(3), want)
    with pytest.raises(ArgumentTypeError, match="cannot be pickled"):
        pickle.dumps(stateful)
    assert pickle.loads(pickle.dumps(RNGStateful())).strict is False


@pytest.mark.parametrize(
    ("kwargs", "error", "builtin", "match"),
    [
        ({"step": 5}, "RNGStateConfigTypeError", TypeError, "step must be a callable.*got int"),
        ({"saved_by": None}, "RNGStateConfigTypeError", TypeError,
         "saved_by must be one of 'auto', 'each_rank', 'main_process', 'each_node', got NoneType"),
        ({"saved_by": ["auto"]}, "RNGStateConfigTypeError", TypeError, "got list"),
        ({"saved_by": "rank0"}, "RNGStateConfigError", ValueError, "got str 'rank0'"),
        ({"strict": 1}, "RNGStateConfigTypeError", TypeError, "strict must be a bool, got int 1"),
    ],
)  # fmt: skip
def test_rng_stateful_options_of_the_wrong_type_are_type_errors(
    kwargs: dict, error: str, builtin: type, match: str
) -> None:
    """step=5, saved_by=None and strict=1 raised RNGStateConfigError, a ValueError only; an
    unknown saved_by str stays a value error."""
    from rng_tracker import errors
    from rng_tracker.dcp import RNGStateful

    before = torch.get_rng_state()
    with pytest.raises(getattr(errors, error), match=match) as info:
        RNGStateful(**kwargs)
    assert isinstance(info.value, errors.RNGStateConfigError)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert isinstance(info.value, TypeError) == (builtin is TypeError)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("state_dict", [None, [1, 2], "shared"])
def test_rng_stateful_load_of_a_non_mapping_is_a_state_dict_type_error(state_dict) -> None:
    """RNGStateful().load_state_dict(None) raised StateDictError, a ValueError only, where
    RankStates and the tracker raise StateDictTypeError."""
    from rng_tracker import get_rng_tracker
    from rng_tracker.dcp import RNGStateful
    from rng_tracker.errors import StateDictError, StateDictTypeError

    tracker = get_rng_tracker("cpu")
    streams = {name: state.clone() for name, state in tracker.get_states().items()}
    before = torch.get_rng_state()
    with pytest.raises(StateDictTypeError, match="expected the mapping RNGStateful") as info:
        RNGStateful().load_state_dict(state_dict)
    assert isinstance(info.value, StateDictError) and isinstance(info.value, TypeError)
    assert torch.equal(torch.get_rng_state(), before)
    after = tracker.get_states()
    assert after.keys() == streams.keys()
    assert all(torch.equal(after[name], streams[name]) for name in streams)


def test_a_trainer_step_that_is_not_an_int_is_a_type_error() -> None:
    """A save whose step=lambda: "3" answers a str is refused (RNGStateSaveError, agreed by every
    rank) for a cause that was RNGStateConfigError, a ValueError only; a negative step stays a
    value error. Neither changes a generator."""
    from rng_tracker.dcp import RNGStateful
    from rng_tracker.errors import RNGStateConfigError, RNGStateConfigTypeError, RNGStateSaveError

    before = torch.get_rng_state()
    with pytest.raises(RNGStateSaveError, match="the trainer's step must be an int") as info:
        RNGStateful(step=lambda: "3").state_dict()
    assert isinstance(info.value.__cause__, RNGStateConfigTypeError)
    assert isinstance(info.value.__cause__, RNGStateConfigError)
    with pytest.raises(RNGStateSaveError, match="must be >= 0, got -1") as value:
        RNGStateful(step=lambda: -1).state_dict()
    assert isinstance(value.value.__cause__, RNGStateConfigError)
    assert not isinstance(value.value.__cause__, TypeError)
    assert torch.equal(torch.get_rng_state(), before)
