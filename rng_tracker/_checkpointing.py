"""Whether this thread runs inside a checkpointed forward or its recompute: one per-thread
count that every rng_tracker checkpoint raises around its function, and that the tracker and
``invariant_random`` read to tell rng_tracker's checkpoints (which replay every stream) from
torch's own."""

from __future__ import annotations

import threading

_DEPTH = threading.local()  # how many checkpointed forwards/recomputes this thread is inside


def is_checkpointing() -> bool:
    """Whether this thread runs inside a checkpointed forward or its recompute (Megatron's
    ``is_checkpointing``), in any mode of ``rng_tracker.checkpoint``, ``reentrant_checkpoint``
    or under ``rng_context_fn``."""
    return getattr(_DEPTH, "value", 0) > 0


def enter_checkpointing() -> None:
    _DEPTH.value = getattr(_DEPTH, "value", 0) + 1


def leave_checkpointing() -> None:
    _DEPTH.value -= 1
