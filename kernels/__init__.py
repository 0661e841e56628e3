"""rng_tracker.kernels: Philox4x32 reference and fused, mask-free, layout-invariant dropout."""

from __future__ import annotations

# cpu_compiled.py
from rng_tracker.kernels.cpu_compiled import CompiledKernelFallbackWarning

# dropout.py
from rng_tracker.kernels.dropout import Impl, bias_dropout_add, dropout

# philox.py
from rng_tracker.kernels.philox import philox4x32

# reference.py
from rng_tracker.kernels.reference import keep_mask, keep_scale, keep_threshold

# shard.py
from rng_tracker.kernels.shard import MAX_LOGICAL_NUMEL, Layout, Region, Shard, layout_of

# triton_dropout.py
from rng_tracker.kernels.triton_dropout import HAS_TRITON, triton_runs_on

__all__ = [
    "HAS_TRITON",
    "MAX_LOGICAL_NUMEL",
    "CompiledKernelFallbackWarning",
    "Impl",
    "Layout",
    "Region",
    "Shard",
    "bias_dropout_add",
    "dropout",
    "keep_mask",
    "keep_scale",
    "keep_threshold",
    "layout_of",
    "philox4x32",
    "triton_runs_on",
]
