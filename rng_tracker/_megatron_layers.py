"""megatron-core's CPU init helper with experts drawn from the expert-parallel stream.

megatron-core 0.19's ``_initialize_affine_weight_cpu`` builds a layer's master weight from the
CPU default generator, which every expert-parallel rank seeds alike: with
``use_cpu_initialization=True`` the experts of EP rank 1 are bitwise copies of EP rank 0's. Its
GPU helper forks ``expert-parallel-rng`` for experts; :func:`initialize_affine_weight_cpu` (put in
place by ``rng_tracker.megatron.install()``) does the same for the CPU master weight, so no two
global experts draw the same values. Dense layers draw exactly megatron's values.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

_SEED_BOUND = 2**63 - 1


def expert_forking(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (megatron's ``_initialize_affine_weight_cpu``) that draws an expert layer's
    master weight from the expert-parallel stream (the calling layer's ``is_expert``)."""

    def initialize_affine_weight_cpu(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_locals.get("self")  # the Column/RowParallelLinear being built
        if getattr(caller, "is_expert", False) is not True:
            return original(*args, **kwargs)
        from rng_tracker.megatron import (
            get_cuda_rng_tracker,
            get_expert_parallel_rng_tracker_name,
        )

        tracker = get_cuda_rng_tracker()
        with tracker.fork(get_expert_parallel_rng_tracker_name()):
            if tracker.device.type == "cpu":  # the stream is the CPU generator itself
                return original(*args, **kwargs)
            # the master weight is drawn on the CPU: seed it from the device stream (advancing it)
            seed = int(torch.randint(0, _SEED_BOUND, (1,), device=tracker.device).item())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return original(*args, **kwargs)

    initialize_affine_weight_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    initialize_affine_weight_cpu.__doc__ = original.__doc__
    return initialize_affine_weight_cpu
