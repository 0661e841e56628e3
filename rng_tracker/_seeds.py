"""Seeds of the default generators and the parallel RNG streams.

A seed is a pure function of (base seed, stream, the coordinates of the parallel axes
the stream varies over). Scheme ``"hashed"`` maps those values through a keyed 64-bit
permutation (a 4-round Feistel network whose round function is BLAKE2b keyed by the base
seed): distinct (stream, coordinates) can never share a seed, because the encoding is
injective and a permutation keeps it so. Scheme ``"megatron"`` is Megatron-LM's
arithmetic, kept bit for bit for migrating users; its collisions are reported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast, get_args

import torch

from rng_tracker._deprecation import renamed_keyword
from rng_tracker._layout import ParallelLayout, checked_layout, process_layout
from rng_tracker._streams import (
    AXES,
    DATA_PARALLEL_RNG,
    DEFAULT_STREAM,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    stream_axes,
)
from rng_tracker._tracker import (
    RNGStatesTracker,
    check_stream_seeds,
    get_rng_tracker,
    validate_seed,
)
from rng_tracker._validate import (
    checked_flag,
    checked_instance,
    checked_int,
    refuse_repeat,
    shown_value,
)
from rng_tracker.errors import (
    ArgumentTypeError,
    InvalidSeedError,
    InvalidSeedTypeError,
    ParallelStateError,
    RankError,
    RankTypeError,
    SeedCoordinateError,
    SeedCoordinateTypeError,
    SeedOverflowError,
    SeedSchemeError,
    StreamNameError,
)

Scheme = Literal["hashed", "megatron"]

# Hashed-scheme encoding: stream id in the top 4 bits, then the stream's axes packed in
# fixed-width fields (widths bound the ranks the scheme accepts).
_FIELD_BITS = {"tp": 12, "cp": 12, "pp": 12, "dp": 24, "ep": 16, "etp": 8}
_STREAM_IDS = {
    DEFAULT_STREAM: 0,
    DATA_PARALLEL_RNG: 1,
    MODEL_PARALLEL_RNG: 2,
    EXPERT_PARALLEL_RNG: 3,
}
_MASK32 = 0xFFFFFFFF


def _encode(stream: str, coords: Mapping[str, int], axes: tuple[str, ...]) -> int:
    value = _STREAM_IDS[stream]
    for axis in axes:
        bits = _FIELD_BITS[axis]
        rank = coords[axis]
        if rank >= 1 << bits:
            raise RankError(
                f"{axis}_rank {rank} exceeds the hashed scheme's limit of {(1 << bits) - 1} "
                f"(its {bits}-bit field); check the rank (a global rank given for the {axis} "
                "rank?), or seed with scheme='megatron', whose arithmetic has no such field"
            )
        value = (value << bits) | rank
    return value


def _feistel64(key: bytes, value: int) -> int:
    left, right = value >> 32, value & _MASK32
    for round_index in range(4):
        digest = hashlib.blake2b(
            bytes((round_index,)) + right.to_bytes(4, "little"), digest_size=4, key=key
        ).digest()
        left, right = right, left ^ int.from_bytes(digest, "little")
    return (left << 32) | right


def _seed_key(base_seed: int) -> bytes:
    """The Feistel key of a base seed."""
    return hashlib.blake2b(
        b"rng_tracker._seeds.v1" + base_seed.to_bytes(8, "little"), digest_size=32
    ).digest()


def _hashed_seed(key: bytes, stream: str, coords: Mapping[str, int], axes: tuple[str, ...]) -> int:
    return _feistel64(key, _encode(stream, coords, axes))


def _megatron_seeds(base_seed: int, c: Mapping[str, int], dp_random_init: bool) -> dict[str, int]:
    default = base_seed + 100 * c["pp"] + (10 * c["dp"] if dp_random_init else 0)
    return {
        DEFAULT_STREAM: default,
        DATA_PARALLEL_RNG: default,
        MODEL_PARALLEL_RNG: default + 2718 + c["tp"],
        EXPERT_PARALLEL_RNG: default + 1024 + 100 * c["ep"] + c["etp"],
    }


@dataclass(frozen=True, slots=True)
class SeedPlan:
    """Every seed one rank set: the default generators' and each tracker stream's."""

    scheme: Scheme
    base_seed: int
    default_seed: int
    stream_seeds: dict[str, int] = field(hash=False)
    coordinates: dict[str, int] = field(hash=False)
    data_parallel_random_init: bool = False

    def __post_init__(self) -> None:
        """Check every field, a hand-made plan's too (verify_rng_consistency trusts what it
        holds): the scheme, seeds in [0, 2**64), stream names as str, a rank >= 0 for every
        axis (an axis left out is rank 0, as plan_seeds counts it) and a bool flag."""
        fields = _checked_plan_fields(
            self.scheme,
            self.base_seed,
            self.default_seed,
            self.stream_seeds,
            self.coordinates,
            self.data_parallel_random_init,
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def __str__(self) -> str:
        coords = " ".join(f"{axis}={rank}" for axis, rank in self.coordinates.items())
        streams = ", ".join(f"{name}={seed}" for name, seed in self.stream_seeds.items())
        return f"SeedPlan[{self.scheme}] base={self.base_seed} {coords} default={self.default_seed} {streams}"


_SCHEMES = get_args(Scheme)


def _checked_plan_fields(
    scheme: object,
    base_seed: object,
    default_seed: object,
    stream_seeds: object,
    coordinates: object,
    data_parallel_random_init: object,
) -> dict[str, object]:
    """A :class:`SeedPlan`'s fields, checked and as plain values, each refusal naming its field."""

    def seed(value: object, what: str) -> int:
        return checked_int(
            value,
            f"SeedPlan.{what}",
            type_error=InvalidSeedTypeError,
            value_error=InvalidSeedError,
            minimum=0,
            maximum=2**64 - 1,
        )

    _checked_scheme(scheme, "SeedPlan.scheme")
    if not isinstance(stream_seeds, Mapping):
        raise ArgumentTypeError(
            "SeedPlan.stream_seeds must be a mapping of stream name to seed (what plan_seeds "
            f"gives), got {shown_value(stream_seeds)}"
        )
    for name in stream_seeds:
        if not isinstance(name, str) or not name:
            raise StreamNameError(
                f"SeedPlan.stream_seeds names must be non-empty str, got {shown_value(name)}"
            )
    checked_coordinates = _coordinates(coordinates, "SeedPlan.coordinates")
    return {
        "base_seed": seed(base_seed, "base_seed"),
        "default_seed": seed(default_seed, "default_seed"),
        "stream_seeds": {
            name: seed(value, f"stream_seeds[{name!r}]") for name, value in stream_seeds.items()
        },
        "coordinates": checked_coordinates,
        "data_parallel_random_init": checked_flag(
            data_parallel_random_init, "SeedPlan.data_parallel_random_init"
        ),
    }


