"""A dispatch mode that records the operators run inside it, for tests that assert which
kernels a call reached."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """The names of the operators dispatched inside the mode, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
