"""Old public names kept for one release: a module ``__getattr__`` that warns and resolves them."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REMOVED_IN", "deprecated_names"]

REMOVED_IN = "0.3"


def deprecated_names(module: str, aliases: Mapping[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` mapping each old name to ``"package.module:new_name"``.

    Accessing an old name warns with :class:`DeprecationWarning` naming its replacement and
    returns the replacement's object; any other missing name raises ``AttributeError`` as usual.
    """

    def __getattr__(name: str) -> Any:
        target = aliases.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new_name = target.partition(":")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in {REMOVED_IN}: "
            f"use {where}.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new_name)

    return __getattr__
