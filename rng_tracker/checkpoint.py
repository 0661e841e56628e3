"""Activation checkpointing that replays every RNG stream exactly.

Both modes snapshot, at forward time, the CPU generator, the default generator of every
device the inputs live on, and every stream of the tracker(s); the recompute runs from
those states and the backward-time states are restored afterwards.

- ``use_reentrant=False`` is ``torch.utils.checkpoint`` (non-reentrant) with a
  ``context_fn`` that adds the tracker streams, so early stop, nesting, kwargs and
  ``torch.autograd.grad`` work as there.
- ``use_reentrant=True`` is a Megatron-style autograd Function.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from rng_tracker.errors import (
    CheckpointConfigError,
    CheckpointRNGMismatchError,
    CheckpointTypeError,
    CheckpointUsageError,
    TrackerDeviceError,
)
from rng_tracker.random_op_log import RandomOpLog, first_divergence
from rng_tracker.rng_snapshot import RNGSnapshot, replaying
from rng_tracker.saved_inputs import InputSaver
from rng_tracker.tracker import RNGStatesTracker, all_trackers

__all__ = ["backward_recomputed", "checkpoint", "rng_context_fn"]


def backward_recomputed(outputs: Any, grad_outputs: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grad_outputs`` through recomputed ``outputs`` (those that need it)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grad_outputs)
        if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _input_devices(args: Iterable[Any], kwargs: dict[str, Any]) -> list[torch.device]:
    seen: dict[torch.device, None] = {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            seen.setdefault(value.device)
    return list(seen)


class _RNGRecord:
    """What one checkpointed call remembers of its randomness."""

    def __init__(
        self, devices: Sequence[torch.device], trackers: Sequence[RNGStatesTracker], check: bool
    ) -> None:
        self.devices = devices
        self.trackers = trackers
        self.check = check
        self.start: RNGSnapshot | None = None
        self.forward_end: RNGSnapshot | None = None
        self.forward_log = RandomOpLog() if check else None

    @contextlib.contextmanager
    def forward(self) -> Any:
        """Run the first forward: snapshot at its start, and (when checking) log and snapshot its end."""
        self.start = RNGSnapshot.capture(self.devices, self.trackers)
        with self.forward_log if self.forward_log is not None else contextlib.nullcontext():
            yield
        if self.check:
            self.forward_end = RNGSnapshot.capture(self.devices, self.trackers)

    @contextlib.contextmanager
    def replay(self) -> Any:
        """Run the recompute from the forward's states; verify it when checking."""
        assert self.start is not None, "recompute before forward"
        log = RandomOpLog() if self.check else None
        mismatch: list[str] = []
        with replaying(self.start, self.devices, self.trackers):
            with log if log is not None else contextlib.nullcontext():
                yield
            if self.check:
                assert (
                    self.forward_end is not None
                    and self.forward_log is not None
                    and log is not None
                )
                end = RNGSnapshot.capture(self.devices, self.trackers)
                mismatch = self.forward_end.differences(end)
                divergence = first_divergence(self.forward_log, log)
                if divergence:
                    mismatch.append(divergence)
        if mismatch:
            raise CheckpointRNGMismatchError(
                "the recompute did not draw the randomness of the first forward: "
                + "; ".join(mismatch)
                + ". Draw only from the tracker's streams and the default generators, and "
                "keep random ops out of data-dependent branches"
            )


def _context_pair(record: _RNGRecord) -> tuple[Any, Any]:
    return record.forward(), record.replay()


