"""Typed errors of rng_tracker.

Every error subclasses :class:`RNGTrackerError` *and* the builtin that fits it, so
callers can catch either the library's family or the ordinary Python category.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CheckpointConfigError",
    "CheckpointRNGMismatchError",
    "CheckpointTypeError",
    "CheckpointUsageError",
    "DTensorInputTypeError",
    "DTensorPlacementError",
    "DuplicateStreamError",
    "InvalidSeedError",
    "InvalidSeedTypeError",
    "InvariantRandomModeError",
    "KernelInputError",
    "KernelInputTypeError",
    "KernelInPlaceError",
    "KernelUnavailableError",
    "KeyedExportError",
    "KeyedTypeError",
    "KeyedUnseededError",
    "ParallelConfigError",
    "ParallelStateError",
    "RNGConsistencyError",
    "RNGTrackerError",
    "RankError",
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
]


class RNGTrackerError(Exception):
    """Base class of every error raised by rng_tracker."""


class DuplicateStreamError(RNGTrackerError, KeyError):
    """A stream with that name is already registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownStreamError(RNGTrackerError, KeyError):
    """No stream with that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SeedReuseError(RNGTrackerError, ValueError):
    """Two streams would start from the same seed, so they would draw identical values."""


class InvalidSeedError(RNGTrackerError, ValueError):
    """A seed outside [0, 2**64)."""


class InvalidSeedTypeError(InvalidSeedError, TypeError):
    """A seed that is not an int (bools and floats are refused); also an :class:`InvalidSeedError`."""


class StreamNameError(RNGTrackerError, TypeError):
    """A stream name that is not a non-empty str."""


class TrackerBusyError(RNGTrackerError, RuntimeError):
    """An operation that needs no fork open was called inside a fork."""


class SeedSchemeError(RNGTrackerError, ValueError):
    """An unknown seed scheme name."""


class RankError(RNGTrackerError, ValueError):
    """A parallel rank that is negative, not an int, or too large for the seed scheme."""


class StateDictError(RNGTrackerError, ValueError):
    """A tracker state dict of an unknown version, another device type or a bad shape."""


class TrackerDeviceError(RNGTrackerError, ValueError):
    """A tracker or state used with a device it does not belong to."""


class ParallelStateError(RNGTrackerError, RuntimeError):
    """The process mesh is missing, already initialised, or does not fit the world."""


class ParallelConfigError(RNGTrackerError, ValueError):
    """Parallel sizes that are not positive ints or do not divide the world size."""


class CheckpointConfigError(RNGTrackerError, ValueError):
    """Checkpoint options that cannot work together or lack what they need."""


class CheckpointTypeError(RNGTrackerError, TypeError):
    """A checkpoint argument of the wrong type (e.g. a function that is not callable)."""


class CheckpointUsageError(RNGTrackerError, RuntimeError):
    """A checkpoint used in a way its mode cannot support (e.g. reentrant with autograd.grad, or
    any form traced where no graph break is allowed: ``torch.compile(fullgraph=True)``)."""


class CheckpointRNGMismatchError(RNGTrackerError, RuntimeError):
    """The recompute drew different randomness than the first forward."""


class KernelInputError(RNGTrackerError, ValueError):
    """A dropout kernel argument with a bad value, shape, device or dtype."""


class KernelInputTypeError(RNGTrackerError, TypeError):
    """A dropout kernel argument of the wrong type."""


class KernelInPlaceError(RNGTrackerError, RuntimeError):
    """``dropout(inplace=True)`` on a tensor torch will not write in place (refused before a draw)."""


class KernelUnavailableError(RNGTrackerError, RuntimeError):
    """The fused kernel cannot run as asked: Triton is missing here, or a CUDA graph is capturing."""


class RNGConsistencyError(RNGTrackerError, RuntimeError):
    """Ranks hold RNG states that break the declared equal/distinct policy."""


class TrackerNotInitializedError(RNGTrackerError, RuntimeError):
    """A Megatron-compatible call needs the process's RNG tracker, which was never created."""


class SiteCollisionError(RNGTrackerError, ValueError):
    """Two keyed sites would share a site id (and so their masks), or a name changes its id."""


class SiteIdError(RNGTrackerError, ValueError):
    """A keyed site name that is empty, or a site id outside [1, 2**32)."""


