"""Route megatron-core's own RNG calls to :mod:`rng_tracker.megatron` with one call.

Megatron-core binds names of ``megatron.core.tensor_parallel.random`` into other modules at
import time (``tensor_parallel/__init__``, ``tensor_parallel.layers``,
``transformer.cuda_graphs``, ...), so replacing the user's own import leaves Megatron's
internal calls on its CUDA tracker. :func:`install` replaces the names in ``random`` itself
and in every already-imported ``megatron*`` module that holds one of ``random``'s original
objects; modules imported later read the replaced names from ``random`` (or from a module
already patched). :func:`uninstall` puts every original back.

This module never imports megatron at import time: only :func:`install` does.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

from rng_tracker.errors import MegatronVersionError

__all__ = [
    "KNOWN_MEGATRON_CORE_VERSIONS",
    "MEGATRON_RANDOM",
    "REPLACED_NAMES",
    "install",
    "installed",
    "uninstall",
]

# Versions whose tensor_parallel/random.py this was checked against (0.19.0 to 0.19.2 ship
# the same file; tests/test_megatron_core_*.py run 0.19.2's own code).
KNOWN_MEGATRON_CORE_VERSIONS: tuple[str, ...] = ("0.19.0", "0.19.1", "0.19.2")

MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"

# The names of Megatron's random module that rng_tracker.megatron provides with Megatron's
# signatures. Megatron's module-level constants (equal strings) and its checkpoint classes'
# internals (CheckpointWithoutOutputFunction, _set_checkpointing, ...) stay Megatron's.
REPLACED_NAMES: tuple[str, ...] = (
    "CheckpointFunction",
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "_fork_rng",
    "_get_all_rng_states",
    "_get_cuda_rng_state",
    "_set_all_rng_states",
    "_set_cuda_rng_state",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_gtp_remat_rng_tracker_name",
    "initialize_rng_tracker",
    "is_checkpointing",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
)

_LOCK = threading.RLock()
# name -> (Megatron's original object, rng_tracker's replacement), while installed.
_SWAPS: dict[str, tuple[Any, Any]] = {}


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_SWAPS)


def _found_version() -> str | None:
    """The installed megatron-core's version without importing megatron, else None."""
    for dist in ("megatron-core", "megatron_core"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _check_version(allow_unknown_version: bool) -> None:
    version = _found_version()
    if version is None:
        if importlib.util.find_spec("megatron") is None:
            raise MegatronVersionError(
                "rng_tracker.megatron.install(): megatron-core is not installed (no "
                "'megatron' package); install megatron-core "
                f"{' or '.join(KNOWN_MEGATRON_CORE_VERSIONS)}, or use rng_tracker.megatron "
                "directly without install()"
            )
        return  # a source checkout on sys.path without metadata: nothing to compare
    release = version.split("+")[0]
    if release not in KNOWN_MEGATRON_CORE_VERSIONS and not allow_unknown_version:
        raise MegatronVersionError(
            f"rng_tracker.megatron.install(): found megatron-core {version}, but only "
            f"{', '.join(KNOWN_MEGATRON_CORE_VERSIONS)} are known to route every RNG call; "
            "install a known version, or pass allow_unknown_version=True to try this one "
            "(then check with bash scripts/test.sh tests/test_megatron_core_model.py)"
        )


def _megatron_modules() -> list[ModuleType]:
    """Every imported ``megatron*`` module (megatron and megatron_fsdp packages)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("megatron") and isinstance(module, ModuleType)
    ]


def _swap_everywhere(table: dict[int, Any]) -> None:
    """In every megatron module, replace each attribute that *is* a key object of ``table``
    (compared by identity) by its value."""
    for module in _megatron_modules():
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for attr, value in list(namespace.items()):
            replacement = table.get(id(value))
            if replacement is not None and replacement[0] is value:
                setattr(module, attr, replacement[1])


def install(*, allow_unknown_version: bool = False) -> None:
    """Make megatron-core's own code use :mod:`rng_tracker.megatron` on any device.

    Imports ``megatron.core.tensor_parallel.random`` and replaces :data:`REPLACED_NAMES` in it
    and in every imported megatron module bound to the same objects. Modules imported
    afterwards bind the replacements. Calling it again does nothing; :func:`uninstall` undoes
    it. Raises :class:`~rng_tracker.errors.MegatronVersionError` (changing nothing) when
    megatron-core is missing or of a version not in :data:`KNOWN_MEGATRON_CORE_VERSIONS`.
    """
    with _LOCK:
        if _SWAPS:
            return
        _check_version(allow_unknown_version)
        random = importlib.import_module(MEGATRON_RANDOM)
        from rng_tracker import megatron as ours

        swaps = {
            name: (getattr(random, name), getattr(ours, name))
            for name in REPLACED_NAMES
            if hasattr(random, name)
        }
        _swap_everywhere({id(orig): (orig, repl) for orig, repl in swaps.values()})
        _SWAPS.update(swaps)


def uninstall() -> None:
    """Undo :func:`install`: every megatron module attribute that holds a replacement
    (also in modules imported after :func:`install`) gets Megatron's original back."""
    with _LOCK:
        if not _SWAPS:
            return
        _swap_everywhere({id(repl): (repl, orig) for orig, repl in _SWAPS.values()})
        _SWAPS.clear()
