"""Cross-rank verification of RNG states against the declared equal/distinct policy.

Each rank fingerprints its default generators and every tracker stream; the fingerprints
are all-gathered and checked: a stream must be in the same state on ranks that share its
coordinates on the axes it varies over (rng_tracker._streams.stream_axes), and in different
states wherever those coordinates differ — also across streams, which catches
Megatron-scheme collisions such as pp 1/dp 0 vs pp 0/dp 10 with data-parallel random init.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker._collective import all_gather_json, state_digest
from rng_tracker._deprecation import renamed_keyword
from rng_tracker._device_rng import device_rng
from rng_tracker._layout import ParallelLayout, checked_layout
from rng_tracker._seeds import SeedPlan, checked_rank
from rng_tracker._streams import (
    AXES,
    DATA_PARALLEL_RNG,
    DEFAULT_STREAM,
    POLICY_STREAMS,
    stream_axes,
)
from rng_tracker._tracker import RNGStatesTracker, get_rng_tracker
from rng_tracker._validate import checked_flag, checked_instance
from rng_tracker.errors import ParallelStateError, RNGConsistencyError
from rng_tracker.parallel._megatron_state import current_layout

# Megatron seeds the default generator and data-parallel-rng from one seed, by design.
_MAY_SHARE = {frozenset({DEFAULT_STREAM, DATA_PARALLEL_RNG})}
_POLICIES = POLICY_STREAMS
_CPU = "cpu"  # the CPU generator's row where the tracker's device is another


@dataclass(frozen=True, slots=True)
class RNGReport:
    """What :func:`verify_rng_consistency` found. ``print`` shows a grid of each stream's states
    on ranks 0-63 (a label per state) and every problem, which names any rank."""

    ok: bool
    problems: tuple[str, ...]
    fingerprints: dict[str, list[str]] = field(hash=False)  # stream → fingerprint per rank
    coordinates: list[dict[str, int]] = field(hash=False)  # per rank

    def __str__(self) -> str:
        world = len(self.coordinates)
        verdict = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        # each stream's states in order of first appearance, numbered
        numbered = {
            stream: {fp: i for i, fp in enumerate(dict.fromkeys(prints))}
            for stream, prints in self.fingerprints.items()
        }
        most = max(map(len, numbered.values()), default=1)
        width = 1
        while 26**width < most:
            width += 1
        legend = (
            "a letter per rank and stream; one letter = one state"
            if width == 1
            else f"a label of {width} letters per rank and stream; one label = one state"
        )
        if world > _GRID_RANKS:
            legend += f"; ranks 0-{_GRID_RANKS - 1} of {world} shown"
        lines = [f"RNG consistency over {world} ranks: {verdict}", f"  ({legend})"]
        for stream, prints in self.fingerprints.items():
            distinct = numbered[stream]
            row = " ".join(_label(distinct[fp], width) for fp in prints[:_GRID_RANKS])
            if world > _GRID_RANKS:
                row += f" ... ({len(distinct)} state{'s' * (len(distinct) != 1)} in all)"
            lines.append(f"  {stream:<22} {row}")
        lines.extend(f"  ! {problem}" for problem in self.problems)
        return "\n".join(lines)


_GRID_RANKS = 64  # the ranks the printed grid shows; the problems name any rank


def _label(index: int, width: int) -> str:
    """The ``index``-th state's label: ``width`` letters, A to Z in each place."""
    letters = []
    for _ in range(width):
        index, place = divmod(index, 26)
        letters.append(chr(ord("A") + place))
    return "".join(reversed(letters))


def _local_fingerprints(tracker: RNGStatesTracker) -> dict[str, dict[str, str]]:
    """A digest per generator and per stream of what decides its draws (not a CPU state's stored
    seed: seeds equal modulo 2**32 draw alike there), each as it is outside any open fork of
    ``tracker``: inside one the generator holds the forked stream, and the default state waits
    in the tracker. Generators and streams are apart: a stream may be named like a generator."""
    rng = device_rng(tracker.device)
    outer = tracker.held_context()[1] if tracker.open_forks() else None
    generators = {
        DEFAULT_STREAM: state_digest(rng.drawn_bytes(rng.snapshot() if outer is None else outer))
    }
    if tracker.device.type != "cpu":
        generators[_CPU] = state_digest(device_rng("cpu").drawn_bytes(torch.get_rng_state()))
    streams = {
        name: state_digest(rng.drawn_bytes(state)) for name, state in tracker.get_states().items()
    }
    return {"generators": generators, "streams": streams}


def _where(coords: dict[str, int], axes: tuple[str, ...]) -> str:
    return ", ".join(f"{a}={coords[a]}" for a in axes) or "everywhere"


