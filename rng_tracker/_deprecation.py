"""Old public names kept for one release: a module ``__getattr__`` that warns and resolves them."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REMOVED_IN", "deprecated_names", "warn_deprecated"]

REMOVED_IN = "0.3"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is on its way out and ``new`` replaces it (one wording everywhere, which
    the test suite turns into an error unless a test expects it)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


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
        warn_deprecated(f"{module}.{name}", f"{where}.{new_name}")
        return getattr(importlib.import_module(where), new_name)

    return __getattr__
