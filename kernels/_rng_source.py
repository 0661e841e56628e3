"""The Philox key and counter base of one dropout call, taken from a torch generator.

CUDA generators: key = the seed, counter base = philox offset // 4, and the offset
advances by 4 * ceil(N / 4) for the logical element count N, so no later torch op
reuses these counters. Other generators: key = one 64-bit draw, base = 0. The seed tensor
of a call is [key, base, c2, c3]: counter words 2 and 3 are 0 here.
"""

from __future__ import annotations

import threading

import torch

from rng_tracker.errors import KernelInputError

_MAX_OFFSET = 2**64 - 1  # a CUDA generator's Philox offset is a uint64


def advanced_offset(offset: int, logical_numel: int) -> int:
    """A CUDA generator's Philox offset after a call over ``logical_numel`` elements.

    Refuses (:class:`KernelInputError`, the generator untouched) an advance past 2**64 - 1:
    the offset would wrap and later calls would reuse earlier counters, so earlier masks.
    """
    advanced = offset + 4 * (-(-logical_numel // 4))
    if advanced > _MAX_OFFSET:
        raise KernelInputError(
            f"the generator's Philox offset {offset} cannot advance by {advanced - offset} for "
            f"{logical_numel} logical elements: it would pass 2**64 - 1 and wrap, reusing "
            "earlier masks' counters; reseed the generator (generator.manual_seed(...))"
        )
    return advanced


_SCRATCH = threading.local()  # per thread: a 0-dim int64 tensor the eager draws reuse


def _key_and_base(
    generator: torch.Generator, logical_numel: int, scratch: torch.Tensor | None = None
) -> tuple[int, int]:
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(advanced_offset(offset, logical_numel))
        return generator.initial_seed(), offset // 4
    draw = torch.empty((), dtype=torch.int64) if scratch is None else scratch
    draw.random_(-(2**63), 2**63 - 1, generator=generator)
    return int(draw) & (2**64 - 1), 0


@torch.compiler.disable
def draw_key_and_base(generator: torch.Generator, logical_numel: int) -> tuple[int, int]:
    """Consume the generator's randomness for one call over ``logical_numel`` elements."""
    return _key_and_base(generator, logical_numel)


def drawn_words(generator: torch.Generator, logical_numel: int) -> tuple[int, int, int, int]:
    """The seed words [key, base, 0, 0] (int64 values) of one eager call, drawn as
    :func:`drawn_seed` draws them, with no tensor made (eager callers outside any trace or
    dispatch mode only: the draw reuses a per-thread scratch tensor)."""
    scratch = getattr(_SCRATCH, "tensor", None)
    if scratch is None:
        scratch = _SCRATCH.tensor = torch.empty((), dtype=torch.int64)
    key, base = _key_and_base(generator, logical_numel, scratch)
    return (key - 2**64 if key >= 2**63 else key, base, 0, 0)


def seed_tensor(key: int, base: int, device: torch.device) -> torch.Tensor:
    """[key, base, 0, 0] as an int64 tensor: an op argument, never a constant baked into a graph.

    Counter words 2 and 3 are 0 for generator draws; keyed callers pass their own seed tensor.
    """
    signed_key = key - 2**64 if key >= 2**63 else key
    return torch.tensor([signed_key, base, 0, 0], dtype=torch.int64).to(device, non_blocking=True)


@torch.compiler.disable
def drawn_seed(
    generator: torch.Generator, logical_numel: int, device: torch.device
) -> torch.Tensor:
    """``draw_key_and_base`` then ``seed_tensor``, as one step that torch.compile does not trace.

    The key never becomes a traced Python int (a 64-bit constant Inductor cannot print, and
    a value guard that would recompile every step): the seed enters the graph as a tensor.
    """
    return seed_tensor(*_key_and_base(generator, logical_numel), device)