def rng_context_fn(
    tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    torch preserves the CPU and input-device generators itself; this adds the tracker
    streams (every tracker of the process when ``tracker`` is None) and the trackers'
    device generators.
    """
    trackers = _resolve_trackers(tracker)

    def context_fn() -> tuple[Any, Any]:
        return _context_pair(
            _RNGRecord((), trackers if trackers is not None else all_trackers(), False)
        )

    return context_fn


def _resolve_trackers(
    tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None,
) -> list[RNGStatesTracker] | None:
    if tracker is None:
        return None
    trackers = [tracker] if isinstance(tracker, RNGStatesTracker) else list(tracker)
    for t in trackers:
        if not isinstance(t, RNGStatesTracker):
            raise CheckpointTypeError(
                f"tracker must be an RNGStatesTracker, got {type(t).__name__}"
            )
    return trackers


def _autocast_state(device_types: Iterable[str]) -> list[tuple[str, bool, torch.dtype]]:
    return [
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
        for dt in {"cpu", *device_types}
        if torch.amp.is_autocast_available(dt)
    ]


@contextlib.contextmanager
def _replay_autocast(state: list[tuple[str, bool, torch.dtype]], cache_enabled: bool) -> Any:
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(
                torch.autocast(
                    device_type, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled
                )
            )
        yield


class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        record: _RNGRecord,
        saver: InputSaver,
        *args: Any,
    ) -> Any:
        ctx.run_function = run_function
        ctx.record = record
        ctx.saver = saver
        ctx.autocast = _autocast_state(d.type for d in record.devices)
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        with torch.no_grad(), record.forward():
            outputs = run_function(*args)
        ctx.tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.input_requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_slots]
        if saver.active:
            ctx.packed = [saver.pack(t) for t in tensors]
        else:
            ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise CheckpointUsageError(
                "checkpoint(use_reentrant=True) supports only .backward() without `inputs`: "
                "torch.autograd.grad and backward(inputs=...) cannot drive its recompute. "
                "Use checkpoint(use_reentrant=False) for them"
            )
        saver: InputSaver = ctx.saver
        tensors = [saver.unpack(p) for p in ctx.packed] if saver.active else list(ctx.saved_tensors)
        args = list(ctx.non_tensors)
        for slot, tensor in zip(ctx.tensor_slots, tensors, strict=True):
            args[slot] = tensor.detach().requires_grad_(ctx.input_requires_grad[slot])
        with (
            ctx.record.replay(),
            torch.enable_grad(),
            _replay_autocast(ctx.autocast, ctx.autocast_cache),
        ):
            outputs = ctx.run_function(*args)
        backward_recomputed(outputs, grad_outputs)
        grads = tuple(
            a.grad if isinstance(a, torch.Tensor) and ctx.input_requires_grad[i] else None
            for i, a in enumerate(args)
        )
        return (None, None, None, *grads)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    distribute_saved_activations: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    offload_to_cpu: bool = False,
    tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None,
    check_rng: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in
    backward with exactly the randomness of this forward.

    Args:
        use_reentrant: Megatron-style autograd Function (``.backward()`` only) instead of
            torch's non-reentrant machinery.
        distribute_saved_activations: keep only this rank's slice of the first input,
            split across ``tp_group`` (default: the TP group of the parallel state), and
            all-gather it for the recompute.
        offload_to_cpu: keep saved inputs in (pinned) CPU memory until the recompute.
        tracker: tracker(s) whose streams to replay; default every tracker of the process.
        check_rng: verify the recompute drew exactly the forward's randomness, else raise
            :class:`CheckpointRNGMismatchError` naming what diverged (turns early stop off).
    """
    if not callable(function):
        raise CheckpointTypeError(f"function must be callable, got {type(function).__name__}")
    devices = _input_devices(args, kwargs)
    trackers = _resolve_trackers(tracker)
    if trackers is not None:
        for t in trackers:
            if devices and t.device not in devices:
                raise TrackerDeviceError(
                    f"the tracker drives {t.device} but the inputs live on {[str(d) for d in devices]}; "
                    "pass the tracker of the inputs' device (get_rng_tracker(x.device))"
                )
    else:
        trackers = all_trackers()
    saver = _input_saver(args, distribute_saved_activations, tp_group, offload_to_cpu)
    record = _RNGRecord(devices, trackers, check_rng)
    if use_reentrant:
        run = functools.partial(function, **kwargs) if kwargs else function
        return _ReentrantCheckpoint.apply(run, record, saver, *args)
    options = {"early_stop": False} if check_rng else {}
    with saver.hooks() if saver.active else contextlib.nullcontext():
        return torch_checkpoint.checkpoint(
            function,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(_context_pair, record),
            preserve_rng_state=False,  # the record snapshots and replays the CPU and input devices itself
            **options,
            **kwargs,
        )


def _input_saver(
    args: Sequence[Any], distribute: bool, group: dist.ProcessGroup | None, offload: bool
) -> InputSaver:
    if not distribute:
        return InputSaver(offload=offload)
    if not args or not isinstance(args[0], torch.Tensor):
        raise CheckpointConfigError(
            "distribute_saved_activations=True needs a tensor as the first argument"
        )
    if group is None:
        from rng_tracker.parallel.mesh import (
            get_parallel_state_or_none,
        )  # lazy: core stays torch-only

        state = get_parallel_state_or_none()
        if state is None:
            raise CheckpointConfigError(
                "distribute_saved_activations=True needs tp_group=... or an initialised "
                "parallel state (rng_tracker.parallel.init_model_parallel)"
            )
        group = state.group("tp")
    return InputSaver(distribute=args[0], group=group, offload=offload)
