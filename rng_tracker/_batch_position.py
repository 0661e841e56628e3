"""Where the running microbatch sits in the global batch: the one home of the batch position.

A data-parallel rank or a microbatch holds some samples of the step's global batch; nothing in
a forward says which. The training loop says it, ``batch_position(sample_offset, global_batch)``
around the microbatch's forward, and whatever places a mask in the global batch reads it: keyed
sites (``rng_tracker.parallel.sites``, megatron-core's in invariant mode) and
``invariant_random()``. A checkpoint captures it with its forward and re-enters it in the
recompute (``_recompute``), which pipeline schedules run after later microbatches' forwards.
Per thread: a recompute in an autograd worker thread sees the position its forward had.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rng_tracker._layout import process_layout
from rng_tracker._validate import checked_int, known_true, shown_value
from rng_tracker.errors import (
    BatchPositionError,
    BatchPositionTypeError,
    MissingBatchPositionError,
)


def _checked(value: object, what: str, minimum: int) -> int:
    return checked_int(
        value,
        what,
        type_error=BatchPositionTypeError,
        value_error=BatchPositionError,
        minimum=minimum,
    )


def _checked_place(offset: object, batch: object, caller: str) -> tuple[int, int]:
    """(offset, batch) as ints >= 0 with the offset below the batch (or 0, the place of an empty
    batch); ``caller`` names the call in the refusal."""
    offset = _checked(offset, "sample_offset", 0)
    batch = _checked(batch, "global_batch", 0)
    if known_true(offset > 0) and known_true(offset >= batch):
        raise BatchPositionError(
            f"{caller}(sample_offset={offset}, global_batch={batch}): the offset must be below "
            "the global batch; give the microbatch's first sample's index in the step's global "
            "batch"
        )
    return offset, batch


@dataclass(frozen=True, slots=True)
class BatchPosition:
    """A microbatch holds samples [sample_offset, sample_offset + b) of a global batch."""

    sample_offset: int
    global_batch: int

    def __post_init__(self) -> None:
        """A hand-made one is checked too: ints >= 0, the offset below the global batch (or 0,
        the place of an empty batch, which a local batch of 0 samples is)."""
        offset, batch = _checked_place(self.sample_offset, self.global_batch, "BatchPosition")
        object.__setattr__(self, "sample_offset", offset)  # frozen: plain ints, set once here
        object.__setattr__(self, "global_batch", batch)


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What a forward runs in: its position (None: none entered) and, while megatron-core's
    schedule runs a forward step, how many microbatches the step has."""

    position: BatchPosition | None = None
    microbatches: int | None = None


_LOCAL = threading.local()
_NONE = BatchContext()


def batch_context() -> BatchContext:
    """This thread's batch context now (what a checkpoint's forward captures)."""
    return getattr(_LOCAL, "context", None) or _NONE


def swap_batch_context(context: BatchContext | None) -> BatchContext | None:
    """Make ``context`` this thread's (None: none entered); return the one it replaces."""
    previous = getattr(_LOCAL, "context", None)
    _LOCAL.context = context
    return previous


@contextlib.contextmanager
def _entered(context: BatchContext) -> Iterator[None]:
    previous = swap_batch_context(context)
    try:
        yield
    finally:
        swap_batch_context(previous)


@contextlib.contextmanager
def batch_position(sample_offset: int, global_batch: int) -> Iterator[BatchPosition]:
    """Run the body's forward as the microbatch at ``sample_offset`` of a ``global_batch``.

    Enter it around each microbatch's forward, on every data-parallel rank and pipeline stage:
    keyed dropout sites and ``invariant_random()`` then draw the rows of the whole global
    batch's masks that these samples own. Checkpoints carry it into their recompute. Raises
    :class:`~rng_tracker.errors.BatchPositionError` for a position outside the batch.
    """
    sample_offset, global_batch = _checked_place(sample_offset, global_batch, "batch_position")
    _checked(global_batch, "global_batch", 1)  # a step has samples; a BatchPosition may be 0 of 0
    position = BatchPosition(sample_offset, global_batch)
    with _entered(BatchContext(position, batch_context().microbatches)):
        yield position


