"""pytest plugin: ``@pytest.mark.distributed(world_size=N, timeout=S)`` runs a test on N ranks.

The test body runs in every rank process with torch.distributed initialised; the
``rank`` and ``world_size`` fixtures hold that rank's values there. Other fixture
values are computed once in the pytest process and sent to the ranks (they must be
picklable; ``tmp_path`` is shared by all ranks).

This is the ``pytest11`` entry point, which pytest imports at the start of every session of an
environment where rng_tracker is installed, so it imports pytest alone: torch and the harness
(:func:`rng_tracker.parallel.testing.run_distributed`) load with the first distributed test.
setup.cfg installs this file as the top-level module ``rng_tracker_pytest``: a module inside
the ``rng_tracker`` package would import the package's ``__init__``, and with it torch.
"""

from __future__ import annotations

from typing import Any

import pytest

_DEFAULT_WORLD_SIZE = 2
_DEFAULT_TIMEOUT_S = 120.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size=2, timeout=120): run the test body on world_size real "
        "torch.distributed ranks (gloo on CPU)",
    )


def _marker_options(item: pytest.Item) -> tuple[int, float]:
    marker = item.get_closest_marker("distributed")
    assert marker is not None
    world_size = marker.kwargs.get(
        "world_size", marker.args[0] if marker.args else _DEFAULT_WORLD_SIZE
    )
    return int(world_size), float(marker.kwargs.get("timeout", _DEFAULT_TIMEOUT_S))


def _run_test_on_rank(test: Any, kwargs: dict[str, Any]) -> None:
    import torch.distributed as dist

    if "rank" in kwargs:
        kwargs["rank"] = dist.get_rank()
    if "world_size" in kwargs:
        kwargs["world_size"] = dist.get_world_size()
    test(**kwargs)


@pytest.fixture
def rank() -> int:
    """This rank's index (0 in the pytest process, which only dispatches)."""
    return 0


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The world size of a ``distributed`` test (1 for other tests)."""
    if request.node.get_closest_marker("distributed") is None:
        return 1
    return _marker_options(request.node)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("distributed") is None:
        return None
    from rng_tracker.parallel.testing import run_distributed  # torch loads here, once

    world_size, timeout = _marker_options(pyfuncitem)
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_distributed(
        _run_test_on_rank, world_size=world_size, args=(pyfuncitem.obj, kwargs), timeout=timeout
    )
    return True
