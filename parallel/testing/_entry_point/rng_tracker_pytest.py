"""pytest plugin: ``@pytest.mark.distributed(world_size=N, timeout=S)`` runs a test on N ranks.

The test body runs in every rank process with torch.distributed initialised; the
``rank`` and ``world_size`` fixtures hold that rank's values there. Other fixture
values are computed once in the pytest process and sent to the ranks (they must be
picklable; ``tmp_path`` is shared by all ranks). The options may be given by position too,
``distributed(N, S)``; they reach :func:`run_distributed` as written, which checks them. An
``async def`` test is refused: the ranks run no event loop.

This is the ``pytest11`` entry point, which pytest imports at the start of every session of an
environment where rng_tracker is installed, so it imports pytest alone: torch and the harness
(:func:`rng_tracker.parallel.testing.run_distributed`) load with the first distributed test.
setup.cfg installs this file as the top-level module ``rng_tracker_pytest``: a module inside
the ``rng_tracker`` package would import the package's ``__init__``, and with it torch.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

_DEFAULT_WORLD_SIZE = 2
_DEFAULT_TIMEOUT_S = 120.0
_OPTIONS = ("world_size", "timeout")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(world_size=2, timeout=120): run the test body on world_size real "
        "torch.distributed ranks (gloo on CPU)",
    )


def _usage_error(message: str) -> Exception:
    from rng_tracker.errors import HarnessUsageError  # imports torch: only on this error path

    return HarnessUsageError(message)


def _marker_options(item: pytest.Item) -> tuple[Any, Any]:
    """The marker's ``(world_size, timeout)`` as written (run_distributed checks the values);
    a :class:`HarnessUsageError` for options it does not take, which would be ignored."""
    marker = item.get_closest_marker("distributed")
    assert marker is not None
    where = f"@pytest.mark.distributed on {item.name}"
    if len(marker.args) > len(_OPTIONS):
        raise _usage_error(
            f"{where} takes at most {len(_OPTIONS)} positional options (world_size, timeout), "
            f"got {len(marker.args)}: {marker.args!r}"
        )
    unknown = sorted(set(marker.kwargs) - set(_OPTIONS))
    if unknown:
        raise _usage_error(
            f"{where} got unknown options {', '.join(unknown)}: it takes world_size and timeout"
        )
    options = dict(zip(_OPTIONS, marker.args))
    twice = sorted(set(options) & set(marker.kwargs))
    if twice:
        raise _usage_error(
            f"{where} got {', '.join(twice)} both by position and by keyword: give each once"
        )
    options.update(marker.kwargs)
    return options.get("world_size", _DEFAULT_WORLD_SIZE), options.get(
        "timeout", _DEFAULT_TIMEOUT_S
    )


class _RankBody:
    """The test body, called in every rank with that rank's ``rank`` and ``world_size``; named
    after the test, so that a failure reads "ranks failed in test_x"."""

    def __init__(self, test: Any) -> None:
        self.test = test
        self.__qualname__ = getattr(test, "__qualname__", type(test).__name__)

    def __call__(self, kwargs: dict[str, Any]) -> None:
        import torch.distributed as dist

        if "rank" in kwargs:
            kwargs["rank"] = dist.get_rank()
        if "world_size" in kwargs:
            kwargs["world_size"] = dist.get_world_size()
        result = self.test(**kwargs)
        if hasattr(result, "__await__") or hasattr(result, "__aiter__"):
            if inspect.iscoroutine(result):
                result.close()  # not awaited, on purpose: no "never awaited" warning
            raise _usage_error(_async_message(self.__qualname__))


def _async_message(name: str) -> str:
    return (
        f"{name} is an async test: the distributed marker runs plain functions only (the ranks "
        "run no event loop); make it a def and run the coroutine with asyncio.run in it"
    )


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

    test = pyfuncitem.obj
    if inspect.iscoroutinefunction(test) or inspect.isasyncgenfunction(test):
        raise _usage_error(_async_message(pyfuncitem.name))
    world_size, timeout = _marker_options(pyfuncitem)
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_distributed(_RankBody(test), world_size=world_size, args=(kwargs,), timeout=timeout)
    return True
