"""rng_tracker.parallel: the process mesh and tensor-parallel building blocks."""

from __future__ import annotations

# mesh.py
from rng_tracker.parallel.mesh import (
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    get_parallel_state_or_none,
    init_model_parallel,
)

__all__ = [
    "ParallelState",
    "destroy_model_parallel",
    "get_parallel_state",
    "get_parallel_state_or_none",
    "init_model_parallel",
]
