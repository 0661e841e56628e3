"""The cross-rank RNG verifier: it checks a seed plan's claims against the real mesh (that it
needs no numpy, since it exchanges no pickles, is tested in test_collective.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from rng_tracker import (
    DATA_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    ParallelStateError,
    RNGConsistencyError,
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_seed,
)
from rng_tracker.errors import ParallelStateMismatchError, RankError
from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
from rng_tracker.parallel._verify import verify_rng_consistency
from rng_tracker.parallel.testing import run_distributed


def _every_rank_seeds_as_tp_rank_0() -> tuple:
    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    plan = model_parallel_seed(11, tp_rank=0, etp_rank=0)  # the lie: both TP ranks claim tp=0
    report = verify_rng_consistency(plan=plan)
    with pytest.raises(RNGConsistencyError):
        verify_rng_consistency(plan=plan, strict=True)
    honest = verify_rng_consistency(plan=model_parallel_seed(11, layout=state))
    destroy_model_parallel()
    return report.ok, report.problems, honest.ok, honest.problems


def test_verifier_checks_the_plans_coordinates_against_the_mesh():
    """A plan claiming tp=0 on every TP rank leaves model-parallel-rng equal across the TP
    group; the verifier must fail and name the misplaced rank and the stream."""
    ok, problems, honest_ok, honest_problems = run_distributed(
        _every_rank_seeds_as_tp_rank_0, world_size=2
    )[0]
    assert not ok
    assert any(
        p.startswith("rank 1 was seeded as tp=0 but the mesh puts it at tp=1")
        and MODEL_PARALLEL_RNG in p
        for p in problems
    ), problems
    assert any(f"stream {MODEL_PARALLEL_RNG!r} on ranks [0]" in p for p in problems), problems
    assert honest_ok, honest_problems


def _seed_without_parallel_state() -> tuple:
    destroy_model_parallel()
    tracker = get_rng_tracker("cpu")
    tracker.reset()
    tracker.add("mine", 5)
    cpu_before = torch.get_rng_state()
    states_before = tracker.get_states()
    with pytest.raises(ParallelStateError, match="init_model_parallel") as info:
        model_parallel_seed(1234)
    unchanged = torch.equal(cpu_before, torch.get_rng_state()) and tracker.names() == ["mine"]
    unchanged = unchanged and torch.equal(states_before["mine"], tracker.get_states()["mine"])
    with pytest.raises(ParallelStateError):
        model_parallel_seed(1234, tp_rank=dist.get_rank())  # the other axes are still unknown
    with pytest.raises(ParallelStateError, match="plan="):
        verify_rng_consistency()
    state = init_model_parallel(tensor=2)
    plan = model_parallel_seed(1234, layout=state)
    destroy_model_parallel()
    return str(info.value), unchanged, plan.coordinates["tp"]


def test_seeding_refuses_to_guess_ranks_on_several_processes():
    """Two gloo ranks and no parallel state: seeding must raise (typed, nothing changed)
    instead of seeding both as rank 0; an explicit state places each rank."""
    results = run_distributed(_seed_without_parallel_state, world_size=2)
    for rank, (message, unchanged, tp) in enumerate(results):
        assert f"rank {rank} of 2" in message
        assert unchanged
        assert tp == rank


def _verify_with_the_state_passed_in() -> tuple:
    import rng_tracker.parallel._verify as verify

    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    plan = model_parallel_seed(7, layout=state)

    def no_lookup() -> None:
        raise AssertionError("verify_rng_consistency(layout) looked the layout up")

    verify.current_layout = no_lookup  # this rank's process is fresh and ends after
    report = verify_rng_consistency(state, plan=plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = verify_rng_consistency(state=state, plan=plan)  # the deprecated keyword
    destroy_model_parallel()
    warned = [str(w.message) for w in caught if w.category is DeprecationWarning]
    return report.ok, report.coordinates, old.coordinates, warned


def test_verifier_uses_the_state_passed_in_and_looks_nothing_up():
    """With a layout given, the process-wide layout is never read (item 5 of issue 18); the
    deprecated state= gives the same placement, with one warning naming layout=."""
    for ok, coordinates, old, warned in run_distributed(
        _verify_with_the_state_passed_in, world_size=2
    ):
        assert ok
        assert [c["tp"] for c in coordinates] == [0, 1]
        assert old == coordinates
        assert len(warned) == 1 and "verify_rng_consistency(layout=...)" in warned[0]


def _megatron_seeding_on_tp2_pp2() -> tuple:
    from rng_tracker import megatron as mg

    destroy_model_parallel()
    state = init_model_parallel(tensor=2, pipeline=2)
    plan = mg.model_parallel_cuda_manual_seed(1234 + 100 * state.rank("pp"))  # Megatron's call
    report = verify_rng_consistency(plan=plan)
    destroy_model_parallel()
    return plan.coordinates["pp"], state.rank("pp"), report.ok, report.problems


def test_megatron_seeding_plan_verifies_against_the_mesh():
    """Megatron folds the pipeline offset into the seed it passes; the plan still records the
    mesh's pp rank, so verifying it reports no misplaced rank."""
    for claimed_pp, pp, ok, problems in run_distributed(_megatron_seeding_on_tp2_pp2, world_size=4):
        assert claimed_pp == pp
        assert ok, problems


