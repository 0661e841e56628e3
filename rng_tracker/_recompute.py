"""What both checkpoint modules share around a recompute: which trackers it replays, what it runs
in again (the torch function modes and the batch position of its forward), the backward through
its outputs, and the refusal of a trace that allows no graph break (``activation_checkpoint``
and ``checkpoint_without_output``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from rng_tracker._batch_position import BatchContext, batch_context, swap_batch_context
from rng_tracker._torch_private import dynamo_allows_no_graph_break, function_mode_stack
from rng_tracker._tracker import RNGStatesTracker, all_trackers
from rng_tracker.errors import CheckpointTypeError, CheckpointUsageError


def refuse_untraceable_checkpoint(what: str) -> None:
    """Called where Dynamo traces a checkpoint (``what`` names it): a trace that allows no graph
    break (fullgraph=True, strict export) cannot hold one, and Dynamo's own error ("HOP: Unsafe
    side effect", a Generator method, a disabled function) names neither it nor the way out."""
    if dynamo_allows_no_graph_break():
        raise CheckpointUsageError(
            f"{what} cannot be traced where no graph break is allowed (torch.compile("
            "fullgraph=True), strict export): it snapshots and replays the generators and tracker "
            "streams, host state a graph cannot hold, so it runs eagerly, a graph break. Compile "
            "without fullgraph (the code around it still compiles), compile the function it "
            "runs instead, or checkpoint with torch.utils.checkpoint over keyed sites, which "
            "compiles whole (docs/compile.md)"
        )


def resolve_trackers(
    tracker: RNGStatesTracker | Iterable[RNGStatesTracker] | None,
) -> list[RNGStatesTracker]:
    """The trackers a checkpoint replays: those ``tracker`` names (one, or an iterable of them),
    or every live tracker when it is None (:func:`~rng_tracker._tracker.all_trackers`); anything
    else raises :class:`CheckpointTypeError`."""
    if tracker is None:
        return all_trackers()
    if isinstance(tracker, RNGStatesTracker):
        return [tracker]
    if not isinstance(tracker, Iterable):
        raise CheckpointTypeError(
            "tracker must be an RNGStatesTracker, an iterable of them, or None (every tracker), "
            f"got {type(tracker).__name__}"
        )
    trackers = list(tracker)
    for t in trackers:
        if not isinstance(t, RNGStatesTracker):
            raise CheckpointTypeError(
                f"tracker must be an RNGStatesTracker, got {type(t).__name__}"
            )
    return trackers


# A torch function mode whose class sets this attribute true decides what a random op draws
# (rng_tracker.parallel's invariant_random), so a recompute must run under it as the forward did.
REPLAYED_IN_RECOMPUTE = "replayed_in_recompute"


class ForwardContext(NamedTuple):
    """What a forward ran in that its recompute runs in again: the active function modes that
    decide what random ops draw (outermost first), and the batch position."""

    modes: tuple[Any, ...]
    batch: BatchContext


_new_context = tuple.__new__  # NamedTuple's own __new__ is Python: this runs at every checkpoint


def forward_context() -> ForwardContext:
    """This forward's context, for its recompute."""
    if torch.compiler.is_compiling():  # traced: the compiled graph holds what the modes routed
        modes: tuple[Any, ...] = ()
    else:
        modes = tuple(m for m in function_mode_stack() if getattr(m, REPLAYED_IN_RECOMPUTE, False))
    return _new_context(ForwardContext, (modes, batch_context()))


class Reentry:
    """Context manager around a recompute: the forward's batch position, and its modes where
    they are not active (autograd's engine runs a backward, and so a recompute, without the
    function modes of the code that called it, and after later microbatches entered theirs). A
    class, not a generator: it runs at every recompute."""

    __slots__ = ("_context", "_previous", "_stack")

    def __init__(self, context: ForwardContext) -> None:
        self._context = context
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        modes, batch = self._context
        self._previous = swap_batch_context(batch)
        if modes:
            active = function_mode_stack()
            missing = [m for m in modes if not any(a is m for a in active)]
            if missing:
                stack = contextlib.ExitStack()
                try:
                    for mode in missing:
                        stack.enter_context(mode)
                except BaseException:
                    stack.close()
                    swap_batch_context(self._previous)
                    raise
                self._stack = stack

    def __exit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                stack.close()
        finally:
            swap_batch_context(self._previous)


def backward_recomputed(outputs: Any, grad_outputs: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grad_outputs`` through recomputed ``outputs``, as torch's reentrant
    checkpoint does: raise (with torch's words) when no output requires grad."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grad_outputs)
        if isinstance(out, torch.Tensor) and out.requires_grad
    ]
    if not pairs:
        raise CheckpointUsageError(
            "none of output has requires_grad=True, this checkpoint() is not necessary: the "
            "recomputed function returned no tensor that requires grad (a detached or no-grad "
            "output?). Drop the checkpoint, or use checkpoint(use_reentrant=False)"
        )
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