@contextlib.contextmanager
def microbatches(count: int | None) -> Iterator[None]:
    """Record, for the body, how many microbatches megatron-core's schedule runs in this step."""
    with _entered(BatchContext(batch_context().position, count)):
        yield


def fitting(position: object, local_batch: int, where: str = "") -> BatchPosition:
    """``position`` itself, if it is a :class:`BatchPosition` that a microbatch of
    ``local_batch`` samples fits (``where``: who asks, for the message)."""
    if not isinstance(position, BatchPosition):
        raise BatchPositionTypeError(
            "position must be a BatchPosition (from current_batch_position or batch_position), "
            f"got {shown_value(position)}"
        )
    if position.sample_offset + local_batch > position.global_batch:
        raise BatchPositionError(
            f"{where}a microbatch of {local_batch} samples at offset {position.sample_offset} "
            f"does not fit a global batch of {position.global_batch}; fix batch_position(...)"
        )
    return position


ENTER_A_POSITION = (
    "Enter rng_tracker.batch_position(sample_offset, global_batch) around each microbatch's "
    "forward (sample_offset: its first sample's index in the step's global batch, over all "
    "data-parallel ranks)"
)


def current_batch_position(local_batch: int) -> BatchPosition:
    """The place of a local batch of ``local_batch`` samples: the entered :func:`batch_position`;
    without one, the whole batch where one data-parallel rank runs one microbatch, else
    :class:`~rng_tracker.errors.MissingBatchPositionError` (see :func:`required_position`)."""
    local_batch = _checked(local_batch, "local_batch", 0)
    return required_position(local_batch, "current_batch_position()", ENTER_A_POSITION)


def assumed_batch_position(local_batch: int) -> BatchPosition:
    """The entered :func:`batch_position`, else the whole batch, never refused: for what only
    records where a draw was (a mask probe), not what it draws."""
    return fitting(batch_context().position or BatchPosition(0, local_batch), local_batch)


def box_in_batch(
    shape: Sequence[int],
    batch_dim: int,
    position: BatchPosition,
    split: tuple[int, int, int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset) of the box a local tensor of ``shape`` holds in its logical tensor
    over the whole global batch: ``position``'s samples along ``batch_dim`` and, with ``split``
    = (dim, index, count), chunk ``index`` of ``count`` even chunks along ``dim`` (a TP shard)."""
    global_shape, offset = list(shape), [0] * len(shape)
    if split is not None:
        dim, index, count = split
        global_shape[dim] *= count
        offset[dim] = index * shape[dim]
    global_shape[batch_dim], offset[batch_dim] = position.global_batch, position.sample_offset
    return tuple(global_shape), tuple(offset)


def required_position(local_batch: int, drawer: str, advice: str) -> BatchPosition:
    """The position of a microbatch of ``local_batch`` samples that ``drawer`` places: the
    entered :func:`batch_position`; without one, the whole batch where one data-parallel rank
    runs one microbatch, as far as the process's layout and megatron-core's schedule say, else
    :class:`~rng_tracker.errors.MissingBatchPositionError` (an offset is never guessed) saying
    ``advice``."""
    context = batch_context()
    if context.position is not None:
        return fitting(context.position, local_batch, f"{drawer}: ")
    layout = process_layout()
    dp = 1 if layout is None else layout.size("dp")
    count = context.microbatches or 1
    if dp > 1 or count > 1:
        raise MissingBatchPositionError(
            f"{drawer} ran with no batch position while {dp} data-parallel rank(s) run {count} "
            f"microbatch(es) each: its rows of the global batch are unknown. {advice}"
        )
    return BatchPosition(0, local_batch)
