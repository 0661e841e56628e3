"""rng_tracker.parallel: the process mesh, tensor-parallel layers, the reference transformer
and the cross-rank RNG verifier.

The end-to-end training job (trainer, corpus, pipeline split, DCP checkpoints) lives apart in
``examples/gpt_training/``: it serves scripts/train.py and is not part of this package.

The mesh and collectives import eagerly; the layers, model and verifier load on first use
(they pull in rng_tracker.kernels and so Triton, which the mesh alone does not need).
"""

from __future__ import annotations

import importlib
from typing import Any

# collectives.py
from rng_tracker.parallel.collectives import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)

# mesh.py
from rng_tracker.parallel.mesh import (
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    get_parallel_state_or_none,
    init_model_parallel,
)

_LAZY = {
    # layers.py
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    # transformer.py
    "GPTConfig": "transformer",
    "ParallelTransformerLayer": "transformer",
    "TinyGPT": "transformer",
    "record_masks": "transformer",
    # verify.py
    "RNGReport": "verify",
    "verify_rng_consistency": "verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"rng_tracker.parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rng_tracker.parallel' has no attribute {name!r}")


__all__ = [
    "ColumnParallelLinear",
    "GPTConfig",
    "ParallelState",
    "ParallelTransformerLayer",
    "RNGReport",
    "RowParallelLinear",
    "TinyGPT",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "destroy_model_parallel",
    "gather_from_sp",
    "gather_from_tp",
    "get_parallel_state",
    "get_parallel_state_or_none",
    "init_model_parallel",
    "record_masks",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_tp",
    "verify_rng_consistency",
]
