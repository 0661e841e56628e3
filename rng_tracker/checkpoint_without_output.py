"""Selective recompute of a cheap function whose output is freed once its consumer ran.

Usage (Megatron's shape)::

    act = CheckpointWithoutOutput()
    h = act.checkpoint(gelu, x)          # h is a normal tensor
    y = fc2(h)                           # the consumer saves h
    act.discard_output_and_register_recompute(y)   # h's memory is freed now

When backward reaches ``y`` the function is recomputed, with the forward's randomness,
into ``h``'s storage before ``fc2``'s backward reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rng_tracker.checkpoint import _backward_recomputed
from rng_tracker.errors import CheckpointTypeError, CheckpointUsageError
from rng_tracker.rng_snapshot import RNGSnapshot, replaying
from rng_tracker.tracker import RNGStatesTracker, all_trackers

__all__ = ["CheckpointWithoutOutput"]


class _RunWithoutSavingOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: CheckpointWithoutOutput, *args: Any) -> Any:
        ctx.owner = owner
        ctx.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.slots))
        with torch.no_grad():
            return owner._function(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        owner: CheckpointWithoutOutput = ctx.owner
        if owner._recomputed is None:
            owner._recompute()
        inputs, outputs = owner._recomputed
        owner._recomputed = None
        _backward_recomputed(outputs, grad_outputs)
        grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in inputs)
        return (None, *grads)


class CheckpointWithoutOutput:
    """Runs a function whose output can be dropped after use and rebuilt for backward."""

    def __init__(
        self, *, tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None
    ) -> None:
        self._trackers = (
            None
            if tracker is None
            else ([tracker] if isinstance(tracker, RNGStatesTracker) else list(tracker))
        )
        self._function: Callable[..., Any] | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._sizes: list[int] = []
        self._snapshot: RNGSnapshot | None = None
        self._devices: list[torch.device] = []
        self._replayed: list[RNGStatesTracker] = []  # the trackers snapshotted at checkpoint()
        self._recomputed: tuple[list[Any], tuple[Any, ...]] | None = None

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without saving its output for its own backward."""
        if not callable(run_function):
            raise CheckpointTypeError(
                f"run_function must be callable, got {type(run_function).__name__}"
            )
        self._function = run_function
        self._devices = list({a.device: None for a in args if isinstance(a, torch.Tensor)})
        self._replayed = self._trackers if self._trackers is not None else all_trackers()
        self._snapshot = RNGSnapshot.capture(self._devices, self._replayed)
        self._recomputed = None
        outputs = _RunWithoutSavingOutput.apply(self, *args)
        self._outputs = tuple(
            o
            for o in (outputs if isinstance(outputs, tuple) else (outputs,))
            if isinstance(o, torch.Tensor)
        )
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's memory now; refill it when backward reaches ``hook_tensor``."""
        if self._snapshot is None:
            raise CheckpointUsageError(
                "call checkpoint(...) before discard_output_and_register_recompute()"
            )
        if not hook_tensor.requires_grad:
            raise CheckpointUsageError(
                "hook_tensor does not require grad, so backward would never refill the output"
            )
        self._sizes = [o.untyped_storage().nbytes() for o in self._outputs]
        for output in self._outputs:
            output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._on_consumer_grad)

    def _on_consumer_grad(self, grad: torch.Tensor) -> None:
        if self._recomputed is None:
            self._recompute()

    def _recompute(self) -> None:
        assert self._snapshot is not None and self._function is not None
        ctx = self._find_ctx()
        args = list(ctx.non_tensors)
        for slot, tensor in zip(ctx.slots, ctx.saved_tensors, strict=True):
            args[slot] = tensor.detach().requires_grad_(tensor.requires_grad)
        with replaying(self._snapshot, self._devices, self._replayed), torch.enable_grad():
            outputs = self._function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self._sizes:  # the outputs were discarded: refill their storage in place
            fresh = [o for o in outputs if isinstance(o, torch.Tensor)]
            for output, size, new in zip(self._outputs, self._sizes, fresh, strict=True):
                output.untyped_storage().resize_(size)
                output.data.copy_(
                    new.detach()
                )  # .data: no version bump for the consumer's saved copy
            self._sizes = []
        self._recomputed = (args, outputs)

    def _find_ctx(self) -> Any:
        # The autograd ctx of our Function is the grad_fn node of any of its outputs.
        for output in self._outputs:
            if output.grad_fn is not None:
                return output.grad_fn
        raise CheckpointUsageError("no output requires grad: nothing to recompute for backward")
