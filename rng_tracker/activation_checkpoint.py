"""Activation checkpointing that replays every RNG stream exactly.

Both modes snapshot, at forward time, the CPU generator, the default generator of every
device the inputs live on, and every stream of the tracker(s); each recompute runs from
those states and the states found when it started are restored afterwards.

- ``use_reentrant=False`` is ``torch.utils.checkpoint`` (non-reentrant): torch calls the
  function once for the forward and once per recompute, and the replay wraps each call,
  so early stop, nesting, kwargs, ``torch.autograd.grad``, repeated and double backward,
  ``debug`` and a user ``context_fn`` (selective checkpointing) work as there.
- ``use_reentrant=True`` is an autograd Function with torch's reentrant contract.
- :func:`reentrant_checkpoint` is Megatron's ``CheckpointFunction`` (``rng_tracker.megatron``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

import rng_tracker._recompute as recompute
import rng_tracker._saved_inputs as saved_inputs
from rng_tracker._checkpointing import enter_checkpointing, is_checkpointing, leave_checkpointing
from rng_tracker._deprecation import deprecated_names, renamed_keyword
from rng_tracker._layout import ParallelLayout, checked_layout, process_layout
from rng_tracker._random_op_log import RandomOpLog, first_divergence
from rng_tracker._rng_snapshot import RNGSnapshot, accelerators, restore_taken
from rng_tracker._saved_inputs import (
    InputSaver,
    first_tensor,
    gather_chunks,
    split_for_save,
)
from rng_tracker._torch_private import (
    checkpoint_valid,
    disable_current_dispatch_modes,
    dispatch_mode_depth,
    run_eagerly_under_compile,
)
from rng_tracker._tracker import RNGStatesTracker, all_trackers
from rng_tracker._validate import checked_flag, shown_value
from rng_tracker.errors import (
    CheckpointConfigError,
    CheckpointRNGMismatchError,
    CheckpointTypeError,
    CheckpointUsageError,
    TrackerDeviceError,
)

__all__ = ["checkpoint", "is_checkpointing", "reentrant_checkpoint", "rng_context_fn"]

# Helpers this module exported in 0.1 that the checkpoint modules share; internal now.
__getattr__ = deprecated_names(
    __name__,
    {
        "check_split_input": "rng_tracker._saved_inputs:check_split_input",
        "resolve_trackers": "rng_tracker._recompute:resolve_trackers",
    },
    instead={
        "check_split_input": "checkpoint(..., distribute_saved_activations=True), which checks",
        "resolve_trackers": "checkpoint(..., tracker=...), which takes one tracker or several",
    },
)

# torch's documented determinism checks (torch.utils.checkpoint.checkpoint's determinism_check).
_DETERMINISM_CHECKS = ("default", "none")

_T = TypeVar("_T")


def _input_devices(args: Iterable[Any], kwargs: dict[str, Any]) -> list[torch.device]:
    seen: dict[torch.device, None] = {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            seen.setdefault(value.device)
    return list(seen)


def _unseen_by_modes(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with torch dispatch modes switched off, so no user mode sees it."""
    if dispatch_mode_depth() == 0:  # the usual case: no context manager to pay for
        return fn(*args)
    with disable_current_dispatch_modes():
        return fn(*args)


class _RNGRecord:
    """What one checkpointed call remembers of its randomness.

    The generator bookkeeping (state copies) runs with torch dispatch modes switched off,
    so a user's modes (selective checkpointing's caches, debug logging) never see it.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        trackers: Sequence[RNGStatesTracker] | None,
        check: bool,
    ) -> None:
        # None: every live tracker, looked up at the first capture, which runs eagerly also under
        # torch.compile (traced, a look at the process's trackers would be a guard on them all)
        self.devices = devices
        self.trackers = trackers
        self.wanted: list[torch.device] = []  # the generators to snapshot besides CPU
        if trackers is not None:
            self.wanted = accelerators(devices, trackers)
        self.check = check
        self.start: RNGSnapshot | None = None
        self.forward_end: RNGSnapshot | None = None
        self.forward_log: RandomOpLog | None = None
        self.context: recompute.ForwardContext | None = None  # what the recompute reenters

    def capture(self) -> RNGSnapshot:
        if self.trackers is None:
            self.trackers = all_trackers()
            self.wanted = accelerators(self.devices, self.trackers)
        return _unseen_by_modes(RNGSnapshot.take, self.wanted, self.trackers)

    def install(self, snapshot: RNGSnapshot) -> None:
        _unseen_by_modes(restore_taken, snapshot)

    def forward(self) -> _Forward:
        """Context of the first forward: snapshot at its start (and, checking, log its draws)."""
        return _Forward(self)

    def replay(self) -> _Replay:
        """Context of a recompute, re-enterable: each entry replays the forward's states."""
        return _Replay(self)