def _checked_scheme(scheme: object, what: str) -> Scheme:
    """``scheme`` if it names a seed scheme, else :class:`SeedSchemeError` naming ``what``."""
    if not isinstance(scheme, str) or scheme not in _SCHEMES:
        raise SeedSchemeError(f"{what} must be 'hashed' or 'megatron', got {shown_value(scheme)}")
    return cast(Scheme, scheme)


def checked_rank(what: str, value: object) -> int:
    """``value`` as a rank, an int >= 0 (bools refused), else :class:`RankError` naming ``what``."""
    return checked_int(value, what, type_error=RankTypeError, value_error=RankError, minimum=0)


def _coordinates(coordinates: object, what: str | None = None) -> dict[str, int]:
    """Every axis's rank from ``coordinates`` (missing axes are 0); unknown axis names and
    ranks that are not ints >= 0 are refused, since a misspelt axis would seed as rank 0.
    ``what``: the field they are (a :class:`SeedPlan`'s; None must then be refused), named in
    each refusal; None for plan_seeds' argument, where None is no coordinates."""
    if coordinates is None and what is None:
        coordinates = {}
    where = what or "coordinates"
    if not isinstance(coordinates, Mapping):
        raise SeedCoordinateTypeError(
            f"{where} must be a mapping of axis name to rank (axes {', '.join(AXES)}; an axis "
            f"left out is rank 0), got {shown_value(coordinates)}"
        )
    unknown = [key for key in coordinates if key not in AXES]
    if unknown:
        shown = ", ".join(repr(key)[:40] for key in unknown[:5])
        raise SeedCoordinateError(
            f"{where} names the unknown axis {shown}: the axes are {', '.join(AXES)} (a rank "
            "like tp_rank=3 is given as {'tp': 3}); an axis left out counts as rank 0"
        )
    return {
        axis: checked_rank(
            f"{what}[{axis!r}]" if what else f"{axis}_rank", coordinates.get(axis, 0)
        )
        for axis in AXES
    }