def _check_arguments(layout: object, tracker: object, plan: object, strict: object) -> None:
    """Refuse arguments of the wrong type, and a call before torch.distributed is set up."""
    if layout is not None:  # only its rank(axis) is read, as model_parallel_seed reads it
        checked_layout(layout, "verify_rng_consistency", ("rank",))
    wanted = (
        ("tracker", tracker, RNGStatesTracker, "an RNGStatesTracker (e.g. get_rng_tracker())"),
        ("plan", plan, SeedPlan, "the SeedPlan model_parallel_seed(...) returned"),
    )
    for name, value, kind, what in wanted:
        if value is not None:
            checked_instance(value, kind, f"{name} must be {what} or None")
    checked_flag(strict, "strict")
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelStateError(
            "verify_rng_consistency is collective over the default process group, and "
            "torch.distributed is not initialised; call torch.distributed.init_process_group "
            "first (torchrun sets up the environment for it)"
        )


def verify_rng_consistency(
    layout: ParallelLayout | None = None,
    *,
    tracker: RNGStatesTracker | None = None,
    plan: SeedPlan | None = None,
    strict: bool = False,
    state: ParallelLayout | None = None,
) -> RNGReport:
    """Check every rank's RNG states against the policy; collective over the default group.

    Ranks are placed by their coordinates in ``layout`` (a :class:`~rng_tracker.ParallelLayout`;
    default: the initialised parallel state, else Megatron's initialised ``parallel_state``;
    ``state=`` is its deprecated name). ``plan`` (the :class:`SeedPlan` that ``model_parallel_seed`` returned) says how
    the streams were seeded; every coordinate it claims is checked against the mesh, so a
    rank seeded as another rank is named. Without a mesh the plan's coordinates are taken as
    given. With several ranks and neither, :class:`ParallelStateError` is raised rather than
    placing every rank at 0. With ``strict=True`` a failed check raises
    :class:`RNGConsistencyError` carrying the report.
    """
    layout = renamed_keyword("verify_rng_consistency", "state", "layout", state, layout)
    _check_arguments(layout, tracker, plan, strict)
    try:
        mine: dict[str, Any] = _local_report(layout, tracker, plan)
    except Exception as failure:  # raised on this rank only: its peers must not wait for it
        all_gather_json({"refused": f"{type(failure).__name__}: {failure}"})
        raise
    everyone = all_gather_json(mine)  # over the world: JSON in uint8 tensors
    refused = [rank for rank, info in enumerate(everyone) if "refused" in info]
    if refused:
        raise ParallelStateError(
            f"verify_rng_consistency: rank {refused[0]} refused the call "
            f"({everyone[refused[0]]['refused']})"
            + (f", and so did ranks {refused[1:]}" if len(refused) > 1 else "")
            + "; no rank checked anything. Fix that rank's layout or arguments and call it again"
        )
    report = _check(everyone)
    if strict and not report.ok:
        raise RNGConsistencyError(str(report))
    return report


def _local_report(
    layout: ParallelLayout | None, tracker: RNGStatesTracker | None, plan: SeedPlan | None
) -> dict[str, Any]:
    """What this rank contributes: its coordinates, those its plan claims against them, the plan's
    data-parallel random init and the fingerprints of its generators and streams."""
    tracker = tracker if tracker is not None else get_rng_tracker()
    layout = layout if layout is not None else current_layout()
    claimed: dict[str, int] = {}
    if layout is not None:
        coords = {axis: checked_rank(f"layout.rank({axis!r})", layout.rank(axis)) for axis in AXES}
        if plan is not None:
            claimed = {a: r for a, r in plan.coordinates.items() if a in coords and coords[a] != r}
    elif plan is not None:
        coords = dict(plan.coordinates)
    elif dist.get_world_size() > 1:
        raise ParallelStateError(
            f"verify_rng_consistency on rank {dist.get_rank()}: no parallel state is "
            "initialised and no plan was given, so the ranks' coordinates are unknown; call "
            "init_model_parallel(...) first, or pass layout=... or plan=model_parallel_seed(...)"
        )
    else:
        coords = dict.fromkeys(AXES, 0)
    return {
        "coords": coords,
        "claimed": claimed,
        "dpri": plan.data_parallel_random_init if plan is not None else False,
        **_local_fingerprints(tracker),
    }


