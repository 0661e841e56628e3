"""A record of the random ops a region runs, to prove a recompute drew what the forward did.

Generator states at the end of a region catch most replay bugs; this log catches the
rest: a different sequence of random ops, and draws from explicit ``torch.Generator``
objects that no snapshot covers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rng_tracker._device_rng import device_rng


def _op_device(args: Any, kwargs: dict[str, Any]) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


class RandomOpLog(TorchDispatchMode):
    """Dispatch mode recording each seeded-random op and the state of the generator it draws from."""

    def __init__(self) -> None:
        super().__init__()
        # (op name, "explicit" or the default generator's device, that generator's state)
        self.entries: list[tuple[str, str, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator")
            if generator is not None:
                source, state = "explicit", generator.get_state()
            else:
                rng = device_rng(_op_device(args, kwargs))
                source, state = str(rng.device), rng.to_bytes(rng.snapshot())
            self.entries.append((str(func), source, state.cpu()))
        return func(*args, **kwargs)


def first_divergence(forward: RandomOpLog, recompute: RandomOpLog) -> str | None:
    """A sentence naming where the recompute's random ops left the forward's, or None."""
    for index, (fwd, rec) in enumerate(zip(forward.entries, recompute.entries)):
        if fwd[0] != rec[0]:
            return f"random op #{index} was {fwd[0]} in the forward but {rec[0]} in the recompute"
        if fwd[1] != rec[1] or not torch.equal(fwd[2], rec[2]):
            if "explicit" in (fwd[1], rec[1]):
                return (
                    f"random op #{index} ({fwd[0]}) drew from an explicit torch.Generator outside "
                    "the tracker, which was in another state in the recompute"
                )
            return (
                f"random op #{index} ({fwd[0]}) drew from the default generator of {fwd[1]} in "
                "another state in the recompute (a stream of a tracker this checkpoint does not replay?)"
            )
    if len(forward.entries) != len(recompute.entries):
        return (
            f"the forward ran {len(forward.entries)} random ops but the recompute ran "
            f"{len(recompute.entries)} (random ops under data-dependent control flow?)"
        )
    return None
