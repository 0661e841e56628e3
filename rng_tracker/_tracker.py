"""The tracker of named RNG streams of one device.

A stream is a saved state of the device's default generator. Forking a stream swaps
its state into the generator for the body and saves the advanced state back, so every
torch op (and every rng_tracker kernel) inside the body draws from that stream.
"""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from rng_tracker._checkpointing import in_unreplayed_torch_checkpoint
from rng_tracker._deprecation import warn_deprecated
from rng_tracker._device_rng import DeviceRNG, RNGState, device_rng, plain_state
from rng_tracker._streams import MODEL_PARALLEL_RNG
from rng_tracker._torch_private import (
    disable_current_dispatch_modes,
    dynamo_allows_no_graph_break,
    last_node,
    recording_graph,
    records_a_draw,
    run_eagerly_under_compile,
)
from rng_tracker._validate import checked_int, refuse_repeat
from rng_tracker.errors import (
    CPURNGChangedWarning,
    DuplicateStreamError,
    ForkNotReplayedWarning,
    ForkOrderError,
    ForkTracedError,
    InvalidSeedError,
    InvalidSeedTypeError,
    SeedReuseError,
    StateDictError,
    StateDictTypeError,
    StreamNameError,
    TrackerBusyError,
    TrackerDeviceError,
    TrackerDeviceTypeError,
    UnknownStreamError,
)

STATE_DICT_VERSION = 1
_T = TypeVar("_T")


def validate_seed(
    seed: Any,
    *,
    type_error: type[Exception] = InvalidSeedTypeError,
    value_error: type[Exception] = InvalidSeedError,
) -> int:
    """Return ``seed`` as an int in [0, 2**64), or raise a typed error (``type_error`` for what
    is no int, ``value_error`` for one out of range)."""
    return checked_int(
        seed, "seed", type_error=type_error, value_error=value_error, minimum=0, maximum=2**64 - 1
    )


_SERIALS = itertools.count()
_SERIALS_ISSUED = [0]  # serials handed out so far: all_trackers' cache key
_SHOWN_NAME_CHARS = 80  # a stream name in an error message is cut to about this many characters
_SHOWN_NAMES = 20  # and a list of known names to this many


def _shown(name: object) -> str:
    """``repr(name)``, cut to a readable length: a 100 kB name must not flood an error message."""
    text = repr(name) if isinstance(name, str) else f"{name!r} ({type(name).__name__})"
    if len(text) <= _SHOWN_NAME_CHARS:
        return text
    size = f"{len(name)} chars" if isinstance(name, str) else f"{len(text)} chars as repr"
    return f"{text[: _SHOWN_NAME_CHARS - 20]}...({size})"


def _shown_names(names: list[str]) -> str:
    shown = ", ".join(_shown(n) for n in names[:_SHOWN_NAMES])
    if len(names) > _SHOWN_NAMES:
        shown += f", ... ({len(names) - _SHOWN_NAMES} more)"
    return shown or "none"


def _one_seed(first: int, second: int) -> str:
    """How a refusal names two seeds one generator cannot tell apart."""
    if first == second:
        return f"the same seed {first}"
    return (
        f"the seeds {first} and {second}, which are equal modulo 2**32: the CPU generator "
        "(torch's mt19937) uses only a seed's low 32 bits, so to it they are one seed"
    )


def check_stream_seeds(device: torch.device, seeds: Mapping[str, int]) -> None:
    """Refuse, with :class:`SeedReuseError`, the ``seeds`` (stream name to seed) that
    :meth:`RNGStatesTracker.add` would refuse on an empty tracker of ``device``: two that its
    generator cannot tell apart (equal, or on CPU equal modulo 2**32). Seeding checks a whole
    plan with it before it changes anything."""
    _refuse_one_seed(
        device_rng(device, generator_states=False),
        seeds,
        f"of the {device} tracker get",
        "give each stream a seed of its own",
    )