class UnknownSiteError(RNGTrackerError, KeyError):
    """No keyed site with that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepRangeError(RNGTrackerError, ValueError):
    """A keyed step outside [0, 2**32) (the step is one 32-bit Philox counter word)."""


class KeyedTypeError(RNGTrackerError, TypeError):
    """A keyed site name, site id or step of the wrong type."""


class KeyedUnseededError(RNGTrackerError, RuntimeError):
    """Keyed randomness was used before a seed was set."""


class KeyedExportError(RNGTrackerError, RuntimeError):
    """torch.export met keyed seed words it cannot make an exported program read when it runs:
    those of a :class:`KeyedRNG` that is not the process's ``get_keyed_rng(device)``, or any
    before ``rng_tracker.kernels`` (which registers the op that reads them) is imported."""


class DTensorPlacementError(RNGTrackerError, ValueError):
    """A DTensor whose placements the invariant random ops cannot place exactly in its logical tensor."""


class DTensorInputTypeError(RNGTrackerError, TypeError):
    """A DTensor random op given something that is not a DTensor where one is needed."""


class InvariantRandomModeError(RNGTrackerError, RuntimeError):
    """invariant_random() enabled or disabled out of order with other torch function modes."""


class MegatronVersionError(RNGTrackerError, RuntimeError):
    """``rng_tracker.megatron.install()`` found no megatron-core, or a version it was not
    checked against (the message names the version found and the known ones)."""


__all__ += ["MegatronVersionError"]


class ForkOrderError(RNGTrackerError, RuntimeError):
    """A fork closed out of LIFO order, or closed when it is not open (checked in every mode, -O too)."""


class SeedCoordinateError(RNGTrackerError, KeyError):
    """A seeding coordinate that names no parallel axis."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SeedCoordinateTypeError(SeedCoordinateError, TypeError):
    """Seeding coordinates that are not a mapping of axis name to rank; also a :class:`SeedCoordinateError`."""


class SeedOverflowError(InvalidSeedError):
    """A base seed whose scheme would derive a stream seed of 2**64 or more for these coordinates."""


__all__ += [
    "ForkOrderError",
    "SeedCoordinateError",
    "SeedCoordinateTypeError",
    "SeedOverflowError",
]


class InvariantRandomConfigError(RNGTrackerError, ValueError):
    """invariant_random() given an unknown init mode, a bad seed or model, or a seed for init="full"."""


class InvariantRandomUnsupportedError(RNGTrackerError, TypeError):
    """A random op under invariant_random() that has no layout-invariant draw for these inputs."""


class RNGStateLayoutError(RNGTrackerError, ValueError):
    """Saved per-rank RNG states loaded on another layout, where they cannot be restored exactly."""


__all__ += [
    "InvariantRandomConfigError",
    "InvariantRandomUnsupportedError",
    "RNGStateLayoutError",
]


class ParallelStateMismatchError(ParallelStateError):
    """rng_tracker's and Megatron's parallel states are both initialised and disagree on a
    size or a coordinate, so no answer to "which rank is this" can be trusted."""


class MegatronInstallError(RNGTrackerError, RuntimeError):
    """``rng_tracker.megatron.install()`` asked for one mode while the other is installed."""


class MegatronInvariantUnsupportedError(RNGTrackerError, ValueError):
    """A megatron-core feature that cannot draw layout-invariantly in ``install(invariant=True)``
    (TransformerEngine modules, context parallelism, RandomSTE, an init it cannot key)."""


class MegatronInvariantInitError(RNGTrackerError, RuntimeError):
    """A parameter megatron-core initialises was never filled by invariant init (its model was
    not a ``GPTModel``, or ``sharded_state_dict()`` gives it no box)."""


class BatchPositionError(ParallelConfigError):
    """A batch position that is not ints, lies outside the global batch, or does not fit the
    microbatch that runs in it; also a :class:`ParallelConfigError`."""


class MissingBatchPositionError(RNGTrackerError, RuntimeError):
    """A mask placed in the global batch (a keyed site, a dropout under ``invariant_random()``)
    was drawn with no batch position where the microbatch's place cannot be known (several
    data-parallel ranks or microbatches)."""


class InvariantSeedError(RNGTrackerError, ValueError):
    """In ``install(invariant=True)``, ranks gave ``model_parallel_cuda_manual_seed`` seeds that
    are neither one seed nor Megatron-LM's ``seed + 100 * pipeline rank``: keyed init and masks
    would differ per rank."""


__all__ += [
    "BatchPositionError",
    "BatchPositionTypeError",
    "InvariantSeedError",
    "MegatronInstallError",
    "MegatronInvariantInitError",
    "MegatronInvariantUnsupportedError",
    "MissingBatchPositionError",
    "ParallelStateMismatchError",
]


class RNGStateSaveError(RNGTrackerError, ValueError):
    """An RNG state a save refuses before writing, since no load could restore it: ranks holding
    different streams, keyed states or layouts, or a keyed step that is not the trainer's step."""


class RNGStateConfigError(RNGTrackerError, ValueError):
    """``RNGStateful`` given an option it cannot use (an unknown ``saved_by``, a ``step`` that is
    not callable, a ``strict`` that is not a bool)."""


class RNGStateRederivedWarning(UserWarning):
    """A load on another layout re-derived per-rank RNG states that cannot move (named in the
    message) from the run's seed, the saved step and each rank's new coordinates."""


__all__ += ["RNGStateConfigError", "RNGStateRederivedWarning", "RNGStateSaveError"]


# A warning of the tracker, and deprecated keyword aliases given beside their new names.
class CPURNGChangedWarning(UserWarning):
    """The CPU generator advanced inside a fork of a device stream (it is not forked), so those
    CPU draws are not part of the stream."""


class ArgumentConflictError(RNGTrackerError, TypeError):
    """A keyword given under both its name and its deprecated name (e.g. ``layout=`` and
    ``state=``)."""