def _tracker_states() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tracker = get_rng_tracker("cpu")
    return torch.get_rng_state(), {n: s.clone() for n, s in tracker.get_states().items()}


def _assert_states_unchanged(before: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    after = _tracker_states()
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])


def test_verify_before_init_process_group_is_a_parallel_state_error():
    """It raised torch's bare ValueError ("Default process group has not been initialized")."""
    from rng_tracker._tracker import RNGStatesTracker

    assert not dist.is_initialized()
    cpu = torch.get_rng_state()
    plan = model_parallel_seed(3, tracker=RNGStatesTracker("cpu"))  # seeds the CPU generator
    torch.set_rng_state(cpu)
    for kwargs in ({}, {"plan": plan}):
        before = _tracker_states()
        with pytest.raises(ParallelStateError, match="init_process_group") as info:
            verify_rng_consistency(**kwargs)
        assert isinstance(info.value, RuntimeError)
        _assert_states_unchanged(before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layout": object()}, "layout must be a ParallelLayout"),
        ({"tracker": "x"}, "tracker must be an RNGStatesTracker"),
        ({"plan": "x"}, "plan must be the SeedPlan"),
        ({"strict": "yes"}, "strict must be a bool, got str 'yes'"),
        ({"strict": 1}, "strict must be a bool, got int 1"),
    ],
)
def test_verify_refuses_arguments_of_the_wrong_type(kwargs: dict, match: str):
    """A layout, tracker or plan of the wrong type ended in an AttributeError."""
    from rng_tracker.errors import ArgumentTypeError, RNGTrackerError

    before = _tracker_states()
    with pytest.raises(ArgumentTypeError, match=match) as info:
        verify_rng_consistency(**kwargs)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    _assert_states_unchanged(before)


def test_the_report_prints_a_readable_grid_at_any_world_size():
    """Past 26 states a rank's label is letters, never punctuation or control characters (it
    was chr(ord("A") + i)); past 64 ranks the grid shows the first 64 and counts the states."""
    from rng_tracker.parallel import RNGReport

    small = RNGReport(True, (), {"default": ["a", "a", "b", "b"]}, [{}] * 4)
    assert str(small).splitlines()[1:] == [
        "  (a letter per rank and stream; one letter = one state)",
        "  default                A A B B",
    ]
    world = 16384
    prints = {"default": [f"{r // 8:x}" for r in range(world)], "one": ["s"] * world}
    text = str(RNGReport(True, (), prints, [{}] * world))
    assert text.isascii() and all(line.isprintable() for line in text.splitlines())
    legend, default, one = text.splitlines()[1:]
    assert legend == (
        "  (a label of 3 letters per rank and stream; one label = one state; ranks 0-63 of "
        "16384 shown)"
    )
    labels = default.split()[1:65]
    assert labels[:10] == ["AAA"] * 8 + ["AAB"] * 2 and len(set(labels)) == 8
    assert default.endswith(" ... (2048 states in all)")
    assert one.endswith(" ... (1 state in all)") and one.split()[1:65] == ["AAA"] * 64


class _FixedLayout:
    """A layout placing this rank at fixed coordinates of a large mesh (nothing but ranks)."""

    world_size = 2

    def __init__(self, coordinates: dict[str, int]) -> None:
        self._coordinates = coordinates

    def rank(self, axis: str) -> int:
        return self._coordinates.get(axis, 0)

    def size(self, axis: str) -> int:
        return {"tp": 4096, "cp": 4, "pp": 4}.get(axis, 1)

    def group(self, axis: str) -> None:
        return None


