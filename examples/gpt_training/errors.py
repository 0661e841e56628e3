"""Typed errors of the training job.

Like the library's, each subclasses :class:`rng_tracker.errors.RNGTrackerError` *and* the
builtin that fits it, so scripts/train.py refuses any of them the same way.
"""

from __future__ import annotations

from rng_tracker.errors import RNGTrackerError

__all__ = [
    "ResumeRefusedError",
    "SaveCommitError",
    "SaveTargetError",
    "TrainArgumentError",
    "TrainingCheckpointError",
]


class TrainingCheckpointError(RNGTrackerError, RuntimeError):
    """A training checkpoint is uncommitted, corrupt, or mixes pieces of different saves."""


class ResumeRefusedError(RNGTrackerError, ValueError):
    """A checkpoint cannot continue this run exactly: another rng mode, seed, batch or layout."""


class TrainArgumentError(RNGTrackerError, ValueError):
    """A training-job setting that cannot run (a size, a count, a path); refused before any work."""


class SaveTargetError(RNGTrackerError, ValueError):
    """A checkpoint target the job cannot write into, or one holding another run's checkpoint."""


class SaveCommitError(TrainingCheckpointError):
    """A checkpoint that could not be committed: the message says that the previous checkpoint
    is kept and where this run's state was written instead."""
