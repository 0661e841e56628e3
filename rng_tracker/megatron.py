"""Megatron-LM-compatible names, for users who migrate and must keep their masks.

They work on CPU as on CUDA: "cuda" in a name only echoes Megatron's API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rng_tracker.checkpoint import checkpoint as _checkpoint
from rng_tracker.seeds import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    SeedPlan,
    model_parallel_seed,
)
from rng_tracker.tracker import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "model_parallel_cuda_manual_seed",
]


class CudaRNGStatesTracker(RNGStatesTracker):
    """Megatron's tracker class name; the streams of the current device."""

    def __init__(
        self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False
    ) -> None:
        # Graph-safe states are used wherever torch offers them, so both flags are moot.
        super().__init__(device=None)


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> RNGStatesTracker:
    """The process's tracker of the current device (Megatron's accessor name)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(
    seed: int,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
) -> SeedPlan:
    """Megatron's seeding: ``seed`` already holds the pipeline offset, as Megatron passes it.

    default = seed; model-parallel-rng = seed + 2718 + tp_rank;
    expert-parallel-rng = seed + 1024 + 100 * ep_rank + etp_rank.
    """
    return model_parallel_seed(
        seed,
        scheme="megatron",
        tp_rank=tp_rank,
        ep_rank=ep_rank,
        etp_rank=etp_rank,
        pp_rank=0,
        dp_rank=0,
    )


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the stream that is equal across tensor-parallel ranks."""
    return DATA_PARALLEL_RNG


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the stream that varies over expert- and expert-tensor-parallel ranks."""
    return EXPERT_PARALLEL_RNG


def get_model_parallel_rng_tracker_name() -> str:
    """Name of the stream that varies over tensor-parallel ranks."""
    return MODEL_PARALLEL_RNG


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Megatron's positional checkpoint: reentrant, replaying every tracker stream."""
    return _checkpoint(
        function,
        *args,
        use_reentrant=True,
        distribute_saved_activations=distribute_saved_activations,
    )