@pytest.mark.distributed(world_size=2, timeout=120)
def test_verify_reports_cpu_streams_whose_seeds_share_their_low_32_bits(rank):
    """The hashed scheme gives model-parallel-rng at (tp, cp, pp) = (596, 0, 2) and
    (3415, 2, 2) seeds that differ only in their high 32 bits, which torch's CPU generator
    ignores: the two ranks drew identical masks and the verifier said OK, since it fingerprinted
    the seed each state stores. It now fingerprints what decides the draws and names them."""
    coordinates = [{"tp": 596, "cp": 0, "pp": 2}, {"tp": 3415, "cp": 2, "pp": 2}][rank]
    layout = _FixedLayout(coordinates)
    tracker = RNGStatesTracker("cpu")
    plan = model_parallel_seed(1234, layout=layout, tracker=tracker)
    seeds = [None, None]
    dist.all_gather_object(seeds, plan.stream_seeds[MODEL_PARALLEL_RNG])
    assert seeds[0] != seeds[1] and seeds[0] % 2**32 == seeds[1] % 2**32
    with tracker.fork(MODEL_PARALLEL_RNG):
        mask = torch.nn.functional.dropout(torch.ones(4096), 0.5)
    masks = [torch.empty_like(mask) for _ in range(2)]
    dist.all_gather(masks, mask)
    assert torch.equal(masks[0], masks[1])  # the collision is real
    report = verify_rng_consistency(layout, tracker=tracker, plan=plan)
    assert not report.ok
    assert any(
        f"stream {MODEL_PARALLEL_RNG!r} on ranks [0]; stream {MODEL_PARALLEL_RNG!r} on ranks [1]"
        in problem
        for problem in report.problems
    ), report.problems


@pytest.mark.distributed(world_size=2, timeout=120)
def test_verify_inside_a_fork_sees_the_states_outside_it(rank):
    """Inside an open fork the default generator holds the forked stream; the verifier took it
    for the default state and reported a false collision. Each stream and the default generator
    are now fingerprinted as they are outside the forks: the report is the same in and out."""
    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    try:
        tracker = RNGStatesTracker("cpu")
        plan = model_parallel_seed(5, layout=state, tracker=tracker)
        outside = verify_rng_consistency(state, tracker=tracker, plan=plan)
        with tracker.fork(MODEL_PARALLEL_RNG), tracker.fork(DATA_PARALLEL_RNG):
            inside = verify_rng_consistency(state, tracker=tracker, plan=plan)
        assert outside.ok, outside.problems
        assert inside == outside, inside.problems
    finally:
        destroy_model_parallel()


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_stream_named_like_a_generator_hides_nothing(rank):
    """Streams and generators shared one table of fingerprints: a stream named "default"
    replaced the default generator's, so DP replicas whose default generators had drifted apart
    verified OK, and a per-rank stream named "cpu" was judged by the default generator's rule.
    Each now has its own row."""
    tracker = RNGStatesTracker("cpu")
    layout = _FixedLayout({})  # both ranks are DP replicas: every policy stream must agree
    plan = model_parallel_seed(3, layout=layout, tracker=tracker)
    tracker.add("default", 99)  # the same on both ranks
    tracker.add("cpu", 100 + rank)  # the user's own per-rank stream: no rule applies
    if rank == 1:
        torch.rand(1)  # the replicas' default generators now differ
    report = verify_rng_consistency(layout, tracker=tracker, plan=plan)
    assert not report.ok
    assert list(report.fingerprints)[:1] == ["default"]
    assert {"stream 'default'", "cpu"} <= set(report.fingerprints)
    assert len(set(report.fingerprints["stream 'default'"])) == 1
    assert len(set(report.fingerprints["cpu"])) == 2
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith("stream 'default' must be equal on ranks [0, 1]")


@pytest.mark.distributed(world_size=2, timeout=120)
def test_ranks_seeded_with_and_without_data_parallel_random_init_are_reported(rank):
    """Each rank was judged by its own plan's flag, so two DP replicas seeded differently (their
    default generators drawing different values) fell into separate groups and verified OK."""
    tracker = RNGStatesTracker("cpu")
    layout = _FixedLayout({"dp": rank})
    plan = model_parallel_seed(
        3, layout=layout, tracker=tracker, data_parallel_random_init=rank == 1
    )
    report = verify_rng_consistency(layout, tracker=tracker, plan=plan)
    assert not report.ok
    assert any(
        "ranks [1] were seeded with data_parallel_random_init=True and ranks [0] without it"
        in problem
        for problem in report.problems
    ), report.problems


class _NegativeLayout(_FixedLayout):
    def rank(self, axis: str) -> int:
        return -1 if axis == "pp" else 0


class _MismatchedLayout(_FixedLayout):
    """As Megatron's parallel_state and rng_tracker's mesh disagreeing at this rank only."""

    def rank(self, axis: str) -> int:
        raise ParallelStateMismatchError("the two parallel states disagree at this rank")


