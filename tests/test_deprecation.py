"""rng_tracker._deprecation: names and module paths renamed in 0.2 still resolve for one release,
with a DeprecationWarning naming the new one; one that became internal names no private path,
only the public way to do what it did (or says there is none)."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

import rng_tracker.kernels as kernels
from rng_tracker.kernels import philox, reference

# a path with a private part: rng_tracker._x, rng_tracker.kernels._y.z, ...
_PRIVATE_PATH = re.compile(r"rng_tracker(\.\w+)*\._\w+")

RENAMED = {
    "Shard": (kernels.Chunk, "rng_tracker.kernels.Chunk"),
    "Layout": (kernels.IndexMap, "rng_tracker.kernels.IndexMap"),
    "philox4x32": (philox.philox4x32, "rng_tracker.kernels.philox.philox4x32"),
    "keep_mask": (reference.keep_mask, "rng_tracker.kernels.reference.keep_mask"),
    "keep_scale": (reference.keep_scale, "rng_tracker.kernels.reference.keep_scale"),
    "keep_threshold": (reference.keep_threshold, "rng_tracker.kernels.reference.keep_threshold"),
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_kernel_name_warns_and_is_the_new_object(old: str) -> None:
    new, path = RENAMED[old]
    with pytest.warns(
        DeprecationWarning, match=rf"rng_tracker\.kernels\.{old} is deprecated.*{path}"
    ):
        got = getattr(kernels, old)
    assert got is new
    assert old not in kernels.__all__


def test_old_chunk_name_builds_the_same_index_map() -> None:
    with pytest.warns(DeprecationWarning):
        old = kernels.Shard(0, 1, 2, extent=4)
    assert old == kernels.Chunk(0, 1, 2, extent=4)


def test_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        kernels.Nope  # noqa: B018


@pytest.mark.parametrize(
    ("package", "old", "module"),
    [
        ("rng_tracker", "DuplicateStreamError", "rng_tracker.errors"),
        ("rng_tracker", "KernelInputError", "rng_tracker.errors"),
        ("rng_tracker", "CPURNGChangedWarning", "rng_tracker.errors"),
        ("rng_tracker.parallel", "TinyGPT", "rng_tracker.parallel.transformer"),
        ("rng_tracker.parallel", "GPTConfig", "rng_tracker.parallel.transformer"),
        ("rng_tracker.parallel", "record_masks", "rng_tracker.parallel.sites"),
        *(
            ("rng_tracker.parallel.dtensor", name, "rng_tracker.parallel.invariant")
            for name in (
                "invariant_random",
                "enable_invariant_random",
                "disable_invariant_random",
                "InitMode",
            )
        ),
        *(  # 0.1's README listed them with dtensor's invariant mode
            ("rng_tracker.parallel.dtensor", name, "rng_tracker.errors")
            for name in ("InvariantRandomConfigError", "InvariantRandomUnsupportedError")
        ),
        *(
            ("rng_tracker.parallel.transformer", name, "rng_tracker.parallel.sites")
            for name in ("MaskRecord", "batch_position", "place_masks", "record_masks")
        ),
    ],
)
def test_names_that_left_a_package_namespace_still_resolve(
    package: str, old: str, module: str
) -> None:
    """Also the modules that moved out of one (dtensor's invariant mode to invariant, the
    transformer's mask records to sites): the old path is the same object, warning."""
    namespace = importlib.import_module(package)
    with pytest.warns(
        DeprecationWarning, match=rf"{package}\.{old} is deprecated.*{module}\.{old}"
    ):
        got = getattr(namespace, old)
    new_home = importlib.import_module(module)
    assert got is getattr(new_home, old)
    assert old not in namespace.__all__ and old in new_home.__all__
    with pytest.warns(DeprecationWarning):  # `from package import old` takes the same path
        exec(f"from {package} import {old}", {})


@pytest.mark.parametrize(
    ("package", "old", "internal", "public"),
    [
        ("rng_tracker", "DeviceRNG", "rng_tracker._device_rng", "get_rng_tracker(device)"),
        ("rng_tracker", "RNGState", "rng_tracker._device_rng", "torch.Generator | torch.Tensor"),
        ("rng_tracker", "default_device", "rng_tracker._device_rng", "torch.accelerator"),
        ("rng_tracker", "default_generator", "rng_tracker._device_rng", "get_rng_tracker"),
        ("rng_tracker", "device_rng", "rng_tracker._device_rng", "get_rng_tracker(device)"),
        ("rng_tracker.kernels", "layout_of", "rng_tracker.kernels._index_map", None),
        ("rng_tracker.kernels", "triton_runs_on", "rng_tracker.kernels._triton_kernel", None),
        ("rng_tracker.parallel", "get_parallel_state_or_none", "rng_tracker.parallel._mesh", None),
        (
            "rng_tracker.activation_checkpoint",
            "check_split_input",
            "rng_tracker._saved_inputs",
            "checkpoint(..., distribute_saved_activations=True)",
        ),
        (
            "rng_tracker.activation_checkpoint",
            "resolve_trackers",
            "rng_tracker._recompute",
            "checkpoint(..., tracker=...)",
        ),
    ],
)
def test_a_name_that_became_internal_warns_without_a_private_path(
    package: str, old: str, internal: str, public: str | None
) -> None:
    """The old name still resolves to the internal object, but the warning never tells a user
    to import a private path: it says the name is internal and gives the public alternative
    where there is one (else that there is none)."""
    namespace = importlib.import_module(package)
    with pytest.warns(DeprecationWarning) as caught:
        got = getattr(namespace, old)
    assert got is getattr(
        importlib.import_module(internal), old.replace("layout_of", "index_map_of")
    )
    message = str(caught[0].message)
    assert message.startswith(f"{package}.{old} is deprecated and will be removed in 0.3")
    assert "internal now" in message, message
    assert not _PRIVATE_PATH.search(message), message
    if public is not None:
        assert f"use {public}" in message, message


def test_a_module_path_that_became_private_still_imports_and_names_no_private_path() -> None:
    """Every registered old module path (rng_tracker.tracker, rng_tracker.kernels.fused_dropout,
    ...) imports as its private replacement, with a warning that names no private path."""
    from rng_tracker._deprecation import _FINDER

    assert "rng_tracker.tracker" in _FINDER.moved
    for old, new in sorted(_FINDER.moved.items()):
        # The import enters the old path in sys.modules and binds the module onto its package:
        # both are put back as they were, since `rng_tracker.device_rng` is also a deprecated
        # function's name (that name's test, run after this one, found the module and no
        # warning) and a later import of the old path must still warn (the docs' path check).
        imported = sys.modules.pop(old, sys.modules)  # sys.modules itself: it was not there
        parent, _, child = old.rpartition(".")
        package = vars(importlib.import_module(parent))
        held = package.get(child, package)  # the package's dict itself: nothing was there
        try:
            with pytest.warns(DeprecationWarning) as caught:
                module = importlib.import_module(old)
        finally:
            if imported is sys.modules:
                sys.modules.pop(old, None)
            else:
                sys.modules[old] = imported
            if held is package:
                package.pop(child, None)
            else:
                package[child] = held
        assert module is importlib.import_module(new)
        # the import system gave the module the old name's spec: a reload or a tool reading
        # __spec__ found no file (and the order-dependent import-cycle test failed on it)
        assert module.__spec__.name == new and module.__spec__.origin.endswith(".py")
        message = str(caught[0].message)
        assert f"module {old} is deprecated" in message and "internal now" in message, message
        assert not _PRIVATE_PATH.search(message), message
