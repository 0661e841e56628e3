"""Route megatron-core's own RNG calls to :mod:`rng_tracker.megatron` with one call.

Megatron-core binds names of ``megatron.core.tensor_parallel.random`` into other modules at
import time (``tensor_parallel/__init__``, ``tensor_parallel.layers``,
``transformer.cuda_graphs``, ...), so replacing the user's own import leaves Megatron's
internal calls on its CUDA tracker. :func:`install` replaces the names in ``random`` itself
and in every already-imported ``megatron*`` module that holds one of ``random``'s original
objects; modules imported later read the replaced names from ``random`` (or from a module
already patched). :func:`uninstall` puts every original back. Beside ``random``'s names,
install puts in place megatron's CPU init helper with experts drawn from the expert-parallel
stream (:func:`expert_forking`), and in invariant mode what ``_megatron_invariant.patches``
swaps.

This module never imports megatron at import time: only :func:`install` does. Nor does it import
:mod:`rng_tracker.megatron`: the facade hands its replacements to :func:`install`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from rng_tracker._streams import EXPERT_PARALLEL_RNG
from rng_tracker._validate import checked_flag
from rng_tracker.errors import MegatronInstallError, MegatronVersionError

# Versions whose tensor_parallel/random.py this was checked against (0.19.0 to 0.19.2 ship
# the same file; tests/test_megatron_core_*.py run 0.19.2's own code).
KNOWN_MEGATRON_CORE_VERSIONS: tuple[str, ...] = ("0.19.0", "0.19.1", "0.19.2")

# Releases whose sharded_state_dict() keys and boxes, init helpers and dropout sites
# install(invariant=True) was checked against (tests/test_megatron_invariant.py runs 0.19.2's):
# the keys decide every parameter's values, so no other release is tried.
KNOWN_KEY_SCHEMES: tuple[str, ...] = ("0.19.2",)

MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"

_LOCK = threading.RLock()
# label -> (Megatron's original object, rng_tracker's replacement), while installed: the names of
# random (replaced_names), megatron's CPU init helper, and in invariant mode the names it swaps.
# Process-wide, under _LOCK: install() patches megatron's modules, which every thread shares.
_SWAPS: dict[str, tuple[Any, Any]] = {}
_STATE: dict[str, Any] = {"invariant": False, "class_patches": []}


# A fork while another thread is inside install()/uninstall() would copy a half-swapped megatron
# and a lock no thread of the child holds: the child would deadlock on it, or later record
# rng_tracker's own objects as megatron's originals. A fork waits for the lock instead, and the
# child starts with a fresh one.
def _before_fork() -> None:
    _LOCK.acquire()


def _after_fork_in_parent() -> None:
    _LOCK.release()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_SWAPS)


def invariant_installed() -> bool:
    """Whether ``install(invariant=True)`` is in effect."""
    return bool(_SWAPS) and _STATE["invariant"]


def _found_version() -> str | None:
    """The installed megatron-core's version without importing megatron, else None."""
    for dist in ("megatron-core", "megatron_core"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _check_version(allow_unknown_version: bool, invariant: bool) -> None:
    version = _found_version()
    if version is None:
        if importlib.util.find_spec("megatron") is None:
            raise MegatronVersionError(
                "rng_tracker.megatron.install(): megatron-core is not installed (no "
                "'megatron' package); install megatron-core "
                f"{' or '.join(KNOWN_MEGATRON_CORE_VERSIONS)}, or use rng_tracker.megatron "
                "directly without install()"
            )
        if invariant:
            raise MegatronVersionError(
                "rng_tracker.megatron.install(invariant=True): the 'megatron' package has no "
                "version record, so its sharded_state_dict() key scheme cannot be checked; "
                f"invariant mode knows megatron-core {', '.join(KNOWN_KEY_SCHEMES)}"
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
    if invariant and release not in KNOWN_KEY_SCHEMES:
        raise MegatronVersionError(
            f"rng_tracker.megatron.install(invariant=True): found megatron-core {version}, whose "
            "sharded_state_dict() key scheme, init helpers and dropout sites invariant mode does "
            f"not know (it knows {', '.join(KNOWN_KEY_SCHEMES)}); keys decide every parameter's "
            "values, so this is refused even with allow_unknown_version=True. Install a known "
            "version, or use install() without invariant=True"
        )


def _import_random() -> ModuleType:
    """megatron's random module; a ``megatron`` package without ``megatron.core`` (another
    project of that name, a broken install) is a :class:`MegatronVersionError`."""
    try:
        return importlib.import_module(MEGATRON_RANDOM)
    except ModuleNotFoundError as missing:
        name = missing.name or ""
        if name == "megatron" or name.startswith("megatron.core"):
            spec = importlib.util.find_spec("megatron")
            where = list(spec.submodule_search_locations or []) if spec else []
            raise MegatronVersionError(
                f"rng_tracker.megatron.install(): the 'megatron' package found at {where} has no "
                f"{name!r}: it is not megatron-core (or a broken install of it); install "
                f"megatron-core {' or '.join(KNOWN_MEGATRON_CORE_VERSIONS)}"
            ) from missing
        raise


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


_SEED_BOUND = 2**63 - 1


def expert_forking(
    original: Callable[..., Any], tracker_of_process: Callable[[], Any]
) -> Callable[..., Any]:
    """megatron-core's CPU init helper ``original`` (``_initialize_affine_weight_cpu``) drawing an
    expert layer's master weight from the expert-parallel stream of ``tracker_of_process()``.

    megatron-core 0.19's helper builds a layer's master weight from the CPU default generator,
    which every expert-parallel rank seeds alike: with ``use_cpu_initialization=True`` the
    experts of EP rank 1 are bitwise copies of EP rank 0's. Its GPU helper forks
    ``expert-parallel-rng`` for experts; this does the same for the CPU master weight (the
    calling layer's ``is_expert`` decides), so no two global experts draw the same values. Dense
    layers draw exactly megatron's values.
    """

    def initialize_affine_weight_cpu(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_locals.get("self")  # the Column/RowParallelLinear being built
        if getattr(caller, "is_expert", False) is not True:
            return original(*args, **kwargs)
        tracker = tracker_of_process()
        with tracker.fork(EXPERT_PARALLEL_RNG):
            if tracker.device.type == "cpu":  # the stream is the CPU generator itself
                return original(*args, **kwargs)
            # the master weight is drawn on the CPU: seed it from the device stream (advancing it)
            seed = int(torch.randint(0, _SEED_BOUND, (1,), device=tracker.device).item())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return original(*args, **kwargs)

    initialize_affine_weight_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    initialize_affine_weight_cpu.__doc__ = original.__doc__
    return initialize_affine_weight_cpu


def replaced_names(random: ModuleType, ours: Mapping[str, Any]) -> list[str]:
    """The names :func:`install` replaces: the functions and classes megatron's ``random``
    defines itself that ``ours`` provides too. Its constants (equal strings), what it imports
    from other modules and its checkpoint classes' internals stay megatron's."""
    return sorted(
        name
        for name, value in vars(random).items()
        if name in ours
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == random.__name__
    )


def _plain_swaps(random: ModuleType, ours: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    swaps = {name: (getattr(random, name), ours[name]) for name in replaced_names(random, ours)}
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    original = layers._initialize_affine_weight_cpu
    swaps["layers._initialize_affine_weight_cpu"] = (
        original,
        expert_forking(original, ours["get_cuda_rng_tracker"]),
    )
    leaked = sorted(
        label
        for label, (orig, _) in swaps.items()
        if str(getattr(orig, "__module__", "")).startswith("rng_tracker")
    )
    if leaked:
        raise MegatronInstallError(
            "rng_tracker.megatron.install(): megatron's modules already hold rng_tracker's "
            f"objects ({leaked}) although nothing is installed in this process; restart "
            "the process (a fork copied a half-installed megatron)"
        )
    return swaps


def install(
    ours: Mapping[str, Any], *, invariant: bool = False, allow_unknown_version: bool = False
) -> None:
    """Replace :func:`replaced_names` of megatron's ``random`` by ``ours`` (the facade's objects
    of those names) in every imported megatron module; see :func:`rng_tracker.megatron.install`,
    which documents the behaviour and calls this."""
    invariant = checked_flag(invariant, "install(invariant=...)")
    allow_unknown_version = checked_flag(
        allow_unknown_version, "install(allow_unknown_version=...)"
    )
    with _LOCK:
        if _SWAPS:
            if _STATE["invariant"] != invariant:
                raise MegatronInstallError(
                    f"rng_tracker.megatron.install(invariant={invariant}): install("
                    f"invariant={_STATE['invariant']}) is in effect; call uninstall() first"
                )
            return
        _check_version(allow_unknown_version, invariant)
        random = _import_random()
        swaps = _plain_swaps(random, ours)
        class_patches = []
        if invariant:
            from rng_tracker._megatron_invariant import keyed_params, patches

            swaps.update(patches.name_swaps())
            class_patches = patches.apply_class_patches()
            keyed_params.set_active(True)
        _swap_everywhere({id(orig): (orig, repl) for orig, repl in swaps.values()})
        _SWAPS.update(swaps)
        _STATE.update(invariant=invariant, class_patches=class_patches)


def uninstall() -> None:
    """Undo :func:`install`: every megatron module attribute that holds a replacement
    (also in modules imported after :func:`install`) gets Megatron's original back, and
    invariant mode's class patches are taken out. Models built in invariant mode keep their
    keyed sites."""
    with _LOCK:
        if not _SWAPS:
            return
        if _STATE["invariant"]:
            from rng_tracker._megatron_invariant import keyed_params, patches

            keyed_params.set_active(False)
            patches.undo_class_patches(_STATE["class_patches"])
        _swap_everywhere({id(repl): (repl, orig) for orig, repl in _SWAPS.values()})
        _SWAPS.clear()
        _STATE.update(invariant=False, class_patches=[])
