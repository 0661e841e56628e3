"""The pytest plugin (the ``pytest11`` entry point ``rng_tracker_pytest``): the ``distributed``
marker runs a test body on real ranks, reports a failing rank, and costs nothing until used.

Claims: the marker runs the body on every rank with the rank fixtures set per rank; a rank's
failure fails the test with its traceback; the entry point pytest loads in every session imports
neither torch nor rng_tracker (so registering the marker costs no torch import), and the harness
loads with the first distributed test; the 0.1 path ``-p rng_tracker.parallel.testing.pytest_plugin``
still works, warning (and silently where it is a pre-0.2 install's own entry point).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, timeout=60)
def test_the_marker_runs_the_body_on_every_rank(rank, world_size, tmp_path):
    """The plugin runs this body on 2 ranks, with the rank fixtures set per rank."""
    assert dist.is_initialized() and world_size == dist.get_world_size() == 2
    assert rank == dist.get_rank()
    (tmp_path / f"ran-{rank}").write_text("yes")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran-0", "ran-1"]


def test_the_plugin_reports_a_failing_rank_to_pytest(pytester):
    """A distributed test failing on one rank fails in pytest with that rank's traceback, and the
    report names the test (it named the plugin's own function, _run_test_on_rank)."""
    pytester.makepyfile(
        test_failing=textwrap.dedent(
            """
            import pytest
            import torch.distributed as dist

            @pytest.mark.distributed(world_size=2, timeout=60)
            def test_fails_on_rank_1(rank):
                if rank == 1:
                    raise AssertionError("only rank one says this")
                dist.barrier()
            """
        )
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*2 ranks failed in test_fails_on_rank_1:*",
            "*rank 1 raised*",
            "*AssertionError: only rank one says this*",
        ]
    )


def test_the_entry_point_imports_neither_torch_nor_rng_tracker() -> None:
    """pytest imports the entry point in every session; in a fresh interpreter, importing it
    loads no torch and no module of rng_tracker (before 0.2 it imported both: about 1.8 s)."""
    (plugin,) = [
        ep for ep in entry_points(group="pytest11") if ep.name == "rng_tracker_distributed"
    ]
    assert plugin.value == "rng_tracker_pytest"
    code = (
        "import sys, rng_tracker_pytest\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'rng_tracker')]\n"
        "assert not loaded, loaded\n"
        "assert hasattr(rng_tracker_pytest, 'pytest_pyfunc_call')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


_LAZY_SESSION = """
import sys

import pytest

HARNESS = "rng_tracker.parallel.testing._harness"


def test_a_plain_test_sees_no_torch():
    assert "torch" not in sys.modules and HARNESS not in sys.modules


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_distributed_test_runs(rank, world_size):
    import torch.distributed as dist

    assert dist.get_world_size() == world_size == 2 and dist.get_rank() == rank


def test_the_harness_is_loaded_now():
    assert HARNESS in sys.modules
"""


def test_the_harness_loads_with_the_first_distributed_test(pytester: pytest.Pytester) -> None:
    """In a fresh pytest session (the plugin from its entry point), a plain test runs with no
    torch imported, a distributed test then runs on 2 ranks, and only then is the harness loaded."""
    pytester.makepyfile(test_lazy=_LAZY_SESSION)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=3)


def test_the_old_plugin_path_still_works(pytester: pytest.Pytester) -> None:
    """``-p rng_tracker.parallel.testing.pytest_plugin`` (entry point off) registers the marker
    and runs a distributed test, and the session warns that the path is deprecated."""
    pytester.makepyfile(
        test_old=textwrap.dedent(
            """
            import pytest
            import torch.distributed as dist

            @pytest.mark.distributed(world_size=1, timeout=60)
            def test_one_rank(rank):
                assert dist.is_initialized() and rank == 0
            """
        )
    )
    result = pytester.runpytest_inprocess(
        *("-p", "no:cacheprovider", "-p", "no:rng_tracker_distributed", "--strict-markers"),
        *("-p", "rng_tracker.parallel.testing.pytest_plugin"),
        # in process, the module may be imported already (by another test of this worker), and
        # pytest then says it cannot rewrite its asserts: that warning is not the claim here
        *("-W", "ignore::pytest.PytestAssertRewriteWarning"),
    )
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*pytest_plugin is deprecated and will be removed in 0.3*"])


