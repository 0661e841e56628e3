"""Selective recompute of a cheap function whose output is freed once its consumer ran.

Usage (Megatron's shape and signature)::

    act = CheckpointWithoutOutput()
    h = act.checkpoint(gelu, x)          # h is a normal tensor
    y = fc2(h)                           # the consumer saves h (or views of it)
    act.discard_output_and_register_recompute(y)   # h's memory is freed now

When backward reaches ``y`` the function is recomputed, with the forward's randomness,
into ``h``'s storage before ``fc2``'s backward reads it (views of ``h`` see it too).

Only storage that the outputs alone hold is freed: an output that shares storage with an
input (Megatron's fused residual norm returns the residual) or with any other live tensor
keeps its memory. Where no input needs grad (a frozen layer before a trainable consumer),
autograd keeps no input, so the object keeps them until the recompute, and refuses one
modified in place since.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rng_tracker._recompute import (
    ForwardContext,
    Reentry,
    backward_recomputed,
    forward_context,
    refuse_untraceable_checkpoint,
    resolve_trackers,
)
from rng_tracker._rng_snapshot import RNGSnapshot, accelerators, replaying
from rng_tracker._torch_private import checkpoint_valid, storage_use_count
from rng_tracker._tracker import RNGStatesTracker
from rng_tracker._validate import checked_flag
from rng_tracker.errors import CheckpointConfigError, CheckpointTypeError, CheckpointUsageError

__all__ = ["CheckpointWithoutOutput", "CheckpointWithoutOutputManager"]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@functools.cache
def _refcount_of_an_unheld_base() -> int:
    """``sys.getrefcount`` of a view's base that nothing but the view holds, fetched into
    one local (measured, not assumed, since it differs across Python versions)."""
    view = torch.empty(2).view(2)
    base = view._base
    return sys.getrefcount(base)


def _check_hook_tensor(hook_tensor: object, method: str) -> None:
    """Refuse a ``hook_tensor`` that is not a tensor before any output is freed: the freed
    storage could then never be refilled."""
    if not isinstance(hook_tensor, torch.Tensor):
        raise CheckpointTypeError(
            f"{method}(hook_tensor) needs the tensor whose backward triggers the recompute (the "
            f"consumer's output, e.g. y in y = fc2(h)), got {type(hook_tensor).__name__}; "
            "nothing was freed"
        )


def _held_elsewhere(outputs: list[torch.Tensor]) -> bool:
    """Whether a tensor other than ``outputs`` (which share one storage) and the bases they
    are views of holds that storage, or a Python object other than the views holds a base."""
    storage = outputs[0].untyped_storage()
    uses = storage_use_count(storage)
    if uses is None:  # no way to tell: keep it
        return True
    impls = {id(o) for o in outputs}
    for output in outputs:
        base = output._base
        if base is not None and id(base) not in impls:
            if (
                sys.getrefcount(base) > _refcount_of_an_unheld_base()
            ):  # e.g. a parameter the output views
                return True
            impls.add(id(base))
    # One reference per TensorImpl on the storage, plus ``storage`` itself.
    return uses - 1 > len(impls)


class _RunWithoutSavingOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: CheckpointWithoutOutput, *args: Any) -> Any:
        ctx.owner = owner
        ctx.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.slots))
        owner._ctx = weakref.ref(ctx)
        assert owner._function is not None
        with torch.no_grad():
            return owner._function(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        owner: CheckpointWithoutOutput = ctx.owner
        if owner._recomputed is None:
            owner._recompute(None)
        assert owner._recomputed is not None
        inputs, outputs = owner._recomputed
        owner._recomputed = None
        backward_recomputed(outputs, grad_outputs)
        grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in inputs)
        return (None, *grads)


class CheckpointWithoutOutput:
    """Runs a function whose output can be dropped after use and rebuilt for backward.

    Megatron-LM's ``CheckpointWithoutOutput(fp8=False, ckpt_manager=None,
    retain_input_tensors=False)``, replaying the CPU and input-device generators and every
    tracker stream (or those of ``tracker``).

    Args:
        fp8: accepted for Megatron's signature and kept as ``self.fp8``; it has no effect
            here: Megatron uses it to replay TransformerEngine's FP8 autocast state, which
            this library does not manage (run the recompute under your own FP8 context).
        ckpt_manager: a :class:`CheckpointWithoutOutputManager`; ``checkpoint`` registers
            with it, and discarding and the recompute hook are then the manager's job.
        retain_input_tensors: accepted for Megatron's signature; outputs sharing storage
            with an input (or with any other live tensor) are always retained here, since
            freeing them would destroy the caller's data.
        tracker: tracker(s) whose streams to replay; default every tracker of the process.
    """

    def __init__(
        self,
        fp8: Any = False,
        ckpt_manager: CheckpointWithoutOutputManager | None = None,
        retain_input_tensors: bool = False,
        *,
        tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None,
    ) -> None:
        if ckpt_manager is not None and not isinstance(
            ckpt_manager, CheckpointWithoutOutputManager
        ):
            raise CheckpointTypeError(
                "ckpt_manager must be a CheckpointWithoutOutputManager, got "
                f"{type(ckpt_manager).__name__}"
            )
        retain_input_tensors = checked_flag(
            retain_input_tensors, "retain_input_tensors", type_error=CheckpointTypeError
        )
        self.fp8 = fp8
        self.ckpt_manager = ckpt_manager
        self.retain_input_tensors = retain_input_tensors
        self._trackers = (  # None: every tracker alive at each checkpoint()
            None if tracker is None else resolve_trackers(tracker)
        )
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self._function: Callable[..., Any] | None = None
        self._ctx: weakref.ref[Any] | None = None
        self._freeable: list[tuple[int, list[torch.Tensor]]] = []  # (nbytes, outputs on it)
        self._discarded = False
        # The hook discard_output_and_register_recompute registered, while it waits: only the
        # autograd graph holds it, so it dies with a graph dropped without backward.
        self._waiting_hook: weakref.ref[Callable[[Any], None]] | None = None
        self._snapshot: RNGSnapshot | None = None
        self._wanted: list[torch.device] = []  # the generators snapshotted besides CPU
        self._replayed: list[RNGStatesTracker] = []  # the trackers snapshotted at checkpoint()
        self._context: ForwardContext | None = None  # what checkpoint() ran in (reentered)
        self._recomputed: tuple[list[Any], tuple[Any, ...]] | None = None
        # (inputs, their versions) while no autograd node keeps them: no output needs grad
        self._held_inputs: tuple[tuple[Any, ...], list[int | None]] | None = None

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``run_function(*args)`` without saving its output for its own backward."""
        if torch.compiler.is_dynamo_compiling():
            refuse_untraceable_checkpoint("CheckpointWithoutOutput")
        if not callable(run_function):
            raise CheckpointTypeError(
                f"run_function must be callable, got {type(run_function).__name__}"
            )
        if self._discarded and self._waiting_hook is not None and self._waiting_hook() is not None:
            raise CheckpointUsageError(
                "checkpoint() called again while the outputs of its last call are discarded and "
                "wait for their recompute in backward, which would then run this call's "
                "function instead; use one CheckpointWithoutOutput per call (as Megatron does), "
                "or run that backward first"
            )
        self._function = run_function
        devices = [a.device for a in args if isinstance(a, torch.Tensor)]
        self._replayed = resolve_trackers(self._trackers)
        self._wanted = accelerators(devices, self._replayed)  # found once, used at each replay
        self._snapshot = RNGSnapshot.take(self._wanted, self._replayed)
        self._context = forward_context()
        self._recomputed = None
        self._discarded = False
        outputs = _RunWithoutSavingOutput.apply(self, *args)
        self.outputs = tuple(
            o
            for o in (outputs if isinstance(outputs, tuple) else (outputs,))
            if isinstance(o, torch.Tensor)
        )
        self._freeable = self._storage_only_outputs_hold(args)
        self._held_inputs = None
        if torch.is_grad_enabled() and not any(o.requires_grad for o in self.outputs):
            # No input needs grad, so autograd keeps no node and no input; a consumer with
            # parameters (a frozen fc1 before a trainable fc2) still needs the outputs refilled.
            versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
            self._held_inputs = (args, versions)
        if self.ckpt_manager is not None:
            self.ckpt_manager.add_checkpoint(self)
        return outputs

    def _storage_only_outputs_hold(
        self, args: Sequence[Any]
    ) -> list[tuple[int, list[torch.Tensor]]]:
        inputs = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        by_storage: dict[int, list[torch.Tensor]] = {}
        assert self.outputs is not None
        for output in self.outputs:
            by_storage.setdefault(_storage_key(output), []).append(output)
        return [
            (outs[0].untyped_storage().nbytes(), outs)
            for key, outs in by_storage.items()
            if key != 0 and key not in inputs and not _held_elsewhere(outs)
        ]

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' memory now; refill it when backward reaches ``hook_tensor``.

        With a ``ckpt_manager`` this does nothing (the manager discards and hooks), as in
        Megatron; a ``hook_tensor`` that needs no grad (e.g. under ``torch.no_grad``) gets
        no hook, since no backward will come.
        """
        _check_hook_tensor(hook_tensor, "discard_output_and_register_recompute")
        if self.outputs is None:
            raise CheckpointUsageError(
                "call checkpoint(...) before discard_output_and_register_recompute()"
            )
        if self.ckpt_manager is not None:
            return
        self._discard_outputs()
        self._waiting_hook = None
        if hook_tensor.requires_grad:

            def recompute(grad: Any) -> None:
                self._recompute(grad)

            self._waiting_hook = weakref.ref(recompute)
            hook_tensor.register_hook(recompute)

    def _discard_outputs(self) -> None:
        """Release the storage only the outputs hold (their metadata stays)."""
        for _, outputs in self._freeable:
            outputs[0].untyped_storage().resize_(0)
        self._discarded = True

    def _recompute(self, _: Any) -> None:
        """Rebuild the outputs (a tensor hook; Megatron's manager calls it too)."""
        self._waiting_hook = None
        if self._recomputed is not None:
            return
        if not checkpoint_valid():
            raise CheckpointUsageError(
                "Checkpointing is not compatible with .grad(), please use .backward() if "
                "possible: CheckpointWithoutOutput recomputes from a backward hook, which "
                "torch.autograd.grad and backward(inputs=...) cannot drive"
            )
        assert self._snapshot is not None and self._function is not None
        ctx = self._ctx() if self._ctx is not None else None
        if ctx is None and self._held_inputs is None:
            if not self._discarded:
                return  # no autograd node waits for a recompute, and the outputs hold their data
            raise CheckpointUsageError(
                "the outputs of checkpoint() were discarded but its inputs are no longer kept: "
                "it ran under torch.no_grad(), or an earlier backward freed its graph (pass "
                "retain_graph=True to that backward to recompute again)"
            )
        if ctx is not None:
            args = list(ctx.non_tensors)
            for slot, tensor in zip(ctx.slots, ctx.saved_tensors, strict=True):
                args[slot] = tensor.detach().requires_grad_(tensor.requires_grad)
        else:
            args = self._unchanged_held_inputs()
        with (
            replaying(self._snapshot, self._wanted, self._replayed),
            Reentry(self._context),
            torch.enable_grad(),
        ):
            outputs = self._function(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self._discarded:
            self._refill([o for o in outputs if isinstance(o, torch.Tensor)])
        if ctx is None:  # no autograd node takes the recompute: let the inputs go
            self._held_inputs = None
            return
        self._recomputed = (args, outputs)

    def _unchanged_held_inputs(self) -> list[Any]:
        """The inputs kept while no output needed grad, refused if one was modified in place
        since checkpoint() (autograd refuses it for the inputs it keeps)."""
        assert self._held_inputs is not None
        args, versions = self._held_inputs
        for index, (arg, version) in enumerate(zip(args, versions, strict=True)):
            if version is not None and arg._version != version:
                raise CheckpointUsageError(
                    f"input {index} of checkpoint() was modified in place after the call (its "
                    f"version is {arg._version}, was {version}), so the recompute cannot "
                    "rebuild the output; clone it before modifying it"
                )
        return list(args)

    def _refill(self, fresh: list[torch.Tensor]) -> None:
        assert self.outputs is not None
        recomputed = {id(old): new for old, new in zip(self.outputs, fresh, strict=True)}
        for nbytes, outputs in self._freeable:
            outputs[0].untyped_storage().resize_(nbytes)
            for output in outputs:
                # .data: no version bump, so the consumer's saved references stay valid.
                output.data.copy_(recomputed[id(output)].detach())
        self._discarded = False


class CheckpointWithoutOutputManager:
    """Discards several :class:`CheckpointWithoutOutput` outputs at once and recomputes them
    all, in forward order, from one hook (Megatron's manager, for chains of checkpoints)."""

    def __init__(self) -> None:
        self.checkpoints: list[CheckpointWithoutOutput] = []
        # Megatron's TransformerBlock flag: keep the block-boundary output uncheckpointed.
        self.is_last_layer_in_recompute_block = False

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        """Register a checkpoint that already ran (``CheckpointWithoutOutput.checkpoint``)."""
        if not isinstance(ckpt, CheckpointWithoutOutput):
            raise CheckpointTypeError(
                f"expected a CheckpointWithoutOutput, got {type(ckpt).__name__}"
            )
        if ckpt.outputs is None:
            raise CheckpointConfigError(
                "CheckpointWithoutOutput must call checkpoint() before it is added"
            )
        self.checkpoints.append(ckpt)

    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free every registered output now; recompute them all when backward reaches
        ``hook_tensor``."""
        _check_hook_tensor(hook_tensor, "discard_all_outputs_and_register_unified_recompute")
        for ckpt in self.checkpoints:
            ckpt._discard_outputs()
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._unified_recompute_hook)

    def _unified_recompute_hook(self, grad: torch.Tensor) -> None:
        for ckpt in self.checkpoints:
            ckpt._recompute(None)
