"""rng_tracker.kernels: fused, mask-free, layout-invariant dropout.

The mask of element g of the logical tensor is a pure function of (seed, g): each rank
names where its local tensor sits (a :class:`Chunk`, :class:`Region` or :class:`IndexMap`)
and draws exactly its part of the unsharded tensor's mask. The reference definition
(``philox4x32``, ``keep_mask``, ``keep_threshold``, ``keep_scale``) lives in
:mod:`rng_tracker.kernels.philox` and :mod:`rng_tracker.kernels.reference`.
"""

from __future__ import annotations

from rng_tracker._deprecation import deprecated_names, moved_modules

# ops
from rng_tracker.kernels._dispatch import Impl
from rng_tracker.kernels._fused_dropout import bias_dropout_add, dropout

# where the local tensor sits in the logical one
from rng_tracker.kernels._index_map import MAX_LOGICAL_NUMEL, Chunk, IndexMap, Region

# which paths run here
from rng_tracker.errors import CompiledKernelFallbackWarning  # isort: skip
from rng_tracker.kernels._triton_kernel import HAS_TRITON  # isort: skip

__all__ = [
    # ops
    "Impl",
    "bias_dropout_add",
    "dropout",
    # where the local tensor sits in the logical one
    "MAX_LOGICAL_NUMEL",
    "Chunk",
    "IndexMap",
    "Region",
    # which paths run here
    "HAS_TRITON",
    "CompiledKernelFallbackWarning",
]

__getattr__ = deprecated_names(
    __name__,
    {
        "Shard": "rng_tracker.kernels:Chunk",
        "Layout": "rng_tracker.kernels:IndexMap",
        "layout_of": "rng_tracker.kernels._index_map:index_map_of",
        "philox4x32": "rng_tracker.kernels.philox:philox4x32",
        "keep_mask": "rng_tracker.kernels.reference:keep_mask",
        "keep_scale": "rng_tracker.kernels.reference:keep_scale",
        "keep_threshold": "rng_tracker.kernels.reference:keep_threshold",
        "triton_runs_on": "rng_tracker.kernels._triton_kernel:triton_runs_on",
    },
)

# Modules renamed private in 0.2 (their public names are exported above); the old paths import,
# with a warning, until 0.3.
moved_modules(
    __name__,
    {
        "fused_dropout": "_fused_dropout",
        "index_map": "_index_map",
        "ops": "_ops",
        "cpu_compiled": "_cpu_kernel",
        "triton_dropout": "_triton_kernel",
        "rng_source": "_rng_source",
        "keyed_init": "_keyed_fill",
    },
)