def _check_no_overflow(scheme: str, seed: int, seeds: Mapping[str, int], where: str) -> None:
    """Refuse a base seed whose derived stream seeds leave [0, 2**64), naming the largest base
    seed these coordinates allow (Megatron's arithmetic adds offsets to the base seed)."""
    highest = max(seeds, key=lambda stream: seeds[stream])
    if seeds[highest] < 2**64:
        return
    largest = 2**64 - 1 - (seeds[highest] - seed)
    if largest < 0:
        raise SeedOverflowError(
            f"scheme {scheme!r} at {where} would give stream {highest!r} an offset of "
            f"{seeds[highest] - seed} from the base seed, beyond the largest seed 2**64-1 with any "
            "base seed: these ranks are too large for its arithmetic; pass the process's real "
            "ranks, or use scheme='hashed'"
        )
    raise SeedOverflowError(
        f"scheme {scheme!r} with seed {seed} at {where} would give stream {highest!r} the seed "
        f"{seeds[highest]} (the base seed plus {seeds[highest] - seed}), beyond the largest "
        f"seed 2**64-1; at these coordinates pass a seed of at most {largest}"
    )


def plan_seeds(
    seed: int,
    *,
    scheme: Scheme = "hashed",
    coordinates: Mapping[str, int] | None = None,
    data_parallel_random_init: bool = False,
) -> SeedPlan:
    """The seeds one rank would set, without touching any generator.

    ``coordinates`` maps axis names (``AXES``) to ranks; a left-out axis is rank 0 and an
    unknown one raises :class:`SeedCoordinateError`. Raises :class:`SeedReuseError` when two
    tracker streams would share a seed (which Megatron's arithmetic does, e.g. ep_rank 17
    and tp_rank 6), and :class:`SeedOverflowError` when Megatron's arithmetic would take a
    seed past 2**64-1.
    """
    seed = validate_seed(seed)
    scheme = _checked_scheme(scheme, "scheme")
    data_parallel_random_init = checked_flag(data_parallel_random_init, "data_parallel_random_init")
    coords = _coordinates(coordinates)
    if scheme == "hashed":
        key = _seed_key(seed)
        seeds = {
            stream: _hashed_seed(
                key,
                stream,
                coords,
                stream_axes(stream, data_parallel_random_init=data_parallel_random_init),
            )
            for stream in _STREAM_IDS
        }
    else:
        seeds = _megatron_seeds(seed, coords, data_parallel_random_init)
    where = " ".join(f"{axis}={rank}" for axis, rank in coords.items())
    _check_no_overflow(scheme, seed, seeds, where)
    default = seeds.pop(DEFAULT_STREAM)
    refuse_repeat(
        seeds.items(),
        lambda first, second, value: (
            f"scheme {scheme!r} gives streams {first!r} and {second!r} the same seed {value} "
            f"at {where}: they would draw identical masks (Megatron-LM refuses this seed too); "
            "seed with rng_tracker.model_parallel_seed(seed, scheme='hashed'), its default, "
            "which cannot collide"
        ),
    )
    return SeedPlan(
        scheme=scheme,
        base_seed=seed,
        default_seed=default,
        stream_seeds=seeds,
        coordinates=coords,
        data_parallel_random_init=data_parallel_random_init,
    )


