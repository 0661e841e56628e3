"""rng_tracker.parallel: the process mesh, tensor-parallel layers and collectives, and the
cross-rank RNG verifier.

Beside this API: :mod:`rng_tracker.parallel.sites` (which randomness a dropout site draws, for
TinyGPT and users' models alike), :mod:`rng_tracker.parallel.dtensor` (layout-invariant random
ops on DTensors), :mod:`rng_tracker.parallel.invariant` (``invariant_random()``: torch's own
dropout and init calls routed to them), :mod:`rng_tracker.parallel.keyed_init` (init keyed by
parameter name and element index), :mod:`rng_tracker.parallel.testing` (the distributed test
harness) and :mod:`rng_tracker.parallel.transformer` (the reference model, ``TinyGPT``, which the
tests, docs and the training example in ``examples/gpt_training/`` build on). None of this
module imports :mod:`rng_tracker.kernels` (and so Triton); the others do.
"""

from __future__ import annotations

from rng_tracker._deprecation import deprecated_names, moved_modules

# the mesh
from rng_tracker.parallel._mesh import (
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    init_model_parallel,
)

# tensor-parallel layers
from rng_tracker.parallel._layers import (  # isort: skip
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

# collectives (Megatron's mappings, differentiable)
from rng_tracker.parallel._tp_mappings import (  # isort: skip
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)

# cross-rank RNG verification
from rng_tracker.parallel._verify import RNGReport, verify_rng_consistency  # isort: skip

__all__ = [
    # the mesh
    "init_model_parallel",
    "ParallelState",
    "get_parallel_state",
    "destroy_model_parallel",
    # tensor-parallel layers
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    # collectives
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    # cross-rank RNG verification
    "verify_rng_consistency",
    "RNGReport",
]

# Names of 0.1 that live in their modules now; they resolve, with a warning, until 0.3.
__getattr__ = deprecated_names(
    __name__,
    {
        "GPTConfig": "rng_tracker.parallel.transformer:GPTConfig",
        "ParallelTransformerLayer": "rng_tracker.parallel.transformer:ParallelTransformerLayer",
        "TinyGPT": "rng_tracker.parallel.transformer:TinyGPT",
        "record_masks": "rng_tracker.parallel.sites:record_masks",
        "get_parallel_state_or_none": "rng_tracker.parallel._mesh:get_parallel_state_or_none",
    },
    instead={
        "get_parallel_state_or_none": (
            "rng_tracker.parallel.get_parallel_state(), which raises ParallelStateError "
            "before init_model_parallel()"
        )
    },
)

# Modules renamed private in 0.2 (their public names are exported above); the old paths import,
# with a warning, until 0.3.
moved_modules(
    __name__,
    {
        "mesh": "_mesh",
        "layers": "_layers",
        "collectives": "_tp_mappings",
        "verify": "_verify",
    },
)
