"""The pytest plugin's 0.1 path, for ``-p rng_tracker.parallel.testing.pytest_plugin``: it works,
warning at configure time, until 0.3. The plugin is the top-level module ``rng_tracker_pytest``
now (the ``pytest11`` entry point pytest loads by itself), which imports no torch.

Importing this module does not warn (the library's module walk imports it); naming it with
``-p`` does, once per session. An environment installed before 0.2 still has it as its entry
point (until reinstalled): that works, silently.
"""

from __future__ import annotations

import sys

import pytest
import rng_tracker_pytest
from rng_tracker_pytest import pytest_pyfunc_call, rank, world_size

from rng_tracker._deprecation import REMOVED_IN

__all__ = ["pytest_configure", "pytest_pyfunc_call", "rank", "world_size"]


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (as the entry point does) and say that this path is on its way out."""
    rng_tracker_pytest.pytest_configure(config)
    if config.pluginmanager.get_name(sys.modules[__name__]) == "rng_tracker_distributed":
        return  # the entry point of an install from before 0.2: not the user's choice, so silent
    config.issue_config_time_warning(
        DeprecationWarning(
            f"module rng_tracker.parallel.testing.pytest_plugin is deprecated and will be removed "
            f"in {REMOVED_IN}: use the pytest11 entry point rng_tracker_pytest, which pytest loads "
            "by itself (-p rng_tracker_pytest where entry points are disabled)"
        ),
        stacklevel=2,
    )