def _misplaced(rank: int, info: dict[str, Any], policies: list[str]) -> list[str]:
    """Problems of a rank whose seed plan claims other coordinates than the mesh gives it."""
    problems = []
    for axis, claimed in sorted(info["claimed"].items()):
        affected = [
            s for s in policies if axis in stream_axes(s, data_parallel_random_init=info["dpri"])
        ]
        problems.append(
            f"rank {rank} was seeded as {axis}={claimed} but the mesh puts it at "
            f"{axis}={info['coords'][axis]}: its streams {affected} were seeded for another "
            "rank; seed with model_parallel_seed(seed, layout=...) or the mesh's ranks"
        )
    return problems


def _may_share(holders: dict[tuple[str, tuple[int, ...]], list[int]]) -> bool:
    """Whether these (row, identity) holders of one state are allowed to coincide."""
    rows = {row for row, _ in holders}
    identities = {identity for _, identity in holders}
    return len(holders) == 1 or (frozenset(rows) in _MAY_SHARE and len(identities) == 1)


def _rows(everyone: list[dict[str, Any]]) -> dict[str, tuple[str, str, str | None]]:
    """label -> (kind, name, policy) of every generator and stream any rank holds.

    A generator's label is its name; a stream's is its name unless a generator has that name
    (the tracker takes any name), then ``stream 'name'``. ``policy`` is the stream whose
    equal/distinct rule applies: the default one for the generators, a stream's own where it is
    declared, None for a stream of the user's.
    """
    rows: dict[str, tuple[str, str, str | None]] = {}
    for kind in ("generators", "streams"):
        for name in dict.fromkeys(n for info in everyone for n in info[kind]):
            if kind == "generators":
                label, policy = name, DEFAULT_STREAM
            else:
                label = name
                while label in rows:
                    label = f"stream {label!r}"
                policy = name if name in _POLICIES and name != DEFAULT_STREAM else None
            rows[label] = (kind, name, policy)
    return rows


def _disagreeing_plans(everyone: list[dict[str, Any]]) -> list[str]:
    """A problem where the ranks' plans disagree on data-parallel random init: no policy holds."""
    flags = [info["dpri"] for info in everyone]
    if len(set(flags)) <= 1:
        return []
    with_it = [rank for rank, flag in enumerate(flags) if flag]
    without = [rank for rank, flag in enumerate(flags) if not flag]
    return [
        f"ranks {with_it} were seeded with data_parallel_random_init=True and ranks {without} "
        "without it (or gave no plan): replicas seeded both ways draw different values where "
        "they must agree; seed every rank with the same model_parallel_seed arguments"
    ]


def _check(everyone: list[dict[str, Any]]) -> RNGReport:
    rows = _rows(everyone)
    policies = list(dict.fromkeys(p for _, _, p in rows.values() if p is not None))
    problems = _disagreeing_plans(everyone)
    for rank, info in enumerate(everyone):
        problems.extend(_misplaced(rank, info, policies))
    fingerprints = {
        label: [info[kind].get(name, "-") for info in everyone]
        for label, (kind, name, _) in rows.items()
    }
    # fingerprint -> {(row, identity): ranks}; identity = coordinates on the stream's axes
    holders: dict[str, dict[tuple[str, tuple[int, ...]], list[int]]] = defaultdict(dict)
    for label, (_, _, policy) in rows.items():
        if policy is None:
            continue  # a user stream: no declared policy
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, info in enumerate(everyone):
            axes = stream_axes(policy, data_parallel_random_init=info["dpri"])
            groups[tuple(info["coords"][a] for a in axes)].append(rank)
        for identity, ranks in groups.items():
            prints = [fingerprints[label][r] for r in ranks]
            if len(set(prints)) > 1:
                common = Counter(prints).most_common(1)[0][0]
                odd = [r for r, fp in zip(ranks, prints) if fp != common]
                axes = stream_axes(policy, data_parallel_random_init=everyone[ranks[0]]["dpri"])
                problems.append(
                    f"stream {label!r} must be equal on ranks {ranks} ({_where(everyone[ranks[0]]['coords'], axes)}) "
                    f"but ranks {odd} differ from the rest: "
                    + ", ".join(f"rank {r}={fp[:6]}" for r, fp in zip(ranks, prints))
                )
            for r, fp in zip(ranks, prints):
                holders[fp].setdefault((label, identity), []).append(r)
    for fp, sharing in holders.items():
        if not _may_share(sharing):
            described = "; ".join(
                f"stream {label!r} on ranks {sharing[(label, ident)]}"
                for label, ident in sorted(sharing)
            )
            problems.append(
                f"these must differ but are in one state ({fp[:6]}), so they draw identical values: {described}"
            )
    return RNGReport(
        ok=not problems,
        problems=tuple(problems),
        fingerprints=fingerprints,
        coordinates=[info["coords"] for info in everyone],
    )
