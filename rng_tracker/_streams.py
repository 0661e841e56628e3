"""The parallel RNG streams: their names, and the parallel axes each one varies over.

One home for what seeding (a stream's seed depends on its coordinates on these axes),
verification (ranks that share those coordinates must hold one state, the others distinct
ones) and the Megatron names (``get_*_rng_tracker_name``) all read.
"""

from __future__ import annotations

DEFAULT_STREAM = "default"  # the device's and the CPU's default generator
DATA_PARALLEL_RNG = "data-parallel-rng"
MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
# Megatron's weight-init streams of graph tensor parallelism (rng_tracker.megatron seeds them)
GTP_REMAT_RNG = "gtp-remat-rng"
EXPERT_GTP_REMAT_RNG = "egtp-remat-rng"

AXES = ("tp", "pp", "dp", "cp", "ep", "etp")  # the axes a seed may depend on

_STREAM_AXES = {
    DEFAULT_STREAM: ("pp",),
    DATA_PARALLEL_RNG: ("pp",),
    MODEL_PARALLEL_RNG: ("tp", "cp", "pp"),
    EXPERT_PARALLEL_RNG: ("ep", "etp", "pp"),
}
POLICY_STREAMS = tuple(_STREAM_AXES)  # the streams whose equal/distinct policy is declared


def stream_axes(stream: str, *, data_parallel_random_init: bool = False) -> tuple[str, ...]:
    """The parallel axes whose coordinates ``stream``'s seed depends on."""
    axes = _STREAM_AXES[stream]
    return (*axes, "dp") if data_parallel_random_init else axes