@pytest.mark.parametrize(
    ("broken", "error", "match"),
    [
        (_MismatchedLayout, ParallelStateMismatchError, "disagree at this rank"),
        (_NegativeLayout, RankError, r"layout.rank\('pp'\) must be >= 0, got -1"),
    ],
)
@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_rank_that_refuses_the_call_does_not_leave_its_peers_waiting(rank, broken, error, match):
    """A rank whose layout was refused (a parallel-state mismatch only it sees, a negative rank)
    raised before the collective, and the other ranks hung in it until the job's timeout. Every
    rank now raises: the refusing rank its own error, the others one naming it."""
    tracker = RNGStatesTracker("cpu")
    layout = broken({}) if rank == 1 else _FixedLayout({})
    before = _tracker_states()
    if rank == 1:
        with pytest.raises(error, match=match):
            verify_rng_consistency(layout, tracker=tracker)
    else:
        with pytest.raises(
            ParallelStateError, match=rf"rank 1 refused the call \({error.__name__}: "
        ):
            verify_rng_consistency(layout, tracker=tracker)
    _assert_states_unchanged(before)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_layout_giving_numpy_ranks_verifies(rank):
    """model_parallel_seed takes a layout whose rank() returns numpy ints; verify failed on the
    same layout with an untyped "int64 is not JSON serializable"."""
    import numpy as np

    layout = _FixedLayout({"tp": np.int64(rank)})
    tracker = RNGStatesTracker("cpu")
    plan = model_parallel_seed(3, layout=layout, tracker=tracker)
    report = verify_rng_consistency(layout, tracker=tracker, plan=plan)
    assert report.ok, report.problems
    assert [c["tp"] for c in report.coordinates] == [0, 1]


def _megatron_and_hashed_seeding_at_cp2() -> tuple:
    destroy_model_parallel()
    state = init_model_parallel(context=2)
    try:
        megatron = verify_rng_consistency(
            state, plan=model_parallel_seed(1, scheme="megatron", layout=state)
        )
        hashed = verify_rng_consistency(state, plan=model_parallel_seed(1, layout=state))
    finally:
        destroy_model_parallel()
    return megatron.problems, hashed.ok


def test_context_parallel_ranks_sharing_megatrons_model_parallel_seed_are_reported():
    """Megatron's arithmetic takes no CP rank: both CP ranks get one model-parallel-rng, so their
    sequence chunks draw the same sharded masks. docs/migrating.md says the verifier reports it,
    and that the hashed scheme seeds CP ranks apart."""
    for problems, hashed_ok in run_distributed(_megatron_and_hashed_seeding_at_cp2, world_size=2):
        assert hashed_ok
        assert len(problems) == 1, problems
        assert "these must differ but are in one state" in problems[0]
        assert f"stream {MODEL_PARALLEL_RNG!r} on ranks [0]" in problems[0]
        assert f"stream {MODEL_PARALLEL_RNG!r} on ranks [1]" in problems[0]


@pytest.mark.distributed(world_size=1, timeout=120)
def test_a_hand_made_plan_is_checked_before_verify_reads_it(rank):
    """verify_rng_consistency(plan=SeedPlan(..., coordinates=None)) ended in an AttributeError,
    a plan naming only tp in a KeyError, and coordinates={"tp": "a"} was taken as a rank. A
    SeedPlan is checked where it is built; the axes it leaves out are rank 0."""
    from rng_tracker import SeedPlan
    from rng_tracker.errors import RankTypeError, RNGTrackerError, SeedCoordinateTypeError

    destroy_model_parallel()
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(5, tracker=tracker, tp_rank=0)
    fields = {"scheme": "hashed", "base_seed": 5, "default_seed": 1, "stream_seeds": {}}
    before = _tracker_states()
    for coordinates, error, builtin in (
        (None, SeedCoordinateTypeError, TypeError),
        ({"tp": "a"}, RankTypeError, TypeError),
    ):
        with pytest.raises(error, match=r"SeedPlan\.coordinates") as info:
            verify_rng_consistency(
                tracker=tracker, plan=SeedPlan(**fields, coordinates=coordinates)
            )
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
        _assert_states_unchanged(before)
    report = verify_rng_consistency(tracker=tracker, plan=SeedPlan(**fields, coordinates={"tp": 0}))
    assert report.coordinates == [{"tp": 0, "cp": 0, "pp": 0, "dp": 0, "ep": 0, "etp": 0}]
    _assert_states_unchanged(before)
