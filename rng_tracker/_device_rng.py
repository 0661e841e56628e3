"""Access to the default generator of a device, and copies of its state.

This is the only module that knows how each device type stores generator state:
CUDA (graph-safe generator states where torch has them), CPU and any other
``torch.accelerator`` device (state tensors). A :class:`DeviceRNG` may also be asked
for one form on every device: uint8 state tensors, or ``torch.Generator`` objects
(graph-safe handles on CUDA, cloned generators elsewhere), as Megatron's two tracker
modes store them.
"""

from __future__ import annotations

import functools
from typing import TypeAlias, cast

import torch

from rng_tracker._torch_private import disable_current_dispatch_modes
from rng_tracker._validate import checked_flag, checked_int
from rng_tracker.errors import TrackerDeviceError, TrackerDeviceTypeError

_MAX_DEVICE_INDEX = 127  # torch keeps a device index in 8 signed bits: 128 would wrap to -128
_SEED_PROBE = 0x0123456789ABCDEF  # a seed whose 32-bit halves differ
_HIGH_HALF = 0xFFFFFFFF << 32

# A saved generator state: a ``torch.Generator`` (graph-safe handle on CUDA, clone
# elsewhere) or a uint8 CPU tensor.
RNGState: TypeAlias = "torch.Generator | torch.Tensor"


def default_device() -> torch.device:
    """The current accelerator device when one is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        acc = accelerator.current_accelerator()
        return torch.device(acc.type, accelerator.current_device_index())
    return torch.device("cpu")


def _device_module(device: torch.device) -> object:
    """The torch module of ``device``'s type, or :class:`TrackerDeviceError` naming what to do
    when this build or machine has no such device (torch itself raises a bare AssertionError
    for CUDA on a CPU-only build)."""
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:
        module = None
    is_available = getattr(module, "is_available", None)
    if is_available is None or not is_available():
        raise TrackerDeviceError(
            f"device {str(device)!r} is not available here: this torch {torch.__version__} "
            f"build or machine has no usable {device.type!r} device, so it has no generator to "
            f"track; pass device='cpu' (or None for the current accelerator, if any), or run "
            f"where a {device.type} device is visible"
        )
    count = getattr(module, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise TrackerDeviceError(
            f"device {str(device)!r} does not exist: {count()} {device.type} device(s) are "
            f"visible; pass an index below {count()}"
        )
    return module


def normalize_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as the ``torch.device`` of one generator (None: :func:`default_device`; an int:
    that CUDA device; no index: the type's current device), or :class:`TrackerDeviceError`."""
    if device is None:
        return default_device()
    if isinstance(device, bool):
        raise TrackerDeviceTypeError(f"device must be a torch.device, str or int, got {device!r}")
    if isinstance(device, int):
        index = checked_int(
            device,
            "device index",
            type_error=TrackerDeviceTypeError,
            value_error=TrackerDeviceError,
            minimum=0,
            maximum=_MAX_DEVICE_INDEX,
            note="; pass the index of a visible device (or None for the current one)",
        )
        device = torch.device("cuda", index)
    elif isinstance(device, (str, torch.device)):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise TrackerDeviceError(f"{device!r} is not a torch device: {error}") from None
    else:
        raise TrackerDeviceTypeError(
            f"device must be a torch.device, str or int, got {type(device).__name__}"
        )
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch allocates and draws on one CPU, whatever index
            raise TrackerDeviceError(
                f"device {str(device)!r} does not exist: there is one cpu device, on which torch "
                "allocates and draws every CPU tensor whatever index the device names, so a "
                "per-rank 'cpu:<rank>' would share one generator; pass 'cpu' (or 'cpu:0')"
            )
        return torch.device("cpu")
    module = _device_module(device)
    if device.index is None:
        current = getattr(module, "current_device", None)
        device = torch.device(device.type, current() if current is not None else 0)
    return device


def require_device_type(device_type: str) -> None:
    """Refuse (:class:`TrackerDeviceError`) a device type with no usable device here, without
    starting it: no ``current_device()``, which would initialise CUDA before ``DeviceMesh``
    moves each rank to its own device."""
    if device_type != "cpu":
        _device_module(torch.device(device_type))


def plain_state(state: torch.Tensor) -> torch.Tensor:
    """``state`` itself where it starts its storage and is contiguous, else a contiguous copy.

    torch's ``Generator.set_state`` misreads a view at a storage offset (wrong bytes, "Invalid
    mt19937 state", or a crash) and refuses a strided one, so every state tensor the library
    did not make itself passes through here before torch reads it."""
    if state.storage_offset() == 0 and state.is_contiguous():
        return state
    return state.clone(memory_format=torch.contiguous_format)


