"""rng_tracker.parallel.testing: the distributed test harness and its pytest plugin."""

from __future__ import annotations

from rng_tracker._deprecation import deprecated_names, moved_modules

# harness.py
from rng_tracker.parallel.testing._harness import (
    DistributedTestError,
    HarnessUsageError,
    preload_modules,
    run_distributed,
)

__all__ = ["DistributedTestError", "HarnessUsageError", "preload_modules", "run_distributed"]

# Modules renamed private in 0.2 (their public names are exported above); the old paths import,
# with a warning, until 0.3.
moved_modules(
    __name__,
    {
        "harness": "_harness",
    },
)

__getattr__ = deprecated_names(__name__, {})