class _Forward:
    """Enter around the first forward; records the states the recomputes will replay."""

    __slots__ = ("_record",)

    def __init__(self, record: _RNGRecord) -> None:
        self._record = record

    def __enter__(self) -> None:
        record = self._record
        record.start = record.capture()
        record.context = recompute.forward_context()
        enter_checkpointing()
        if record.check:
            record.forward_log = RandomOpLog()
            record.forward_log.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        record = self._record
        try:
            if record.forward_log is not None:
                record.forward_log.__exit__(exc_type, exc, tb)
            if record.check and exc_type is None:
                record.forward_end = record.capture()
        finally:
            leave_checkpointing()


class _Replay:
    """Enter around each recompute, any number of times: installs the forward's snapshot,
    and on exit restores what was installed on entry (also when the recompute raises, e.g.
    torch's early stop). When checking, a completed recompute must end in the forward's
    end states and draw the forward's random ops, else it raises."""

    __slots__ = ("_open", "_record")

    def __init__(self, record: _RNGRecord) -> None:
        self._record = record
        self._open: list[tuple[RNGSnapshot, RandomOpLog | None, Any]] = []

    def __enter__(self) -> None:
        record = self._record
        assert record.start is not None, "recompute before forward"
        found = record.capture()
        record.install(record.start)
        context = recompute.Reentry(record.context)
        context.__enter__()
        log = RandomOpLog() if record.check else None
        self._open.append((found, log, context))
        enter_checkpointing()
        if log is not None:
            log.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        record = self._record
        found, log, context = self._open.pop()
        mismatch: list[str] = []
        try:
            if log is not None:
                log.__exit__(exc_type, exc, tb)
            if log is not None and exc_type is None:
                mismatch = _unseen_by_modes(self._mismatch, log)
        finally:
            leave_checkpointing()
            context.__exit__(None, None, None)
            record.install(found)
        if mismatch:
            raise CheckpointRNGMismatchError(
                "the recompute did not draw the randomness of the first forward: "
                + "; ".join(mismatch)
                + ". Draw only from the tracker's streams and the default generators, and "
                "keep random ops out of data-dependent branches"
            )

    def _mismatch(self, log: RandomOpLog) -> list[str]:
        """How a completed recompute (its random ops in ``log``) strayed from the forward."""
        record = self._record
        assert record.forward_end is not None and record.forward_log is not None
        mismatch = record.forward_end.differences(record.capture())
        divergence = first_divergence(record.forward_log, log)
        return [*mismatch, divergence] if divergence else mismatch


class _PreservingAround:
    """A user's recompute context, entered inside a snapshot of the states found on entry and
    left before they are restored: torch runs the whole recompute, its context included, inside
    ``fork_rng``, so a context that draws leaves the generators where they were. Re-enterable."""

    __slots__ = ("_context", "_found", "_record")

    def __init__(self, record: _RNGRecord, context: Any) -> None:
        self._record = record
        self._context = context
        self._found: list[RNGSnapshot] = []

    def __enter__(self) -> Any:
        self._found.append(self._record.capture())
        try:
            return self._context.__enter__()
        except BaseException:
            self._record.install(self._found.pop())
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        try:
            return self._context.__exit__(exc_type, exc, tb)
        finally:
            self._record.install(self._found.pop())


