"""Access to the default generator of a device, and copies of its state.

This is the only module that knows how each device type stores generator state:
CUDA (graph-safe generator states where torch has them), CPU and any other
``torch.accelerator`` device (state tensors).
"""

from __future__ import annotations

from typing import TypeAlias

import torch

from rng_tracker.errors import TrackerDeviceError

__all__ = [
    "DeviceRNG",
    "RNGState",
    "default_device",
    "default_generator",
    "device_rng",
]

# A saved generator state: a cloned ``torch.Generator`` (CUDA graph-safe path) or a
# uint8 CPU tensor (every other device).
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


def _normalize(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = torch.get_device_module(device.type)
        device = torch.device(device.type, module.current_device())
    if device.type == "cpu":
        device = torch.device("cpu")
    return device


def default_generator(device: torch.device | str | int | None = None) -> torch.Generator:
    """The default generator of ``device`` (the one ``torch.manual_seed`` seeds)."""
    device = _normalize(device)
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

    ``swap_in``/``swap_out`` are the fork fast path: on CUDA with graph-safe states they
    move generator-state *handles* (no copy; each handle is installed in at most one
    place at a time), elsewhere they copy state tensors. ``snapshot``/``restore`` always
    copy, so a snapshot never aliases live state.
    """

    __slots__ = ("device", "generator", "graph_safe")

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = _normalize(device)
        self.generator = default_generator(self.device)
        self.graph_safe = self.device.type == "cuda" and hasattr(
            self.generator, "graphsafe_get_state"
        )

    def _state_of(self, generator: torch.Generator) -> RNGState:
        # The form this device's states take: a graph-safe handle or a uint8 tensor copy.
        return generator.graphsafe_get_state() if self.graph_safe else generator.get_state()

    def live(self) -> RNGState:
        """The state now installed: a handle on the graph-safe path, else a copy."""
        return self._state_of(self.generator)

    def install(self, state: RNGState) -> None:
        """Make ``state`` the generator's state (by handle on the graph-safe path)."""
        if self.graph_safe:
            self.generator.graphsafe_set_state(state)
        else:
            self.generator.set_state(state)

    def snapshot(self) -> RNGState:
        """An independent copy of the current state."""
        if self.graph_safe:
            return self.generator.graphsafe_get_state().clone_state()
        return self.generator.get_state()

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
        generator.set_state(data.to("cpu"))
        return self._state_of(generator)

    def equal(self, a: RNGState, b: RNGState) -> bool:
        """Whether two saved states would draw the same values."""
        return torch.equal(self.to_bytes(a), self.to_bytes(b))


_DEVICE_RNGS: dict[torch.device, DeviceRNG] = {}


def device_rng(device: torch.device | str | int | None = None) -> DeviceRNG:
    """The cached :class:`DeviceRNG` of ``device``."""
    device = _normalize(device)
    rng = _DEVICE_RNGS.get(device)
    if rng is None:
        rng = _DEVICE_RNGS[device] = DeviceRNG(device)
    return rng
