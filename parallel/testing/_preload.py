"""What the harness's forkserver imports before it forks any rank.

The forkserver imports this module, which imports each module named in ``PRELOAD_ENV`` (set by
the harness while it starts the forkserver) on its own. multiprocessing's own preload lets any
error but ImportError stop the forkserver, after which every run fails with an ``EOFError``; here
a module that fails to import is left out, so a rank that needs it imports it itself and reports
the module's own error, and every other run goes on.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

PRELOAD_ENV = "RNG_TRACKER_HARNESS_PRELOAD"


def import_each(names: Iterable[str]) -> None:
    """Import every module of ``names`` that imports; a module whose import raises is left out."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the rank that needs it imports it, and reports the module's own error
            continue


import_each(name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name)
