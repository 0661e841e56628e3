"""rng_tracker: correct randomness for model-parallel PyTorch training.

Named, forkable RNG streams per device; collision-free seeds for tensor, pipeline,
data, expert and context parallel ranks; activation checkpointing that replays every
stream; and (in :mod:`rng_tracker.kernels`) mask-free fused dropout.
"""

from __future__ import annotations

# device_rng.py
from rng_tracker.device_rng import (
    DeviceRNG,
    RNGState,
    default_device,
    default_generator,
    device_rng,
)

# errors.py
from rng_tracker.errors import (
    CheckpointConfigError,
    CheckpointRNGMismatchError,
    CheckpointUsageError,
    DuplicateStreamError,
    InvalidSeedError,
    InvalidSeedTypeError,
    KernelInputError,
    KernelInputTypeError,
    ParallelConfigError,
    ParallelStateError,
    RankError,
    RNGConsistencyError,
    RNGTrackerError,
    SeedReuseError,
    SeedSchemeError,
    StateDictError,
    StreamNameError,
    TrackerBusyError,
    TrackerDeviceError,
    UnknownStreamError,
)

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
    "CheckpointUsageError",
    "DeviceRNG",
    "DuplicateStreamError",
    "InvalidSeedError",
    "InvalidSeedTypeError",
    "KernelInputError",
    "KernelInputTypeError",
    "ParallelConfigError",
    "ParallelStateError",
    "RNGConsistencyError",
    "RNGState",
    "RNGStatesTracker",
    "RNGTrackerError",
    "RankError",
    "SeedPlan",
    "SeedReuseError",
    "SeedSchemeError",
    "StateDictError",
    "StreamNameError",
    "TrackerBusyError",
    "TrackerDeviceError",
    "UnknownStreamError",
    "default_device",
    "default_generator",
    "device_rng",
    "get_rng_tracker",
    "model_parallel_seed",
    "plan_seeds",
]