class ForkTracedError(RNGTrackerError, RuntimeError):
    """A fork drew under a graph trace (torch.export, make_fx), which records the ops inside it
    but not the swap of generator states: the traced program would draw from the default
    generator instead of the stream. Where no graph break is allowed (strict export,
    ``torch.compile(fullgraph=True)``) any fork is refused on entry."""


class ForkNotReplayedWarning(UserWarning):
    """A tracker fork entered in a forward of torch's own checkpoint, which replays the default
    generators but not the tracker's streams: its recompute would draw other values (use
    ``rng_tracker.checkpoint``, or ``context_fn=rng_tracker.rng_context_fn()``)."""


__all__ += [
    "ArgumentConflictError",
    "CPURNGChangedWarning",
    "ForkNotReplayedWarning",
    "ForkTracedError",
]


# The distributed test harness's (rng_tracker.parallel.testing exports them too).
class DistributedTestError(RNGTrackerError, RuntimeError):
    """One or more ranks failed; ``failures`` maps each failed rank to its report."""

    def __init__(self, message: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)

    def __reduce__(
        self,
    ) -> tuple[type[DistributedTestError], tuple[str, dict[int, str]], dict[str, object]]:
        # args holds the message alone, and __init__ needs failures too: pickle and copy rebuild
        # from both (xdist sends a test's error between processes), keeping added attributes.
        return type(self), (str(self), self.failures), self.__dict__


class HarnessUsageError(RNGTrackerError, TypeError):
    """``run_distributed`` or the ``distributed`` marker was used wrongly: a function the rank
    processes cannot import, arguments they cannot receive, an unknown marker option, an async
    test."""


__all__ += ["DistributedTestError", "HarnessUsageError"]


class CompiledKernelFallbackWarning(UserWarning):
    """The compiled CPU dropout kernel cannot be built here (no C compiler, an empty cache): the
    plain-torch reference runs instead, with the same masks. Exported by ``rng_tracker.kernels``."""


__all__ += ["CompiledKernelFallbackWarning"]


class UnroutedCheckpointWarning(UserWarning):
    """``torch.compile`` traced ``torch.utils.checkpoint`` under ``invariant_random()``: Dynamo
    traces its body with no function mode (torch 2.13), so a dropout or init there draws torch's
    values, not the layout-invariant ones, and is not refused as in eager. Not warned for a body
    whose traced graph calls nothing the mode routes or refuses. Exported by
    ``rng_tracker.parallel.invariant``."""


__all__ += ["UnroutedCheckpointWarning"]


# Wrong types where no narrower error of the area fits.
class ArgumentTypeError(RNGTrackerError, TypeError):
    """An argument of the wrong type: a flag that is not a bool, a tracker that is not an
    ``RNGStatesTracker``, a layout that is not a parallel layout."""


class ParallelConfigTypeError(ParallelConfigError, TypeError):
    """A parallel size or layout entry that is not an int (a bool, a float, a string); also a
    :class:`ParallelConfigError`."""


class BatchPositionTypeError(BatchPositionError, ParallelConfigTypeError):
    """A batch position given as something other than ints; also a :class:`BatchPositionError`
    and a :class:`ParallelConfigTypeError`."""


class StateDictTypeError(StateDictError, TypeError):
    """A state or state dict of the wrong type (not a mapping, a name that is not a str, a
    state that is not a uint8 tensor); also a :class:`StateDictError`."""


class TrackerDeviceTypeError(TrackerDeviceError, TypeError):
    """A device or generator state of the wrong type (a bool or a list for a device; an int for
    a state), a TypeError as torch's own refusal is; also a :class:`TrackerDeviceError`."""


class RankTypeError(RankError, TypeError):
    """A parallel rank that is not an int (a float, a string, a bool), as Megatron's seed
    arithmetic refuses it with a TypeError; also a :class:`RankError`."""


__all__ += [
    "ArgumentTypeError",
    "ParallelConfigTypeError",
    "RankTypeError",
    "StateDictTypeError",
    "TrackerDeviceTypeError",
]


# An unknown parallel axis is a lookup miss (a KeyError, as an unknown stream or coordinate
# is), and the wrong types of options checked where a ValueError-only family was.
class UnknownAxisError(ParallelStateError, KeyError):
    """A parallel layout asked for an axis it does not have (``rank``, ``size`` or ``group`` of
    a name other than tp, pp, dp, cp, ep, etp, edp); also a :class:`ParallelStateError`."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RNGStateConfigTypeError(RNGStateConfigError, TypeError):
    """``RNGStateful`` given an option of the wrong type (a ``step`` that is not callable, a
    ``saved_by`` that is not a str); also an :class:`RNGStateConfigError`."""


class InvariantRandomConfigTypeError(InvariantRandomConfigError, TypeError):
    """Keyed init given a model that is not an ``nn.Module`` or a seed that is not an int;
    also an :class:`InvariantRandomConfigError`."""


__all__ += ["InvariantRandomConfigTypeError", "RNGStateConfigTypeError", "UnknownAxisError"]
