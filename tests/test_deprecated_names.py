"""Names renamed in 0.2 still resolve for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import pytest

import rng_tracker.kernels as kernels
from rng_tracker.kernels import _triton_kernel, philox, reference
from rng_tracker.kernels._index_map import index_map_of

RENAMED = {
    "Shard": (kernels.Chunk, "rng_tracker.kernels.Chunk"),
    "Layout": (kernels.IndexMap, "rng_tracker.kernels.IndexMap"),
    "layout_of": (index_map_of, "rng_tracker.kernels._index_map.index_map_of"),
    "philox4x32": (philox.philox4x32, "rng_tracker.kernels.philox.philox4x32"),
    "keep_mask": (reference.keep_mask, "rng_tracker.kernels.reference.keep_mask"),
    "keep_scale": (reference.keep_scale, "rng_tracker.kernels.reference.keep_scale"),
    "keep_threshold": (reference.keep_threshold, "rng_tracker.kernels.reference.keep_threshold"),
    "triton_runs_on": (
        _triton_kernel.triton_runs_on,
        "rng_tracker.kernels._triton_kernel.triton_runs_on",
    ),
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
        ("rng_tracker", "DeviceRNG", "rng_tracker._device_rng"),
        ("rng_tracker", "default_generator", "rng_tracker._device_rng"),
        ("rng_tracker", "CPURNGChangedWarning", "rng_tracker._tracker"),
        ("rng_tracker.parallel", "TinyGPT", "rng_tracker.parallel.transformer"),
        ("rng_tracker.parallel", "GPTConfig", "rng_tracker.parallel.transformer"),
        ("rng_tracker.parallel", "record_masks", "rng_tracker.parallel.sites"),
        ("rng_tracker.parallel", "get_parallel_state_or_none", "rng_tracker.parallel._mesh"),
    ],
)
def test_names_that_left_a_package_namespace_still_resolve(
    package: str, old: str, module: str
) -> None:
    import importlib

    namespace = importlib.import_module(package)
    with pytest.warns(
        DeprecationWarning, match=rf"{package}\.{old} is deprecated.*{module}\.{old}"
    ):
        got = getattr(namespace, old)
    assert got is getattr(importlib.import_module(module), old)
    assert old not in namespace.__all__