def _preserving_recompute(
    context_fn: Callable[[], tuple[Any, Any]], record: _RNGRecord
) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` whose recompute context leaves the generators as it found them."""

    def contexts() -> tuple[Any, Any]:
        forward, recompute = _context_pair(context_fn)
        return forward, _PreservingAround(record, recompute)

    return contexts


def _context_pair(context_fn: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``context_fn()``, refused unless it is the pair (forward context, recompute context)."""
    pair = context_fn()
    try:  # any two-item iterable, as torch unpacks it
        forward, recompute = pair
    except (TypeError, ValueError):
        raise CheckpointTypeError(
            f"context_fn must return a pair (forward context, recompute context), as "
            f"torch.utils.checkpoint.create_selective_checkpoint_contexts does; got "
            f"{shown_value(pair)}"
        ) from None
    return forward, recompute


class _CheckpointingOnly:
    """Without RNG replay (``preserve_rng_state=False``): marks the forward and each recompute as
    checkpointed (for :func:`is_checkpointing`) and enters the forward's context (function modes,
    batch position) again around each recompute, touching no generator. Re-enterable."""

    __slots__ = ("_context", "_open")

    def __init__(self) -> None:
        self._context: recompute.ForwardContext | None = None
        self._open: list[Any] = []

    def __enter__(self) -> None:
        if self._context is None:  # the forward
            self._context = recompute.forward_context()
            context: Any = contextlib.nullcontext()
        else:
            context = recompute.Reentry(self._context)
        context.__enter__()
        self._open.append(context)
        enter_checkpointing()

    def __exit__(self, *exc_info: object) -> None:
        leave_checkpointing()
        self._open.pop().__exit__(None, None, None)


class _WithReplay:
    """The function as torch's non-reentrant checkpoint calls it: the first call is the
    forward, every later call a recompute replaying the forward's randomness."""

    __slots__ = ("_forward_done", "_function", "_record", "_replay")

    def __init__(self, function: Callable[..., Any], record: _RNGRecord | None) -> None:
        self._function = function
        self._record = record
        self._replay: Any = record.replay() if record is not None else _CheckpointingOnly()
        self._forward_done = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context: Any
        if self._record is None:
            context = self._replay  # forward and recomputes alike
        elif not self._forward_done:
            context = self._record.forward()
        else:
            context = self._replay
        self._forward_done = True
        with context:
            return self._function(*args, **kwargs)


def rng_context_fn(
    tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    torch preserves the CPU and input-device generators itself; this adds the tracker
    streams (every tracker of the process when ``tracker`` is None) and the trackers'
    device generators. Its recompute context replays them at every recompute.
    """
    # Refuse a bad tracker now; None stays None: every tracker alive at each forward.
    given = None if tracker is None else recompute.resolve_trackers(tracker)

    def context_fn() -> tuple[_Forward, _Replay]:
        record = _RNGRecord((), given, False)
        return record.forward(), record.replay()

    return context_fn


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


def _alias_outer_tensors(outputs: Any, args: Sequence[Any]) -> Any:
    """``outputs`` with every tensor that needs grad and is not an input (under the forward's
    no_grad that is a tensor made outside: a parameter, a buffer with grad, Megatron MLP's
    ``bias``) replaced by a detached alias of its storage.

    The Function gives its outputs its own grad_fn; given the outer tensor itself it would
    rewrite that tensor's history to point at the checkpoint, so the recompute, which returns
    the same tensor, would backpropagate into the checkpoint again without end. The alias
    takes the checkpoint's grad_fn instead; the recompute returns the real tensor, which then
    receives its gradient exactly once.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # a view of an input (or of an input's base) stays a view: autograd.Function marks it as
    # one, so an in-place change of it is refused as torch's checkpoint refuses it
    bases = [*tensors, *(a._base for a in tensors if a._base is not None)]

    # identity by `is`, not id(): under torch.compile an id() is a guard on the object, which
    # recompiles at every step's new input
    def alias(value: Any) -> Any:
        if (
            isinstance(value, torch.Tensor)
            and value.requires_grad
            and not any(value is a for a in tensors)
            and (value._base is None or not any(value._base is b for b in bases))
        ):
            return value.detach()
        return value

    if isinstance(outputs, tuple):
        return tuple(alias(o) for o in outputs)
    return alias(outputs)


class _ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        record: _RNGRecord | None,
        saver: InputSaver,
        split_group: dist.ProcessGroup | None,
        *args: Any,
    ) -> Any:
        ctx.run_function = run_function
        ctx.record = record
        ctx.checkpointing_only = _CheckpointingOnly() if record is None else None
        ctx.saver = saver
        ctx.autocast = _autocast_state(a.device.type for a in args if isinstance(a, torch.Tensor))
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        with (
            torch.no_grad(),
            record.forward() if record is not None else ctx.checkpointing_only,
        ):
            outputs = _alias_outer_tensors(run_function(*args), args)
        ctx.tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.input_requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.non_tensors = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_slots]
        ctx.split = None
        if split_group is not None:
            # Megatron: the caller's args[0] keeps only this rank's chunk until backward.
            first = args[0]
            split = split_for_save(first.data, split_group)
            ctx.split = (first.shape, split_group)
            first.data = split.part
        if saver.packing:
            ctx.packed = [saver.pack(t) for t in tensors]
        else:
            ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        if not checkpoint_valid():
            raise CheckpointUsageError(
                "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or "
                "passing an `inputs` parameter to .backward(). The reentrant recompute cannot "
                "serve torch.autograd.grad or backward(inputs=...): use "
                "checkpoint(use_reentrant=False), or call .backward() without `inputs`"
            )
        saver: InputSaver = ctx.saver
        tensors = (
            [saver.unpack(p) for p in ctx.packed] if saver.packing else list(ctx.saved_tensors)
        )
        if ctx.split is not None:
            shape, group = ctx.split
            first = tensors[0]
            first.data = gather_chunks(first.data, shape, group)  # the caller's tensor is whole
            ctx.split = None  # again, and stays so: a repeated backward must not gather it twice
        args = list(ctx.non_tensors)
        for slot, tensor in zip(ctx.tensor_slots, tensors, strict=True):
            args[slot] = tensor.detach().requires_grad_(ctx.input_requires_grad[slot])
        record: _RNGRecord | None = ctx.record
        with (
            record.replay() if record is not None else ctx.checkpointing_only,
            torch.enable_grad(),
            _replay_autocast(ctx.autocast, ctx.autocast_cache),
        ):
            outputs = ctx.run_function(*args)
        recompute.backward_recomputed(outputs, grad_outputs)
        grads = tuple(
            a.grad if isinstance(a, torch.Tensor) and ctx.input_requires_grad[i] else None
            for i, a in enumerate(args)
        )
        return (None, None, None, None, *grads)


def _apply_reentrant(*inputs: Any) -> Any:
    return _ReentrantCheckpoint.apply(*inputs)


# Run eagerly under torch.compile: traced, its backward (the recompute) would be compiled without
# the function modes of the forward, so a recompute under invariant_random would draw torch's
# masks (the non-reentrant form is never traced either).
_reentrant_apply = run_eagerly_under_compile(
    _apply_reentrant,
    reason="rng_tracker's reentrant checkpoint runs eagerly: traced, its recompute would be "
    "compiled without the forward's function modes",
)


def _warn_if_no_input_requires_grad(args: Sequence[Any]) -> None:
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None",
            UserWarning,
            stacklevel=3,
        )


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = False,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool | None = None,
    distribute_saved_activations: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    layout: ParallelLayout | None = None,
    offload_to_cpu: bool = False,
    tracker: RNGStatesTracker | Sequence[RNGStatesTracker] | None = None,
    check_rng: bool = False,
    parallel_state: ParallelLayout | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in
    backward, every time, with exactly the randomness of this forward.

    torch's keywords keep torch's meaning: ``preserve_rng_state=False`` replays no RNG at all
    (neither the generators nor the tracker streams); ``context_fn``, ``determinism_check``,
    ``debug`` and ``early_stop`` (default: torch's, i.e. on) go to torch's non-reentrant
    checkpoint. Reentrant mode refuses ``context_fn``, ``debug`` and keyword arguments for
    ``function``, and ignores ``determinism_check`` and ``early_stop``, as torch does.

    Args:
        use_reentrant: an autograd Function (``.backward()`` only) instead of torch's
            non-reentrant machinery.
        distribute_saved_activations: keep only this rank's slice of the first input,
            split across ``tp_group`` (default: the TP group of ``layout``), and
            all-gather it for the recompute. The caller's tensor is not changed (see
            :func:`reentrant_checkpoint` for Megatron's in-place variant).
        layout: the :class:`~rng_tracker.ParallelLayout` whose TP group
            ``distribute_saved_activations`` splits over when ``tp_group`` is not given;
            default: the process's parallel state (rng_tracker's, else Megatron's). A keyword
            of ``checkpoint`` itself, never passed to ``function`` (give a function that takes
            ``layout`` its value with ``functools.partial``).
        offload_to_cpu: keep saved inputs in (pinned) CPU memory until the recompute.
        tracker: tracker(s) whose streams to replay; default every tracker of the process.
        check_rng: verify each complete recompute drew exactly the forward's randomness,
            else raise :class:`CheckpointRNGMismatchError` naming what diverged (turns early
            stop off unless ``early_stop=True`` is passed, which is refused).
        parallel_state: the deprecated name of ``layout``.
    """
    layout = renamed_keyword("checkpoint", "parallel_state", "layout", parallel_state, layout)
    if torch.compiler.is_dynamo_compiling():
        recompute.refuse_untraceable_checkpoint("rng_tracker.checkpoint")
    if not callable(function):
        raise CheckpointTypeError(f"function must be callable, got {type(function).__name__}")
    if not (  # one expression for the usual call: every flag a bool
        type(preserve_rng_state) is bool
        and type(debug) is bool
        and type(distribute_saved_activations) is bool
        and type(offload_to_cpu) is bool
        and type(check_rng) is bool
        and (use_reentrant is None or type(use_reentrant) is bool)
        and (early_stop is None or type(early_stop) is bool)
    ):
        # the rare call with a flag that is no bool: name the culprit, make numpy's bools
        (
            use_reentrant,
            preserve_rng_state,
            debug,
            early_stop,
            distribute_saved_activations,
            offload_to_cpu,
            check_rng,
        ) = _checked_flags(locals())
    # None: this library's default, non-reentrant (torch's own warns and takes True).
    use_reentrant = bool(use_reentrant)
    if tp_group is not None or layout is not None:
        _check_parallel_options(tp_group, layout)
    if use_reentrant:
        _refuse_non_reentrant_options(context_fn, debug, kwargs)
    elif not callable(context_fn):
        raise CheckpointTypeError(
            f"context_fn must be callable, returning (forward context, recompute context); got "
            f"{shown_value(context_fn)}"
        )
    if check_rng and not preserve_rng_state:
        raise CheckpointConfigError(
            "check_rng=True proves that the recompute replays the forward's randomness, but "
            "preserve_rng_state=False replays none; drop one of them"
        )
    if check_rng and early_stop and not use_reentrant:
        raise CheckpointConfigError(
            "check_rng=True compares the whole recompute with the forward, but early_stop=True "
            "stops the recompute early; drop one of them"
        )
    if not use_reentrant and determinism_check != "default":
        _check_determinism_check(determinism_check)
    devices = _input_devices(args, kwargs)
    trackers = None if tracker is None else recompute.resolve_trackers(tracker)
    if trackers is not None and devices:  # a tracker given must drive the inputs' device
        for t in trackers:
            if t.device not in devices:
                raise TrackerDeviceError(
                    f"the tracker drives {t.device} but the inputs live on "
                    f"{[str(d) for d in devices]}; pass the tracker of the inputs' device "
                    "(get_rng_tracker(x.device))"
                )
    if distribute_saved_activations and tp_group is None and layout is None:
        layout = process_layout()  # the edge: looked up here, passed in below
    saver = _input_saver(args, distribute_saved_activations, tp_group, layout, offload_to_cpu)
    record = _RNGRecord(devices, trackers, check_rng) if preserve_rng_state else None
    if use_reentrant:
        _warn_if_no_input_requires_grad(args)
        return _reentrant_apply(function, record, saver, None, *args)
    if not torch.is_grad_enabled():
        record = None  # torch will not recompute: nothing to replay
    if early_stop is None:
        early_stop = not check_rng
    if context_fn is not torch_checkpoint.noop_context_fn:
        if record is not None and not torch.compiler.is_compiling():
            context_fn = _preserving_recompute(context_fn, record)
        elif not torch.compiler.is_compiling():
            context_fn = functools.partial(_context_pair, context_fn)
        kwargs = {"context_fn": context_fn, **kwargs}  # passed only when given: Dynamo
        # traces torch's checkpoint and accepts only a plain or partial function here
    options = {
        "use_reentrant": False,
        "determinism_check": determinism_check,
        "debug": debug,
        "early_stop": early_stop,
        "preserve_rng_state": False,  # the record snapshots and replays the generators itself
        **kwargs,
    }
    if not saver.packing:
        return torch_checkpoint.checkpoint(_WithReplay(function, record), *args, **options)
    with saver.hooks():
        return torch_checkpoint.checkpoint(_WithReplay(function, record), *args, **options)


_FLAGS = (
    "use_reentrant",
    "preserve_rng_state",
    "debug",
    "early_stop",
    "distribute_saved_activations",
    "offload_to_cpu",
    "check_rng",
)


def _checked_flags(arguments: dict[str, Any]) -> tuple[bool | None, ...]:
    """The flags of :func:`checkpoint`'s ``arguments``, in :data:`_FLAGS` order, as bools
    (numpy's become Python's; ``use_reentrant`` and ``early_stop`` may stay None); one that
    is not a bool is refused before anything runs."""
    return tuple(
        None
        if arguments[name] is None and name in ("use_reentrant", "early_stop")
        else checked_flag(arguments[name], name, type_error=CheckpointTypeError)
        for name in _FLAGS
    )


def _check_group(group: object, what: str) -> None:
    """Refuse a ``group`` that is neither None nor a process group, before anything runs."""
    if group is None:
        return
    process_group = getattr(dist, "ProcessGroup", None)  # absent where torch has no distributed
    if process_group is None or not isinstance(group, process_group):
        raise CheckpointTypeError(
            f"{what} must be a torch.distributed.ProcessGroup (e.g. the TP group of your "
            f"parallel state) or None, got {type(group).__name__}"
        )


def _check_parallel_options(tp_group: object, layout: object) -> None:
    _check_group(tp_group, "tp_group")
    if layout is not None:  # distribute_saved_activations splits over layout.group("tp")
        checked_layout(layout, "checkpoint", ("group",), error=CheckpointTypeError)


def _check_determinism_check(determinism_check: object) -> None:
    """torch's ValueError for a determinism check it does not know, typed, before anything runs."""
    if not (isinstance(determinism_check, str) and determinism_check in _DETERMINISM_CHECKS):
        raise CheckpointConfigError(
            f"determinism_check should be one of {list(_DETERMINISM_CHECKS)}, but got "
            f"{determinism_check}: pass 'default' to compare the recompute's saved tensors with "
            "the forward's, or 'none' to skip the check"
        )


def _refuse_non_reentrant_options(
    context_fn: Callable[[], tuple[Any, Any]], debug: bool, kwargs: dict[str, Any]
) -> None:
    if context_fn is not torch_checkpoint.noop_context_fn or debug is not False:
        raise CheckpointConfigError(
            "Passing `context_fn` or `debug` is only supported when use_reentrant=False. "
            "Drop them, or use checkpoint(use_reentrant=False)"
        )
    if kwargs:
        raise CheckpointConfigError(
            "Unexpected keyword arguments: " + ",".join(kwargs) + ". checkpoint(use_reentrant="
            "True) passes only positional arguments to the function, as torch's does; pass "
            "them positionally or use checkpoint(use_reentrant=False)"
        )


def reentrant_checkpoint(
    function: Callable[..., Any], *args: Any, split_group: dist.ProcessGroup | None = None
) -> Any:
    """Reentrant checkpoint with Megatron's ``CheckpointFunction`` contract, replaying the CPU
    and input-device generators and every tracker stream (:func:`rng_tracker.megatron.checkpoint`).

    With ``split_group`` the caller's ``args[0]`` (a tensor that is not a view) keeps, from the
    end of the forward until backward, only this rank's 1/size flat chunk (``args[0].data`` is
    replaced, as Megatron does), so the memory is freed although the caller holds it; backward
    all-gathers it over ``split_group`` and gives ``args[0]`` its whole data back before
    recomputing.
    """
    if torch.compiler.is_dynamo_compiling():
        recompute.refuse_untraceable_checkpoint("rng_tracker.checkpoint")
    if not callable(function):
        raise CheckpointTypeError(f"function must be callable, got {type(function).__name__}")
    _check_group(split_group, "split_group")
    if split_group is not None:
        saved_inputs.check_split_input(args)
    record = _RNGRecord(_input_devices(args, {}), None, False)
    # no warning when no input needs grad: Megatron's CheckpointFunction gives none
    return _reentrant_apply(function, record, InputSaver(), split_group, *args)


def _tp_group_of(layout: ParallelLayout | None) -> dist.ProcessGroup:
    if layout is None:
        raise CheckpointConfigError(
            "distribute_saved_activations=True needs tp_group=..., layout=... or an "
            "initialised parallel state (rng_tracker.parallel.init_model_parallel, or "
            "Megatron's parallel_state.initialize_model_parallel)"
        )
    return layout.group("tp")


def _input_saver(
    args: Sequence[Any],
    distribute: bool,
    group: dist.ProcessGroup | None,
    layout: ParallelLayout | None,
    offload: bool,
) -> InputSaver:
    if not distribute:
        return InputSaver(offload=offload)
    first = first_tensor(args)
    if group is None:
        group = _tp_group_of(layout)
        _check_group(group, "layout.group('tp')")
    return InputSaver(distribute=first, group=group, offload=offload)
