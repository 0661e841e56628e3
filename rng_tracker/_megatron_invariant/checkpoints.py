"""megatron's checkpoint entry points, carrying the batch position into the recompute.

A 1F1B schedule recomputes a microbatch's checkpointed layers in its backward, after later
microbatches' forwards entered their own positions; the recompute must draw the rows of the
microbatch it recomputes. These wrap ``rng_tracker.megatron``'s ``checkpoint``,
``CheckpointFunction`` and ``CheckpointWithoutOutput`` so the function they run re-enters the
position in effect at its first forward (:func:`~.position.carrying_position`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rng_tracker import megatron as _facade
from rng_tracker._megatron_invariant.position import carrying_position


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """``rng_tracker.megatron.checkpoint``, its recompute in the first forward's batch position."""
    return _facade.checkpoint(carrying_position(function), distribute_saved_activations, *args)


class CheckpointFunction(_facade.CheckpointFunction):
    """``CheckpointFunction.apply(function, distribute_saved_activations, *args)`` is
    :func:`checkpoint`."""

    @staticmethod
    def apply(
        run_function: Callable[..., Any], distribute_saved_activations: bool, *args: Any
    ) -> Any:
        """Checkpoint ``run_function(*args)`` (see :func:`checkpoint`)."""
        return checkpoint(run_function, distribute_saved_activations, *args)


class CheckpointWithoutOutput(_facade.CheckpointWithoutOutput):
    """``rng_tracker.megatron.CheckpointWithoutOutput``, its recompute in the first forward's
    batch position."""

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without saving its output (see the base class)."""
        if not callable(run_function):
            return super().checkpoint(run_function, *args)  # the base class names the error
        return super().checkpoint(carrying_position(run_function), *args)