@functools.cache
def _cpu_seed_layout() -> tuple[int, int]:
    """(how many low bits of a seed torch's CPU generator uses, how many leading bytes of its
    state hold only the stored seed). torch's mt19937 takes the low 32 bits and stores the whole
    seed in the state's first 8 bytes, which no draw reads; probed on two seeds that differ in
    their high 32 bits alone, so a torch that uses all 64 bits gives (64, 0)."""
    with disable_current_dispatch_modes():  # real tensors, even under fake tensors or a trace
        low, high = (
            torch.Generator().manual_seed(s).get_state()
            for s in (_SEED_PROBE, _SEED_PROBE ^ _HIGH_HALF)
        )
        differ = (low != high).nonzero()
        if differ.numel() and int(differ.max()) >= 8:  # the high half changed the mt19937 state
            return 64, 0
        return 32, (8 if differ.numel() else 0)  # 0: no seed stored


def default_generator(device: torch.device | str | int | None = None) -> torch.Generator:
    """The default generator of ``device`` (the one ``torch.manual_seed`` seeds)."""
    device = normalize_device(device)
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    lazy_init = getattr(module, "_lazy_init", None)
    if lazy_init is not None:
        lazy_init()
    generators = getattr(module, "default_generators", None)
    if generators:
        return generators[device.index]
    if device.type == "mps":
        return module._get_default_mps_generator()
    raise TrackerDeviceError(
        f"rng_tracker finds no default generator for {device}; use cpu, cuda or a torch.accelerator device"
    )


