"""Where the running microbatch sits in the global batch, for megatron-core's keyed sites.

Megatron never tells the model which microbatch it runs (``forward_step_func`` gets no index),
so the training loop says it: ``batch_position(sample_offset, global_batch)`` around the
microbatch's forward. A checkpointed function captures the position when it first runs and
re-enters it in its recompute, which pipeline schedules run after later microbatches' forwards.
Per thread: a recompute in an autograd worker thread sees the position it carries.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rng_tracker._layout import process_layout
from rng_tracker._validate import checked_int
from rng_tracker.errors import (
    BatchPositionError,
    BatchPositionTypeError,
    MissingBatchPositionError,
)


@dataclass(frozen=True, slots=True)
class Position:
    """Samples [sample_offset, sample_offset + b) of a global batch of ``global_batch``."""

    sample_offset: int
    global_batch: int


@dataclass(frozen=True, slots=True)
class _Context:
    position: Position | None = None
    microbatches: int | None = None  # set while megatron's forward_step runs


_LOCAL = threading.local()


def _current() -> _Context:
    return getattr(_LOCAL, "context", None) or _Context()


@contextlib.contextmanager
def _entered(context: _Context) -> Iterator[None]:
    previous = getattr(_LOCAL, "context", None)
    _LOCAL.context = context
    try:
        yield
    finally:
        _LOCAL.context = previous


@contextlib.contextmanager
def batch_position(sample_offset: int, global_batch: int) -> Iterator[None]:
    """Run the body's forward as the microbatch at ``sample_offset`` of a ``global_batch``.

    Enter it in ``forward_step_func`` around the model call, on every data-parallel rank and
    pipeline stage: each keyed dropout site then draws the rows of the whole global batch's mask
    that these samples own. Raises :class:`BatchPositionError` for a position outside the batch.
    """
    position = Position(
        checked_int(
            sample_offset,
            "sample_offset",
            type_error=BatchPositionTypeError,
            value_error=BatchPositionError,
            minimum=0,
        ),
        checked_int(
            global_batch,
            "global_batch",
            type_error=BatchPositionTypeError,
            value_error=BatchPositionError,
            minimum=1,
        ),
    )
    if position.sample_offset >= position.global_batch:
        raise BatchPositionError(
            f"batch_position(sample_offset={position.sample_offset}, "
            f"global_batch={position.global_batch}): the offset must be below the global batch"
        )
    with _entered(_Context(position, _current().microbatches)):
        yield


@contextlib.contextmanager
def microbatches(count: int | None) -> Iterator[None]:
    """Record, for the body, how many microbatches megatron's schedule runs in this step."""
    with _entered(_Context(_current().position, count)):
        yield


def resolve(local_batch: int, site: str) -> Position:
    """The position of a microbatch of ``local_batch`` samples at ``site``.

    The entered :func:`batch_position`; without one, the whole batch when a single
    data-parallel rank runs a single microbatch, else :class:`MissingBatchPositionError`
    (an offset is never guessed).
    """
    context = _current()
    position = context.position
    if position is None:
        layout = process_layout()
        dp = 1 if layout is None else layout.size("dp")
        count = context.microbatches or 1
        if dp > 1 or count > 1:
            raise MissingBatchPositionError(
                f"keyed site {site!r} ran with no batch position while {dp} data-parallel "
                f"rank(s) run {count} microbatch(es) each: its rows of the global batch are "
                "unknown. Wrap the model call in forward_step_func in "
                "rng_tracker.megatron.batch_position(sample_offset, global_batch)"
            )
        return Position(0, local_batch)
    if position.sample_offset + local_batch > position.global_batch:
        raise BatchPositionError(
            f"keyed site {site!r}: a microbatch of {local_batch} samples at offset "
            f"{position.sample_offset} does not fit the global batch of {position.global_batch}; "
            "fix batch_position(...)"
        )
    return position


def carrying_position(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` that runs, every time it is called, in the position and microbatch count
    in effect now (a checkpoint's first forward), so its recompute draws the same rows."""
    captured = _current()

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _entered(captured):
            return function(*args, **kwargs)

    return run