def _refuse_one_seed(rng: DeviceRNG, seeds: Mapping[str, int], where: str, advice: str) -> None:
    """:class:`SeedReuseError` for two of ``seeds`` that ``rng``'s generator cannot tell apart;
    the message reads "streams A and B {where} <the seed(s)>: ...; {advice}"."""
    refuse_repeat(
        ((name, rng.used_seed(seed)) for name, seed in seeds.items()),
        lambda first, second, _: (
            f"streams {_shown(first)} and {_shown(second)} {where} "
            f"{_one_seed(seeds[first], seeds[second])}: they would draw identical values; {advice}"
        ),
    )


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise StreamNameError(f"stream name must be a non-empty str, got {_shown(name)}")
    return name


def _warn_unreplayed(name: str, stacklevel: int) -> None:
    """Warn of a fork in a forward of torch's own checkpoint that no rng_tracker checkpoint
    (which replay the streams; rng_context_fn runs torch's inside its own record) runs in."""
    warnings.warn(
        f"fork({name!r}) entered in a forward of torch.utils.checkpoint, which replays the "
        "default generators but not the tracker's streams: its recompute would draw other "
        f"values from {name!r} and the gradients would be wrong. Use rng_tracker.checkpoint "
        "(e.g. checkpoint_wrapper(module, checkpoint_fn=rng_tracker.checkpoint)), or pass "
        "context_fn=rng_tracker.rng_context_fn() to torch's checkpoint",
        ForkNotReplayedWarning,
        stacklevel=stacklevel,
    )


