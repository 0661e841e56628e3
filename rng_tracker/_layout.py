"""The process-wide parallel layout: looked up only at the public entry points.

Seeding, checkpoint splitting and verification take the layout as an argument; when a caller
gives none, the public call (``model_parallel_seed``, ``checkpoint``, the Megatron facade) asks
here once and passes the answer down, as torchtitan's ``set_determinism(parallel_dims, ...)``
takes its layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rng_tracker.parallel._mesh import ParallelState


def process_layout() -> ParallelState | None:
    """The process's parallel state: rng_tracker's, else Megatron's initialised
    ``parallel_state`` seen through the same interface; None when neither is set up."""
    from rng_tracker.parallel._megatron_state import current_layout  # lazy: core stays torch-only

    return current_layout()
