"""rng_tracker.parallel.testing: the distributed test harness and its pytest plugin."""

from __future__ import annotations

# harness.py
from rng_tracker.parallel.testing.harness import (
    DistributedTestError,
    HarnessUsageError,
    run_distributed,
)

__all__ = ["DistributedTestError", "HarnessUsageError", "run_distributed"]
