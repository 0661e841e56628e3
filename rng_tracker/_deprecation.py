"""Old public names and module paths kept for one release, each resolved with a warning.

``deprecated_names`` is a package ``__getattr__`` for names that moved; ``moved_modules``
registers module paths that were renamed (``rng_tracker.tracker`` became the private
``rng_tracker._tracker``), so ``import rng_tracker.tracker`` and ``from rng_tracker.tracker
import X`` still work, warning, until the release named by :data:`REMOVED_IN`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from rng_tracker.errors import ArgumentConflictError

REMOVED_IN = "0.3"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is on its way out and ``new`` replaces it (one wording everywhere, which
    the test suite turns into an error unless a test expects it)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in {REMOVED_IN}: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keyword(function: str, old: str, new: str, old_value: Any, new_value: Any) -> Any:
    """The value of keyword ``new`` of ``function``, also accepted under its deprecated name
    ``old`` (warning at the caller of ``function``); None when neither was given. Both given is
    an :class:`~rng_tracker.errors.ArgumentConflictError`."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ArgumentConflictError(
            f"{function}() got both {new}= and {old}=, its deprecated name; pass only {new}="
        )
    # 4: warn_deprecated, this function, ``function``, its caller
    warn_deprecated(f"{function}({old}=...)", f"{function}({new}=...)", stacklevel=4)
    return old_value


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands back the module that replaced it, warning."""

    def __init__(self) -> None:
        self.moved: dict[str, str] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        # 4: the importer (warnings skips importlib's own frames)
        _warn_moved(spec.name, stacklevel=4)
        module = importlib.import_module(self.moved[spec.name])
        spec.loader_state = module.__spec__  # the import system is about to overwrite it
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The replacement is already imported; nothing runs. The import system has just given
        it the old name's spec: it gets its own back, so it still names its own file."""
        module.__spec__ = module.__spec__.loader_state


_FINDER = _MovedModules()


def _warn_moved(old: str, *, stacklevel: int = 3) -> None:
    package = old.rpartition(".")[0]
    warn_deprecated(
        f"module {old}",
        f"the names {package} exports (the module is internal now)",
        stacklevel=stacklevel,
    )


def _is_private(path: str) -> bool:
    return any(part.startswith("_") for part in path.split("."))


sys.meta_path.append(_FINDER)


def moved_modules(package: str, moved: Mapping[str, str]) -> None:
    """Register ``package.<old>`` -> ``package.<new>`` for each item of ``moved``."""
    _FINDER.moved.update({f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()})


def deprecated_names(
    module: str, aliases: Mapping[str, str], *, instead: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` mapping each old name to ``"package.module:new_name"``
    (or, for a renamed submodule, to ``"package.new_module"``).

    Accessing an old name warns with :class:`DeprecationWarning` naming its replacement and
    returns the replacement's object; any other missing name raises ``AttributeError`` as usual.
    A replacement in a private module is not one to import: the warning says the name is
    internal now and names ``instead[old]``, the public way to do what it did, or that there is
    none.
    """
    instead = dict(instead or {})

    def __getattr__(name: str) -> Any:
        target = aliases.get(name)
        if target is None:
            old_module = f"{module}.{name}"
            if old_module in _FINDER.moved:
                _warn_moved(old_module, stacklevel=4)
                return importlib.import_module(_FINDER.moved[old_module])
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new_name = target.partition(":")
        if not _is_private(f"{where}.{new_name}"):
            warn_deprecated(f"{module}.{name}", f"{where}.{new_name}")
        else:
            public = f"; use {instead[name]}" if name in instead else ", with no public replacement"
            warnings.warn(
                f"{module}.{name} is deprecated and will be removed in {REMOVED_IN}: it is "
                f"internal now{public}",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(importlib.import_module(where), new_name)

    return __getattr__