class _Fork:
    """Context manager of one fork; a class (not a generator) to keep enter/exit cheap. Also a
    decorator, as Megatron's ``@contextmanager`` fork is: each call runs in a fork of its own.
    The name is checked at entry, as Megatron's is, so a function may be decorated before its
    stream is added."""

    __slots__ = ("_cpu_before", "_name", "_traced", "_tracker")

    def __init__(self, tracker: RNGStatesTracker, name: str) -> None:
        self._tracker = tracker
        self._name = name
        self._cpu_before: torch.Tensor | None = None
        # under a trace: the graph it records, its length, and the streams' states at entry
        self._traced: tuple[Any, int, Any] | None = None

    def __enter__(self) -> None:
        if torch.compiler.is_dynamo_compiling():
            # Traced only in the frame Dynamo resumes after fork()'s graph break (a trace that
            # allows no break refused at fork(); Dynamo refuses a fork object made elsewhere):
            # it cannot trace the swap, nor resume in a with's entry, so a plain graph break
            # here, not one deep in _open (a torch warning), and the frame runs eagerly
            _open_eagerly(self)
        else:
            self._open()

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:  # the body's error, not a traced draw's, goes out
            self._traced = None
        self._close(1)

    def __call__(self, function: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(function)
        def forked(*args: Any, **kwargs: Any) -> _T:
            # Under torch.compile the call runs eagerly, as Dynamo runs a frame whose code holds
            # a fork's with: traced, a torch dropout in it would draw Inductor's mask, not eager's
            if torch.compiler.is_compiling():
                if torch.compiler.is_dynamo_compiling():
                    _refuse_where_no_graph_break(self._name)
                return _call_in_fork_eagerly(self, function, args, kwargs, exact_frames=False)
            return _call_in_fork(self, function, args, kwargs)

        return forked

    def _open(self, frames_to_user: int = 1) -> None:
        """Enter the fork; its warning names the user's frame, ``frames_to_user`` frames above
        this one (1: the caller of ``__enter__``)."""
        tracker = self._tracker
        graph = recording_graph()
        if graph is not None:
            with disable_current_dispatch_modes():  # the real states, not the trace's tensors
                self._traced = (graph, last_node(graph), tracker.get_states())
        tracker._enter(self._name)  # refuses an unknown name before anything changes
        if not tracker._rng.is_cpu:
            self._cpu_before = torch.default_generator.get_state()
        if in_unreplayed_torch_checkpoint():
            try:
                _warn_unreplayed(self._name, stacklevel=3 + frames_to_user)
            except BaseException:  # the warning as an error (-W error): the fork stays closed
                self._close(None)
                raise

    def _close(self, frames_to_user: int | None) -> None:
        """Leave the fork; a CPU-generator warning names the user's frame, ``frames_to_user``
        frames above this one's caller (1: the caller of ``__exit__``; None: not known)."""
        self._tracker._exit(self._name)
        traced, self._traced = self._traced, None
        if traced is not None and records_a_draw(*traced[:2]):
            with disable_current_dispatch_modes():  # a real-tensor trace drew from the stream
                self._tracker.set_states(traced[2])
            raise ForkTracedError(
                f"a random op drew inside fork({self._name!r}) under a graph trace "
                "(torch.export with strict=False, or make_fx), which records the op but not the "
                "fork's swap of generator states: the traced program would draw from the "
                "default generator, not the stream. Trace in eval mode (a fork that draws "
                "nothing traces), draw with a keyed seed (kernels.dropout(..., seed=) as an "
                "input of the traced function), or run the traced program inside the fork"
            )
        if self._cpu_before is not None:
            changed = not torch.equal(self._cpu_before, torch.default_generator.get_state())
            self._cpu_before = None
            if changed:
                user = None if frames_to_user is None else sys._getframe(frames_to_user + 1)
                self._tracker._warn_cpu_changed(user, self._name)


def _refuse_where_no_graph_break(name: object) -> None:
    """Called where Dynamo traces a fork: a trace that allows no graph break (strict export,
    fullgraph=True) cannot hold one, and Dynamo's own error would name neither the fork nor the
    way out, so refuse it here."""
    way_out = (
        "or draw with a keyed seed (kernels.dropout(..., seed=) as an input of the traced "
        "function, or a keyed site), which needs no fork"
    )
    if torch.compiler.is_exporting():
        raise ForkTracedError(
            f"torch.export(strict=True) cannot trace fork({name!r}): Dynamo cannot trace the "
            "swap of generator states and export allows no graph break. Export with "
            f"strict=False (a fork that draws nothing traces there), {way_out}"
        )
    if dynamo_allows_no_graph_break():
        raise ForkTracedError(
            f"torch.compile(fullgraph=True) cannot trace fork({name!r}): Dynamo cannot trace "
            "the swap of generator states and fullgraph allows no graph break. Compile without "
            "fullgraph (the fork runs eagerly, with the rest of its frame: a fork in a function "
            f"of its own, or @tracker.fork(name), keeps the code around it compiled), {way_out}"
        )


def _call_in_fork(
    spec: _Fork, function: Callable[..., _T], args: tuple, kwargs: dict, exact_frames: bool = True
) -> _T:
    """``function(*args, **kwargs)`` in a fork of its own, of ``spec``'s tracker and name; its
    warnings name the caller of the decorated wrapper (``exact_frames``: no wrapper between)."""
    fork = _Fork(spec._tracker, spec._name)
    fork._open(frames_to_user=2)  # past this function and the decorated wrapper
    try:
        return function(*args, **kwargs)
    finally:
        fork._close(2 if exact_frames else None)


_FORK_BREAK = (
    "a fork swaps generator states on the host, which a graph cannot hold: it runs eagerly"
)
_call_in_fork_eagerly = run_eagerly_under_compile(_call_in_fork, _FORK_BREAK)
_new_fork_eagerly = run_eagerly_under_compile(_Fork, _FORK_BREAK)
_open_eagerly = run_eagerly_under_compile(_Fork._open, _FORK_BREAK)


# What a snapshot keeps of a tracker besides its streams' states, for a checkpoint's replay to
# put back: the open forks (outermost first), the generator's own state under them, and the
# streams' seeds (a dict the tracker replaces, never modifies). A plain tuple: a checkpointed
# call takes and restores two per tracker.
HeldContext = tuple[tuple[str, ...], "RNGState | None", dict[str, int]]


class RNGStatesTracker:
    """Named RNG streams of one device, forked in and out of its default generator.

    Args:
        device: the device whose default generator the streams drive; None means the
            current accelerator device if one is available, else CPU.
        generator_states: the form of the saved states (see :class:`DeviceRNG`). None:
            graph-safe ``torch.Generator`` handles on CUDA, uint8 tensors elsewhere;
            True: ``torch.Generator`` objects on every device; False: uint8 tensors on
            every device. Forks draw the same values in every form.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        generator_states: bool | None = None,
    ) -> None:
        self._rng: DeviceRNG = device_rng(device, generator_states=generator_states)
        self._states: dict[str, RNGState] = {}
        self._seeds: dict[str, int] = {}  # replaced, never modified: snapshots share it
        self._register()

    def _register(self) -> None:
        """Start with no open fork, and join the trackers that checkpoints replay."""
        self._serial = next(_SERIALS)
        _SERIALS_ISSUED[0] = self._serial + 1
        self._open_forks: list[str] = []  # the streams of the open forks, outermost first
        self._outer: RNGState | None = None  # the generator's own state while forks are open
        self._warned_sites: set[tuple[str, int]] = set()
        _ALL_TRACKERS.add(self)

    # -- copies and pickles ------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or a copy (``copy.deepcopy``, ``copy.copy``) keeps: the device, the
        state form, copies of the streams (an open fork's live state) and the seeds. The copy
        forks that device's default generator, as the original does (a copied generator would
        draw nothing anyone sees), has no open fork, and its checkpoints replay it."""
        kept = {k: v for k, v in self.__dict__.items() if k not in _PER_INSTANCE}
        kept["_states"] = {n: self._rng.to_bytes(s) for n, s in self.get_states().items()}
        kept["_rng"] = (str(self.device), self._rng.generator_states)
        return kept

    def __setstate__(self, kept: dict[str, Any]) -> None:
        device, generator_states = kept.pop("_rng")
        self.__dict__.update(kept)
        self._rng = device_rng(device, generator_states=generator_states)
        self._states = {n: self._rng.from_bytes(data) for n, data in kept["_states"].items()}
        self._register()

    # -- inspection -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device whose default generator this tracker forks."""
        return self._rng.device

    @property
    def generator(self) -> torch.Generator:
        """The device's default generator, which forks swap stream states into."""
        return self._rng.generator

    def names(self) -> list[str]:
        """Stream names in the order they were added."""
        return list(self._states)

    def seeds(self) -> dict[str, int]:
        """The seed each stream was added with (streams set by ``set_states`` have none)."""
        return dict(self._seeds)

    def is_initialized(self) -> bool:
        """Whether any stream is registered."""
        return bool(self._states)

    def open_forks(self) -> tuple[str, ...]:
        """The streams of the open forks, outermost first."""
        return tuple(self._open_forks)

    def active(self) -> tuple[str, ...]:
        """Deprecated name of :meth:`open_forks`."""
        warn_deprecated("RNGStatesTracker.active()", "open_forks()")
        return self.open_forks()

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            raise StreamNameError(f"stream names are str; asked for {_shown(name)}")
        return name in self._states

    def __len__(self) -> int:
        return len(self._states)

    def __bool__(self) -> bool:
        """Always true, as Megatron's tracker is: a tracker without streams (an inference one,
        or one before seeding) is still a tracker, and ``if tracker:`` must not say otherwise."""
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._states))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, streams={self.names()})"

    # -- registration -----------------------------------------------------------------
    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` starting from ``seed``; the generator is untouched.

        A seed another stream has is refused (:class:`SeedReuseError`), and on CPU also one
        equal to it modulo 2**32: torch's CPU generator uses only a seed's low 32 bits."""
        _check_name(name)
        seed = validate_seed(seed)
        if name in self._states:
            raise DuplicateStreamError(
                f"stream {_shown(name)} already exists; call reset() first or pick another name"
            )
        used = self._rng.used_seed(seed)
        for other, other_seed in self._seeds.items():
            if self._rng.used_seed(other_seed) == used:
                also = "" if other_seed == seed else f" ({_one_seed(other_seed, seed)})"
                raise SeedReuseError(
                    f"seed {seed} is already used by stream {_shown(other)}{also}: streams "
                    f"{_shown(other)} and {_shown(name)} would draw identical values; give "
                    f"{_shown(name)} another seed"
                )
        self._states[name] = self._rng.fresh(seed)
        self._seeds = {**self._seeds, name: seed}

    def reset(self) -> None:
        """Forget every stream."""
        self._require_idle("reset()")
        self._states.clear()
        self._seeds = {}

    # -- forking -----------------------------------------------------------------
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> _Fork:
        """Context manager: the body draws from stream ``name``.

        On exit the stream keeps its advanced state and the generator gets back the
        state it had on entry (also when the body raises). Forks nest, and re-entering
        the open stream continues it. Forks must close in reverse order of opening: closing
        one out of order raises :class:`ForkOrderError` and changes nothing. As a decorator
        (``@tracker.fork(name)``), each call of the function runs in a fork of ``name``. The
        name is checked on entry, as Megatron's ``@contextmanager`` fork checks it: a
        function may be decorated before its stream is added, and entering a fork of an
        unknown stream raises :class:`UnknownStreamError` (a name that is not a non-empty str,
        :class:`StreamNameError`) and changes nothing.
        """
        if torch.compiler.is_dynamo_compiling():
            _refuse_where_no_graph_break(name)
            # a graph break at this call, so the code before the with compiles (Dynamo runs the
            # rest of the frame eagerly: it cannot resume in a with it cannot enter)
            return _new_fork_eagerly(self, name)
        return _Fork(self, name)

    def _enter(self, name: str) -> None:
        if not isinstance(name, str) or name not in self._states:
            _check_name(name)
            raise self._unknown(name)
        rng = self._rng
        live = rng.live()
        if self._open_forks:
            self._states[self._open_forks[-1]] = live
        else:
            self._outer = live
        rng.install(self._states[name])
        self._open_forks.append(name)

    def _exit(self, name: str) -> None:
        if not self._open_forks or self._open_forks[-1] != name:
            # Checked in every mode (an assert vanishes under python -O): closing the wrong
            # fork would save one stream's state into another.
            top = _shown(self._open_forks[-1]) if self._open_forks else "none: no fork is open"
            raise ForkOrderError(
                f"fork({_shown(name)}) closed out of order (the innermost open fork is {top}); "
                "forks must close in reverse order of opening: nest them as with-blocks"
            )
        rng = self._rng
        self._states[name] = rng.live()
        self._open_forks.pop()
        if self._open_forks:
            rng.install(self._states[self._open_forks[-1]])
        else:
            rng.install(self._outer)
            self._outer = None

    def _warn_cpu_changed(self, frame: Any, name: str) -> None:
        """Warn once per ``with`` site, at ``frame``, the user's (None: not known)."""
        message = (
            f"the CPU generator advanced inside fork({name!r}) of {self.device}; the CPU "
            "generator is not forked, so these CPU draws are not part of the stream"
        )
        if frame is None:  # a decorated call run eagerly under torch.compile: no site to name
            warnings.warn(message, CPURNGChangedWarning, stacklevel=4)
            return
        site = (frame.f_code.co_filename, frame.f_lineno)
        if site in self._warned_sites:
            return
        self._warned_sites.add(site)
        warnings.warn_explicit(message, CPURNGChangedWarning, filename=site[0], lineno=site[1])

    # -- CUDA graphs ---------------------------------------------------------------
    def register_graph(self, graph: Any) -> None:
        """Register every stream's generator state with ``graph`` (a ``torch.cuda.CUDAGraph``)
        before its capture, so forks inside the capture draw from their streams and each replay
        advances them, as eager calls would.

        torch lets a capture draw only from generator states registered with its graph (the
        default state is registered by the capture itself). Register again after ``add``,
        ``set_states`` or ``restore_states``, which put new states in. Needs a CUDA tracker of
        graph-safe generator states (the default form on CUDA): else
        :class:`TrackerDeviceError`, and nothing is registered.
        """
        if not self._rng.graph_safe:
            form = "cloned generators" if self._rng.generator_states else "uint8 state tensors"
            raise TrackerDeviceError(
                f"register_graph() needs graph-safe CUDA generator states; this tracker of "
                f"{self.device} keeps {form}; create it as RNGStatesTracker('cuda') with "
                "generator_states left at None or True"
            )
        states = [*self._states.values(), *([self._outer] if self._outer is not None else [])]
        for state in states:
            graph.register_generator_state(state)

    # -- snapshots -----------------------------------------------------------------
    def get_states(self) -> dict[str, RNGState]:
        """Copies of every stream's current state; later draws never change them."""
        rng = self._rng
        top = self._open_forks[-1] if self._open_forks else None
        return {
            name: rng.snapshot() if name == top else rng.copy(state)
            for name, state in self._states.items()
        }

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Replace every stream with copies of ``states``.

        A state is what ``get_states`` returns, or any state of this device type in the
        other form (a uint8 state tensor or a ``torch.Generator``, as Megatron's and
        TransformerEngine's trackers hold them); it is converted to this tracker's form. Two
        streams of one state are refused (:class:`SeedReuseError`), as :meth:`add` refuses
        them. Nothing changes if a state is refused.
        """
        rng = self._rng
        if not isinstance(states, Mapping):
            raise TrackerDeviceTypeError(
                f"set_states() takes a mapping of stream name to state, got {type(states).__name__}"
            )
        converted = {name: self._converted(name, state) for name, state in states.items()}
        self._refuse_one_state(converted, "set_states() gives", "give each stream its own state")
        missing = [name for name in self._open_forks if name not in states]
        if missing:
            raise TrackerBusyError(
                f"set_states() would drop the open fork(s) {_shown_names(missing)}; close them first"
            )
        self._states = converted
        self._seeds = {n: s for n, s in self._seeds.items() if n in self._states}
        if self._open_forks:
            rng.install(self._states[self._open_forks[-1]])

    def held_states(self) -> dict[str, RNGState]:
        """The streams' states for a snapshot that :meth:`restore_states` puts back: uint8 state
        tensors shared, not copied (a stream's tensor is replaced, never written in place, so
        it keeps its value), generator states and the open fork's live state copied. Unlike
        :meth:`get_states`, the tensors are the tracker's own: never modify them."""
        rng = self._rng
        if not rng.generator_states and not self._open_forks:  # uint8 tensors, none live
            return dict(self._states)
        top = self._open_forks[-1] if self._open_forks else None
        return {
            name: rng.snapshot()
            if name == top
            else (state if isinstance(state, torch.Tensor) else rng.copy(state))
            for name, state in self._states.items()
        }

    def restore_states(self, states: Mapping[str, RNGState]) -> None:
        """Replace every stream with ``states``, a dict that :meth:`get_states` or
        :meth:`held_states` of this tracker returned (a snapshot's): no conversion,
        and no new generator for a uint8 state (a stream's state tensor is replaced, never
        written in place, so the snapshot stays intact and replays again); a generator state
        is copied, since draws advance it. Open forks must be among ``states`` (the snapshot
        of a call made inside them). Names that are not str, and states that are not states of
        this device type, are refused (:class:`StreamNameError`, :class:`StateDictTypeError`,
        :class:`StateDictError`) and nothing changes. A state tensor that torch cannot read in
        place (a view at a storage offset, a strided one) is copied."""
        self._check_snapshot(states)
        self.restore_held(
            {n: plain_state(s) if isinstance(s, torch.Tensor) else s for n, s in states.items()}
        )

    def held_context(self) -> HeldContext:
        """The open forks, the generator's own state under them and the seeds, as
        :meth:`restore_held` puts them back with the streams of :meth:`held_states`."""
        return tuple(self._open_forks), self._outer, self._seeds

    def restore_held(
        self, states: Mapping[str, RNGState], context: HeldContext | None = None
    ) -> None:
        """:meth:`restore_states` of what :meth:`held_states` of this tracker returned, unchecked:
        a checkpoint's replay puts back its own snapshot at every recompute. With the
        ``context`` taken alongside, the open forks and seeds become the snapshot's too: a
        recompute runs inside the forks its forward ran in (re-entering one continues it), not
        the ones open where backward was called, and then gets those back."""
        rng = self._rng
        open_forks = self._open_forks if context is None else context[0]
        missing = [name for name in open_forks if name not in states]
        if missing:
            raise TrackerBusyError(
                f"restoring would drop the open fork(s) {_shown_names(missing)}; close them first"
            )
        if rng.generator_states:
            restored = {
                name: state if isinstance(state, torch.Tensor) else rng.copy(state)
                for name, state in states.items()
            }
        else:
            restored = dict(states)
        if context is not None:
            forks, self._outer, self._seeds = context
            self._open_forks = list(forks)
        elif restored.keys() != self._states.keys():
            self._seeds = {n: s for n, s in self._seeds.items() if n in restored}
        self._states = restored
        if self._open_forks:
            rng.install(self._states[self._open_forks[-1]])

    def state_dict(self) -> dict[str, Any]:
        """Versioned, device-independent state: streams as seeds and uint8 CPU tensors."""
        states = self.get_states()
        return {
            "version": STATE_DICT_VERSION,
            "device_type": self.device.type,
            "streams": {
                name: {"seed": self._seeds.get(name), "state": self._rng.to_bytes(state)}
                for name, state in states.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore streams saved by :meth:`state_dict`, on this or a restarted process.

        Refuses what :meth:`add` refuses, two streams of one seed (or of one state), with
        :class:`SeedReuseError`; a state dict of the wrong type (not a mapping, a stream name
        that is not a str, a state that is not a uint8 tensor) with
        :class:`StateDictTypeError`, other malformed ones with :class:`StateDictError`.
        Nothing changes if the state dict is refused.
        """
        self._require_idle("load_state_dict()")
        if not isinstance(state_dict, Mapping):
            raise StateDictTypeError(
                f"load_state_dict() takes the mapping state_dict() returned, got "
                f"{type(state_dict).__name__}"
            )
        version = state_dict.get("version")
        if version is not None and type(version) is not int:  # True and 1.0 == 1: no versions
            raise StateDictTypeError(
                f"tracker state dict version {version!r} is a {type(version).__name__}, not the "
                f"int version {STATE_DICT_VERSION}; pass what state_dict() returned"
            )
        if version != STATE_DICT_VERSION:
            raise StateDictError(
                f"tracker state dict version {version!r} is not supported (expected "
                f"{STATE_DICT_VERSION}); save it again with this rng_tracker"
            )
        if state_dict.get("device_type") != self.device.type:
            raise StateDictError(
                f"state dict holds {state_dict.get('device_type')!r} generator states but "
                f"this tracker drives {self.device.type!r}; load it into a tracker of that "
                "device type"
            )
        streams = state_dict.get("streams")
        if not isinstance(streams, Mapping):
            raise (StateDictError if streams is None else StateDictTypeError)(
                f"state dict has no 'streams' mapping (got {type(streams).__name__}); pass what "
                "state_dict() returned"
            )
        states: dict[str, RNGState] = {}
        seeds: dict[str, int] = {}
        for name, entry in streams.items():
            if not isinstance(name, str) or not name:
                raise (StateDictTypeError if not isinstance(name, str) else StateDictError)(
                    f"stream names must be non-empty str, got {_shown(name)}; the state dict "
                    "was not saved by state_dict()"
                )
            data = entry.get("state") if isinstance(entry, Mapping) else None
            if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
                raise StateDictTypeError(
                    f"stream {_shown(name)}: 'state' must be a uint8 tensor, got "
                    f"{data.dtype if isinstance(data, torch.Tensor) else type(data).__name__}; "
                    "pass what state_dict() returned"
                )
            try:
                states[name] = self._rng.from_bytes(data)
            except RuntimeError as error:
                raise StateDictError(
                    f"stream {_shown(name)}: state does not decode: {error}"
                ) from None
            if entry.get("seed") is not None:
                seeds[name] = validate_seed(entry["seed"])
        self._check_distinct(states, seeds)
        self._states = states
        self._seeds = seeds

    # -- helpers -----------------------------------------------------------------
    def _check_distinct(self, states: Mapping[str, RNGState], seeds: Mapping[str, int]) -> None:
        """Refuse what :meth:`add` refuses: two streams of one seed, or of one state (either
        way they would draw identical values). On CPU, seeds equal modulo 2**32 are one seed,
        and states that differ only in the seed they store are one state."""
        rng = self._rng
        _refuse_one_seed(
            rng,
            seeds,
            "of the state dict get",
            "it was not saved by state_dict() of a valid tracker (add() refuses a reused seed)",
        )
        self._refuse_one_state(states, "state dict gives", "save each stream from its own seed")

    def _refuse_one_state(self, states: Mapping[str, RNGState], who: str, fix: str) -> None:
        """:class:`SeedReuseError` where two of ``states`` are one generator state (they would
        draw identical values)."""
        refuse_repeat(
            ((name, self._rng.drawn_key(state)) for name, state in states.items()),
            lambda first, second, _: (
                f"{who} streams {_shown(first)} and {_shown(second)} the same generator state: "
                f"they would draw identical values; {fix}"
            ),
        )

    def _check_snapshot(self, states: object) -> None:
        """Refuse what :meth:`restore_states` cannot put back, without copying anything."""
        if not isinstance(states, Mapping):
            raise StateDictTypeError(
                f"restore_states() takes a mapping of stream name to state (what get_states() "
                f"or held_states() returned), got {type(states).__name__}"
            )
        for name, state in states.items():
            _check_name(name)
            try:
                self._rng.check(state, type_error=StateDictTypeError, value_error=StateDictError)
            except StateDictError as error:
                raise type(error)(f"restore_states(): stream {_shown(name)}: {error}") from None

    def _unknown(self, name: object) -> UnknownStreamError:
        return UnknownStreamError(
            f"no RNG stream named {_shown(name)} on {self.device} (known: "
            f"{_shown_names(list(self._states))}); add it with add(name, seed) or "
            "model_parallel_seed(...)"
        )

    def _require_idle(self, what: str) -> None:
        if self._open_forks:
            raise TrackerBusyError(
                f"{what} inside open fork(s) {_shown_names(self._open_forks)}; call it outside"
            )

    def _converted(self, name: object, state: object) -> RNGState:
        _check_name(name)
        try:
            return self._rng.convert(state)
        except TrackerDeviceError as error:  # the narrower TrackerDeviceTypeError stays itself
            raise type(error)(
                f"state of stream {_shown(name)} does not fit the tracker of {self.device}: {error}"
            ) from None


# Process-wide, not per thread: a tracker forks its device's default generator, which torch
# keeps once per process, and a recompute in an autograd worker thread must replay the streams
# the forward's thread drew from. One tracker per device is what get_rng_tracker() returns.
_PROCESS_TRACKERS: dict[torch.device, RNGStatesTracker] = {}
# Every live tracker (what a checkpoint replays by default), and all_trackers()' last answer as
# (creation serial, live count, weak references), replaced in one store.
_ALL_TRACKERS: weakref.WeakSet[RNGStatesTracker] = weakref.WeakSet()
# a tracker's own bookkeeping, which a pickle or copy starts afresh (RNGStatesTracker._register)
_PER_INSTANCE = frozenset({"_serial", "_open_forks", "_outer", "_warned_sites"})
_ORDERED: list[Any] = [None]


def all_trackers() -> list[RNGStatesTracker]:
    """Every live tracker of this process, in creation order (what checkpoints replay by default)."""
    # Sorting the weak set costs microseconds per checkpoint: reuse the last order while no
    # tracker was made (the serial) and none died (the count).
    key = (_SERIALS_ISSUED[0], len(_ALL_TRACKERS))
    cached = _ORDERED[0]
    if cached is not None and cached[0] == key:
        trackers = [ref() for ref in cached[1]]
        if all(t is not None for t in trackers):
            return trackers  # type: ignore[return-value]
    trackers = sorted(_ALL_TRACKERS, key=lambda t: t._serial)
    _ORDERED[0] = (key, [weakref.ref(t) for t in trackers])
    return trackers


def process_tracker(device: torch.device | str | int | None = None) -> RNGStatesTracker | None:
    """The process's tracker for ``device`` if one was made or set, else None (nothing is made)."""
    return _PROCESS_TRACKERS.get(device_rng(device).device)


def set_process_tracker(tracker: RNGStatesTracker) -> None:
    """Make ``tracker`` what :func:`get_rng_tracker` returns for its device (Megatron's
    ``initialize_rng_tracker`` makes its tracker the process's this way)."""
    _PROCESS_TRACKERS[tracker.device] = tracker


def get_rng_tracker(device: torch.device | str | int | None = None) -> RNGStatesTracker:
    """The process's tracker for ``device`` (one per device, created on first use)."""
    rng = device_rng(device)
    tracker = _PROCESS_TRACKERS.get(rng.device)
    if tracker is None:
        tracker = _PROCESS_TRACKERS[rng.device] = RNGStatesTracker(rng.device)
    return tracker