class DeviceRNG:
    """Reads and writes the default generator of one device.

    ``live``/``install`` are the fork fast path: on CUDA with graph-safe states they
    move generator-state *handles* (no copy; each handle is installed in at most one
    place at a time), elsewhere they copy states. ``snapshot``/``copy`` always copy, so a
    snapshot never aliases live state.

    Args:
        device: the device whose default generator this reads and writes.
        generator_states: the form of saved states. None: graph-safe ``torch.Generator``
            handles where the device has them (CUDA), else uint8 tensors. True:
            ``torch.Generator`` objects on every device (handles on CUDA, clones
            elsewhere). False: uint8 tensors on every device, CUDA included.
    """

    __slots__ = ("_state_size", "device", "generator", "generator_states", "graph_safe", "is_cpu")

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        generator_states: bool | None = None,
    ) -> None:
        self.device = normalize_device(device)
        self.is_cpu = self.device.type == "cpu"  # read per fork; torch.device.type makes a str
        self.generator = default_generator(self.device)
        has_handles = self.device.type == "cuda" and hasattr(self.generator, "graphsafe_get_state")
        self.generator_states = has_handles if generator_states is None else bool(generator_states)
        self.graph_safe = self.generator_states and has_handles  # states are live handles
        self._state_size: int | None = None  # elements of a uint8 state, read on first check

    def _state_of(self, generator: torch.Generator) -> RNGState:
        # The form this device's states take: a graph-safe handle, a cloned generator or a
        # uint8 tensor copy.
        if self.graph_safe:
            return generator.graphsafe_get_state()
        if self.generator_states:
            return generator.clone_state()
        return generator.get_state()

    def live(self) -> RNGState:
        """The state now installed: a handle on the graph-safe path, else a copy."""
        return self._state_of(self.generator)

    def install(self, state: RNGState) -> None:
        """Make ``state`` the generator's state (by handle on the graph-safe path)."""
        if self.graph_safe:
            self.generator.graphsafe_set_state(state)
        elif isinstance(state, torch.Tensor):
            self.generator.set_state(state)
        else:
            self.generator.set_state(state.get_state())

    def snapshot(self) -> RNGState:
        """An independent copy of the current state."""
        if self.graph_safe:
            return self.generator.graphsafe_get_state().clone_state()
        return self._state_of(self.generator)

    def copy(self, state: RNGState) -> RNGState:
        """An independent copy of a saved state."""
        if isinstance(state, torch.Tensor):
            return state.clone()
        return state.clone_state()

    def fresh(self, seed: int) -> RNGState:
        """A new state seeded with ``seed``, leaving the generator as it was."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return self._state_of(generator)

    def to_bytes(self, state: RNGState) -> torch.Tensor:
        """The state as a uint8 CPU tensor (the device-independent form)."""
        if isinstance(state, torch.Tensor):
            return state.detach().to("cpu", copy=True)
        return state.get_state().to("cpu", copy=True)

    def from_bytes(self, data: torch.Tensor) -> RNGState:
        """A state for this device made from :meth:`to_bytes` output."""
        generator = torch.Generator(device=self.device)
        generator.set_state(plain_state(data.to("cpu")))
        return self._state_of(generator)

    def used_seed(self, seed: int) -> int:
        """The part of ``seed`` the generator uses: on CPU its low 32 bits (torch's mt19937 takes
        no more), so seeds equal modulo 2**32 draw identical values; elsewhere all of it."""
        if self.device.type != "cpu":
            return seed
        return seed & ((1 << _cpu_seed_layout()[0]) - 1)

    def drawn_bytes(self, state: RNGState) -> torch.Tensor:
        """:meth:`to_bytes` of ``state`` without what no draw reads (a CPU state's stored seed,
        zeroed): two states draw identical values exactly when these bytes are equal."""
        data = self.to_bytes(state)
        if self.device.type == "cpu":
            data[: _cpu_seed_layout()[1]] = 0
        return data

    def drawn_key(self, state: RNGState) -> bytes:
        """:meth:`drawn_bytes` as a hashable value: equal exactly where two states would draw
        identical values (what a refusal of two streams of one state compares)."""
        return self.drawn_bytes(state).numpy().tobytes()

    def equal(self, a: RNGState, b: RNGState) -> bool:
        """Whether two saved states are bitwise equal, the seed a CPU state stores included (a
        replay check compares states so; :meth:`drawn_bytes` compares only what is drawn)."""
        return torch.equal(self.to_bytes(a), self.to_bytes(b))

    def check(
        self,
        state: object,
        *,
        type_error: type[Exception] = TrackerDeviceTypeError,
        value_error: type[Exception] = TrackerDeviceError,
    ) -> None:
        """Refuse, without converting or copying it, what is not a saved state of this device
        type: anything but a ``torch.Generator`` of this device type or a CPU uint8 tensor of
        the generator's state size (what ``get_state()`` returns). Not a state's type (nor a
        uint8 tensor): ``type_error``; a generator or tensor that does not fit: ``value_error``."""
        kind = self.device.type
        if isinstance(state, torch.Tensor):  # the common case first: restores run per checkpoint
            size = self._state_size or self._read_state_size()
            if state.dtype is not torch.uint8 or not state.is_cpu or state.numel() != size:
                raise (value_error if state.dtype is torch.uint8 else type_error)(
                    f"the tensor is not a {kind} generator state (dtype {state.dtype} on "
                    f"{state.device}, {state.numel()} elements; a {kind} state is a CPU uint8 "
                    f"tensor of {size}); pass what get_rng_state() or get_states() of the {kind} "
                    "device returns"
                )
            return
        if not isinstance(state, torch.Generator):
            raise type_error(
                f"a generator state is a torch.Tensor or a torch.Generator, got "
                f"{type(state).__name__}"
            )
        if state.device.type != kind:
            raise value_error(
                f"a generator of {state.device} holds no {kind} state; pass a state of a {kind} "
                "generator"
            )

    def _read_state_size(self) -> int:
        self._state_size = torch.Generator(device=self.device).get_state().numel()
        return self._state_size

    def convert(self, state: object) -> RNGState:
        """A copy of ``state`` (a state tensor or a generator of this device type) in this
        object's form; raises :class:`TrackerDeviceError` if it is neither (a
        :class:`TrackerDeviceTypeError` where torch's own refusal is a TypeError)."""
        if isinstance(state, torch.Tensor):  # any device: from_bytes copies it to the CPU
            try:
                return self.from_bytes(state)
            except (RuntimeError, TypeError) as error:
                refused = (
                    TrackerDeviceTypeError if isinstance(error, TypeError) else TrackerDeviceError
                )
                raise refused(
                    f"the tensor is not a {self.device.type} generator state (dtype "
                    f"{state.dtype}, {state.numel()} elements); pass what get_rng_state() or "
                    f"get_states() of the {self.device.type} device returns"
                ) from None
        self.check(state)  # a generator of this device type, else TrackerDeviceError
        generator = cast(torch.Generator, state)
        return generator.clone_state() if self.generator_states else generator.get_state()


# Process-wide: a DeviceRNG holds nothing but its device's default generator, which torch keeps
# once per process.
_DEVICE_RNGS: dict[tuple[torch.device, bool | None], DeviceRNG] = {}


def device_rng(
    device: torch.device | str | int | None = None, *, generator_states: bool | None = None
) -> DeviceRNG:
    """The cached :class:`DeviceRNG` of ``device`` for the given state form (None or a bool,
    else :class:`~rng_tracker.errors.ArgumentTypeError`)."""
    if generator_states is not None:
        generator_states = checked_flag(generator_states, "generator_states")
    device = normalize_device(device)
    key = (device, generator_states)
    rng = _DEVICE_RNGS.get(key)
    if rng is None:
        rng = _DEVICE_RNGS[key] = DeviceRNG(device, generator_states=generator_states)
    return rng
