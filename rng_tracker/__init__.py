"""rng_tracker: correct randomness for model-parallel PyTorch training.

Named, forkable RNG streams per device; collision-free seeds for tensor, pipeline,
data, expert and context parallel ranks; activation checkpointing that replays every
stream; and (in :mod:`rng_tracker.kernels`) mask-free fused dropout.

Every error is in :mod:`rng_tracker.errors` (each an :class:`RNGTrackerError` and the
matching builtin); the ones a training script catches are re-exported here.
"""

from __future__ import annotations

from rng_tracker._deprecation import deprecated_names, moved_modules

# streams
from rng_tracker._tracker import RNGStatesTracker, get_rng_tracker

from rng_tracker._streams import (  # isort: skip
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
)

# seeding
from rng_tracker._seeds import SeedPlan, model_parallel_seed, plan_seeds  # isort: skip
from rng_tracker._layout import ParallelLayout  # isort: skip

# keyed randomness
from rng_tracker._keyed import KeyedRNG, get_keyed_rng  # isort: skip
from rng_tracker._batch_position import batch_position  # isort: skip

# activation checkpointing
from rng_tracker.activation_checkpoint import checkpoint, rng_context_fn  # isort: skip
from rng_tracker.checkpoint_without_output import CheckpointWithoutOutput  # isort: skip
from rng_tracker._rng_snapshot import RNGSnapshot  # isort: skip

# errors a training script catches
from rng_tracker.errors import (  # isort: skip
    CheckpointRNGMismatchError,
    ParallelStateError,
    RNGConsistencyError,
    RNGTrackerError,
    SeedReuseError,
    UnknownStreamError,
)

__version__ = "0.2.0"

__all__ = [
    # streams
    "RNGStatesTracker",
    "get_rng_tracker",
    "MODEL_PARALLEL_RNG",
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    # seeding
    "model_parallel_seed",
    "plan_seeds",
    "SeedPlan",
    "ParallelLayout",
    # keyed randomness
    "KeyedRNG",
    "get_keyed_rng",
    "batch_position",
    # activation checkpointing
    "checkpoint",
    "rng_context_fn",
    "CheckpointWithoutOutput",
    "RNGSnapshot",
    # errors a training script catches
    "RNGTrackerError",
    "UnknownStreamError",
    "SeedReuseError",
    "ParallelStateError",
    "CheckpointRNGMismatchError",
    "RNGConsistencyError",
]

# Top-level names of 0.1 that moved to their modules; they resolve, with a warning, until 0.3.
__getattr__ = deprecated_names(
    __name__,
    {
        "CPURNGChangedWarning": "rng_tracker.errors:CPURNGChangedWarning",
        "CheckpointConfigError": "rng_tracker.errors:CheckpointConfigError",
        "CheckpointTypeError": "rng_tracker.errors:CheckpointTypeError",
        "CheckpointUsageError": "rng_tracker.errors:CheckpointUsageError",
        "DeviceRNG": "rng_tracker._device_rng:DeviceRNG",
        "DuplicateStreamError": "rng_tracker.errors:DuplicateStreamError",
        "InvalidSeedError": "rng_tracker.errors:InvalidSeedError",
        "InvalidSeedTypeError": "rng_tracker.errors:InvalidSeedTypeError",
        "KernelInputError": "rng_tracker.errors:KernelInputError",
        "KernelInputTypeError": "rng_tracker.errors:KernelInputTypeError",
        "KernelUnavailableError": "rng_tracker.errors:KernelUnavailableError",
        "KeyedTypeError": "rng_tracker.errors:KeyedTypeError",
        "KeyedUnseededError": "rng_tracker.errors:KeyedUnseededError",
        "ParallelConfigError": "rng_tracker.errors:ParallelConfigError",
        "RNGState": "rng_tracker._device_rng:RNGState",
        "RankError": "rng_tracker.errors:RankError",
        "SeedSchemeError": "rng_tracker.errors:SeedSchemeError",
        "SiteCollisionError": "rng_tracker.errors:SiteCollisionError",
        "SiteIdError": "rng_tracker.errors:SiteIdError",
        "StateDictError": "rng_tracker.errors:StateDictError",
        "StepRangeError": "rng_tracker.errors:StepRangeError",
        "StreamNameError": "rng_tracker.errors:StreamNameError",
        "TrackerBusyError": "rng_tracker.errors:TrackerBusyError",
        "TrackerDeviceError": "rng_tracker.errors:TrackerDeviceError",
        "TrackerNotInitializedError": "rng_tracker.errors:TrackerNotInitializedError",
        "UnknownSiteError": "rng_tracker.errors:UnknownSiteError",
        "default_device": "rng_tracker._device_rng:default_device",
        "default_generator": "rng_tracker._device_rng:default_generator",
        "device_rng": "rng_tracker._device_rng:device_rng",
    },
    # the public way to do what the internal ones did
    instead={
        "DeviceRNG": "get_rng_tracker(device).generator, or RNGSnapshot for copies of states",
        "RNGState": "torch.Generator | torch.Tensor, what a saved generator state is",
        "default_device": "torch.accelerator.current_accelerator() (None: the CPU)",
        "default_generator": "get_rng_tracker(device).generator",
        "device_rng": "get_rng_tracker(device).generator, or RNGSnapshot for copies of states",
    },
)

# Modules renamed private in 0.2 (their public names are exported above); the old paths import,
# with a warning, until 0.3.
moved_modules(
    __name__,
    {
        "tracker": "_tracker",
        "seeds": "_seeds",
        "keyed": "_keyed",
        "device_rng": "_device_rng",
        "rng_snapshot": "_rng_snapshot",
        "saved_inputs": "_saved_inputs",
        "random_op_log": "_random_op_log",
    },
)
