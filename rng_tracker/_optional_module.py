"""An optional framework's module, found only if some code imported it, and safe to trace.

rng_tracker imports neither Megatron nor accelerate; it asks whether the process did. Traced by
torch.compile, a plain ``sys.modules.get`` makes Dynamo guard on the number of imported modules,
so every later import (a fresh process's first backward, an optimizer, a checkpoint save)
compiled the caller's graph again. Here the look runs while Dynamo traces, not traced, and the
graph guards on the module found instead.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from rng_tracker._torch_private import run_while_tracing


class OptionalModule:
    """``sys.modules[name]`` if some code imported it, else None; never imports it.

    Under torch.compile the answer is the module found while tracing or by the last eager look:
    a module imported after a graph was compiled is seen by that graph once an eager call looks
    again (its guard on the module found then fails, and the graph compiles once more)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.found: ModuleType | None = None

        def look_while_tracing() -> bool:  # its own function: Dynamo calls it with no arguments
            self.found = sys.modules.get(name)
            return True

        self._look_while_tracing = run_while_tracing(look_while_tracing)

    def __call__(self) -> ModuleType | None:
        if torch.compiler.is_compiling():
            self._look_while_tracing()
            return self.found
        self.found = sys.modules.get(self.name)
        return self.found