def test_a_pre_0_2_install_still_runs_silently(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment installed before 0.2 (not reinstalled) has the 0.1 module as its entry
    point: pytest loads it under the entry point's name, the marker works, and nothing warns -
    even where this suite turns deprecations into errors (it runs inside this suite's filters)."""
    stale = pytester.path / "site" / "stale_install-0.1.0.dist-info"
    stale.mkdir(parents=True)
    (stale / "METADATA").write_text("Metadata-Version: 2.1\nName: stale_install\nVersion: 0.1.0\n")
    (stale / "entry_points.txt").write_text(
        "[pytest11]\nrng_tracker_distributed = rng_tracker.parallel.testing.pytest_plugin\n"
    )
    monkeypatch.syspath_prepend(stale.parent)  # found before the real install's entry point
    pytester.makepyfile(
        test_stale=textwrap.dedent(
            """
            import pytest

            def test_the_entry_point_is_the_old_module(pytestconfig):
                plugin = pytestconfig.pluginmanager.get_plugin("rng_tracker_distributed")
                assert plugin.__name__ == "rng_tracker.parallel.testing.pytest_plugin"

            @pytest.mark.distributed(world_size=1, timeout=60)
            def test_one_rank(rank):
                assert rank == 0
            """
        )
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=2, warnings=0)


def _failure_messages(reprec: pytest.HookRecorder) -> dict[str, str]:
    """Each failed test's name and the one line pytest reports for it."""
    return {
        report.nodeid.split("::")[-1]: report.longrepr.reprcrash.message  # type: ignore[union-attr]
        for report in reprec.getfailures()
    }


def test_an_async_test_is_refused_not_passed(pytester: pytest.Pytester) -> None:
    """An ``async def`` distributed test passed without its body running (the rank called the
    coroutine function and dropped the coroutine); it fails now, saying why."""
    pytester.makepyfile(
        test_async=textwrap.dedent(
            """
            import pytest

            @pytest.mark.distributed(world_size=1, timeout=60)
            async def test_async_body(rank):
                raise AssertionError("the body ran")

            @pytest.mark.distributed(world_size=1, timeout=60)
            async def test_async_generator():
                yield
            """
        )
    )
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    reprec.assertoutcome(failed=2)
    for name, message in _failure_messages(reprec).items():
        assert message.startswith("rng_tracker.errors.HarnessUsageError"), message
        assert f"{name} is an async test" in message and "asyncio.run" in message


_MARKER_OPTIONS = {
    # each was run, on 1 rank or with the default timeout, coerced or ignored
    "world_size=1.7": "ParallelConfigTypeError: world_size must be an int, got float 1.7",
    "world_size='1'": "ParallelConfigTypeError: world_size must be an int, got str",
    "world_size=True": "ParallelConfigTypeError: world_size must be an int, got the bool True",
    "world_size=None": "ParallelConfigTypeError: world_size must be an int, got NoneType",
    "world_size=1, timeout=True": "HarnessUsageError: timeout must be seconds (a float), got bool",
    "world_size=1, timeout=None": "HarnessUsageError: timeout must be seconds",
    "world_size=1, timeout='soon'": "HarnessUsageError: timeout must be seconds",
    "1, -1": "ParallelConfigError: timeout must be a positive number of seconds",
    "worldsize=1, timout=3": "HarnessUsageError: @pytest.mark.distributed on {name} got unknown "
    "options timout, worldsize: it takes world_size and timeout",
    "1, 60, 2": "HarnessUsageError: @pytest.mark.distributed on {name} takes at most 2 positional",
    "1, world_size=1": "HarnessUsageError: @pytest.mark.distributed on {name} got world_size both",
}


def test_marker_options_reach_the_harness_as_written(pytester: pytest.Pytester) -> None:
    """The marker coerced its options with int() and float() (world_size=1.7, '1' and True ran on
    1 rank, timeout=True meant 1 s), dropped a positional timeout and ignored misspelt keywords:
    each now fails with the typed error run_distributed raises for it, before any rank starts."""
    tests = "".join(
        f"@pytest.mark.distributed({options})\ndef test_{i}():\n    pass\n\n"
        for i, options in enumerate(_MARKER_OPTIONS)
    )
    pytester.makepyfile(test_options=f"import pytest\n\n{tests}")
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    reprec.assertoutcome(failed=len(_MARKER_OPTIONS))
    messages = _failure_messages(reprec)
    for i, wanted in enumerate(_MARKER_OPTIONS.values()):
        name = f"test_{i}"
        assert messages[name].startswith(f"rng_tracker.errors.{wanted.format(name=name)}"), (
            messages[name]
        )