def ranks_from_layout(
    layout: ParallelLayout | None, missing: list[str], caller: str = "model_parallel_seed"
) -> dict[str, int]:
    """Every axis's rank for a caller that left ``missing`` out: ``layout``'s, else 0 in a
    single process.

    Several ranks with no layout would all take rank 0 and draw correlated masks, so that is
    refused rather than guessed.
    """
    if layout is not None:
        return {axis: layout.rank(axis) for axis in AXES}
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ParallelStateError(
            f"{caller} on rank {dist.get_rank()} of {dist.get_world_size()}: no "
            f"parallel state is initialised and {', '.join(missing)} were not given, so every "
            "rank would seed as rank 0 and draw correlated masks; call "
            "rng_tracker.parallel.init_model_parallel(...) first, pass layout=..., or pass "
            "every rank explicitly"
        )
    return dict.fromkeys(AXES, 0)


def apply_seed_plan(
    plan: SeedPlan, tracker: RNGStatesTracker, extra: Mapping[str, int] | None = None
) -> None:
    """Seed the CPU and ``tracker``'s device default generators and give ``tracker`` exactly the
    plan's streams and ``extra`` ones (it is reset first). The plan was checked when it was made;
    what only the tracker's device refuses (on CPU, two seeds equal modulo 2**32) is refused
    here before anything changes."""
    streams = {**plan.stream_seeds, **(extra or {})}
    check_stream_seeds(tracker.device, streams)
    tracker.reset()
    torch.default_generator.manual_seed(plan.default_seed)
    if tracker.device.type != "cpu":
        tracker.generator.manual_seed(plan.default_seed)
    for stream, stream_seed in streams.items():
        tracker.add(stream, stream_seed)


def model_parallel_seed(
    seed: int,
    *,
    scheme: Scheme = "hashed",
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    dp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    cp_rank: int | None = None,
    data_parallel_random_init: bool = False,
    layout: ParallelLayout | None = None,
    tracker: RNGStatesTracker | None = None,
    state: ParallelLayout | None = None,
) -> SeedPlan:
    """Seed the CPU and device default generators and register the parallel streams.

    Ranks come from the arguments, then from ``layout`` (a
    :class:`~rng_tracker.ParallelLayout`, e.g. :class:`~rng_tracker.parallel.ParallelState`),
    then from the process's parallel state; in a single process the rest are 0. With several
    ranks and no layout, leaving a rank out raises :class:`ParallelStateError` instead of
    guessing rank 0 everywhere. The tracker is reset and gets ``data-parallel-rng``,
    ``model-parallel-rng`` and ``expert-parallel-rng``. Returns the :class:`SeedPlan` (pass it
    to ``verify_rng_consistency(plan=...)``). Nothing changes if the call raises.
    ``state=`` is the deprecated name of ``layout=``.
    """
    layout = renamed_keyword("model_parallel_seed", "state", "layout", state, layout)
    checked_flag(data_parallel_random_init, "data_parallel_random_init")  # before any layout work
    if layout is not None:
        checked_layout(layout, "model_parallel_seed", ("rank",))
    tracker = (
        get_rng_tracker()
        if tracker is None
        else checked_instance(
            tracker,
            RNGStatesTracker,
            "model_parallel_seed(tracker=...) takes an RNGStatesTracker (e.g. "
            "get_rng_tracker(device)) or None",
        )
    )
    given = {
        "tp": tp_rank,
        "pp": pp_rank,
        "dp": dp_rank,
        "ep": ep_rank,
        "etp": etp_rank,
        "cp": cp_rank,
    }
    missing = [f"{axis}_rank" for axis in AXES if given[axis] is None]
    if layout is None and missing:
        layout = process_layout()  # the edge: looked up here, passed in below
    coords = ranks_from_layout(layout, missing) if layout is not None or missing else {}
    coords.update({axis: rank for axis, rank in given.items() if rank is not None})
    plan = plan_seeds(
        seed, scheme=scheme, coordinates=coords, data_parallel_random_init=data_parallel_random_init
    )
    apply_seed_plan(plan, tracker)
    return plan
