"""rng_tracker: correct randomness for model-parallel PyTorch training.

Named, forkable RNG streams per device; collision-free seeds for tensor, pipeline,
data, expert and context parallel ranks; activation checkpointing that replays every
stream; and (in :mod:`rng_tracker.kernels`) mask-free fused dropout.
"""

from __future__ import annotations

# checkpoint.py
from rng_tracker.activation_checkpoint import checkpoint, rng_context_fn

# checkpoint_without_output.py
from rng_tracker.checkpoint_without_output import CheckpointWithoutOutput

# device_rng.py
from rng_tracker.device_rng import (
    DeviceRNG,
    RNGState,
    default_device,
    default_generator,
    device_rng,
)

# errors.py
from rng_tracker.errors import (  # keyed.py's errors
    CheckpointConfigError,
    CheckpointRNGMismatchError,
    CheckpointTypeError,
    CheckpointUsageError,
    DuplicateStreamError,
    InvalidSeedError,
    InvalidSeedTypeError,
    KernelInputError,
    KernelInputTypeError,
    KernelUnavailableError,
    KeyedTypeError,
    KeyedUnseededError,
    ParallelConfigError,
    ParallelStateError,
    RankError,
    RNGConsistencyError,
    RNGTrackerError,
    SeedReuseError,
    SeedSchemeError,
    SiteCollisionError,
    SiteIdError,
    StateDictError,
    StepRangeError,
    StreamNameError,
    TrackerBusyError,
    TrackerDeviceError,
    TrackerNotInitializedError,
    UnknownSiteError,
    UnknownStreamError,
)

# keyed.py
from rng_tracker.keyed import KeyedRNG, get_keyed_rng

# rng_snapshot.py
from rng_tracker.rng_snapshot import RNGSnapshot

# seeds.py
from rng_tracker.seeds import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    SeedPlan,
    model_parallel_seed,
    plan_seeds,
)

# tracker.py
from rng_tracker.tracker import (
    MODEL_PARALLEL_RNG,
    CPURNGChangedWarning,
    RNGStatesTracker,
    get_rng_tracker,
)

__version__ = "0.1.0"

__all__ = [
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "CPURNGChangedWarning",
    "CheckpointConfigError",
    "CheckpointRNGMismatchError",
    "CheckpointTypeError",
    "CheckpointUsageError",
    "CheckpointWithoutOutput",
    "DeviceRNG",
    "DuplicateStreamError",
    "InvalidSeedError",
    "InvalidSeedTypeError",
    "KernelInputError",
    "KernelInputTypeError",
    "KernelUnavailableError",
    "KeyedRNG",
    "KeyedTypeError",
    "KeyedUnseededError",
    "ParallelConfigError",
    "ParallelStateError",
    "RNGConsistencyError",
    "RNGSnapshot",
    "RNGState",
    "RNGStatesTracker",
    "RNGTrackerError",
    "RankError",
    "SeedPlan",
    "SeedReuseError",
    "SeedSchemeError",
    "SiteCollisionError",
    "SiteIdError",
    "StateDictError",
    "StepRangeError",
    "StreamNameError",
    "TrackerBusyError",
    "TrackerDeviceError",
    "TrackerNotInitializedError",
    "UnknownSiteError",
    "UnknownStreamError",
    "checkpoint",
    "default_device",
    "default_generator",
    "device_rng",
    "get_keyed_rng",
    "get_rng_tracker",
    "model_parallel_seed",
    "plan_seeds",
    "rng_context_fn",
]
