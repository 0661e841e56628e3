"""The distributed test harness: results, failures with tracebacks, hangs, deaths, cleanup."""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rng_tracker.errors import RNGTrackerError
from rng_tracker.parallel.testing import DistributedTestError, run_distributed


def _rank_and_sum(offset: int) -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def _record_pid(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))


def _fail_on_rank_1(pid_dir: str) -> None:
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def _hang_on_rank_0(pid_dir: str) -> None:
    _record_pid(pid_dir)
    if dist.get_rank() == 0:
        child = subprocess.Popen(["sleep", "600"])
        Path(pid_dir, "child-of-0.pid").write_text(str(child.pid))
        _sleep_forever()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.1)


def _die_on_rank_1(pid_dir: str, how: str) -> None:
    _record_pid(pid_dir)
    if dist.get_rank() == 1:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()


def _assert_all_gone(pid_dir: Path) -> None:
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    assert pids, "the ranks never ran"
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        alive = status.exists() and "zombie" not in status.read_text()
        assert not alive, f"rank process {pid} outlived run_distributed"


def test_results_come_back_in_rank_order():
    """Each rank's return value, in rank order, after a real all_reduce."""
    assert run_distributed(_rank_and_sum, world_size=3, args=(10,)) == [
        (r, 3, 33.0) for r in range(3)
    ]


def test_a_failing_rank_reports_its_traceback(tmp_path):
    """The raising rank's traceback is in the error; its peer, left in barrier, is reported too,
    stopped early rather than left to the (long) timeout."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_1, world_size=2, args=(str(tmp_path),), timeout=600)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "hung: no result after" not in message
    assert "rank 1 raised" in message and "ValueError: rank one is unhappy" in message
    assert "_fail_on_rank_1" in message
    assert "barrier" in info.value.failures[0]  # gloo either errors out or the harness stops it
    assert set(info.value.failures) == {0, 1}
    _assert_all_gone(tmp_path)


def test_a_hanging_rank_fails_within_the_timeout_with_its_stack(tmp_path):
    """A rank that never returns is reported with the Python frame it was stuck in, once the
    timeout has passed and not long after (the ranks' start and the stack dump). The process the
    rank started goes with it: killing the rank alone left that child running."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_0, world_size=2, args=(str(tmp_path),), timeout=6)
    elapsed = time.monotonic() - start
    assert 6 <= elapsed < 6 + 30, f"reported after {elapsed:.1f} s for a 6 s timeout"
    message = str(info.value)
    assert "rank 0 hung: no result after 6 s" in message and "_sleep_forever" in message
    assert set(info.value.failures) == {0}
    _assert_all_gone(tmp_path)


@pytest.mark.parametrize(
    ("how", "words"), [("signal", "killed by SIGKILL"), ("exit", "exited with code 3")]
)
def test_a_dying_rank_is_reported(tmp_path, how, words):
    """A rank killed by a signal or by os._exit is named with how it died; its peer is stopped
    early rather than left to the (long) timeout."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_on_rank_1, world_size=2, args=(str(tmp_path), how), timeout=600)
    assert time.monotonic() - start < 60
    assert f"rank 1 died: {words}" in str(info.value)
    assert "hung: no result after" not in str(info.value)
    _assert_all_gone(tmp_path)


def test_a_local_function_is_refused():
    def local() -> None:  # pragma: no cover - never runs
        pass

    with pytest.raises(TypeError, match="module level"):
        run_distributed(local, world_size=1)


def _return_early_on_rank_1(pid_dir: str) -> str:
    """Rank 1 returns at once; rank 0 looks, a while later, whether rank 1's process still runs."""
    _record_pid(pid_dir)
    dist.barrier()  # both pid files are written
    if dist.get_rank() == 1:
        return "returned"
    time.sleep(1.0)
    peer = int(Path(pid_dir, "1.pid").read_text())
    status = Path(f"/proc/{peer}/status")
    return "running" if status.exists() and "zombie" not in status.read_text() else "exited"


def test_no_rank_exits_before_every_rank_has_returned(tmp_path):
    """A rank that finishes first stays alive until the slowest returns.

    gloo finishes a connection on one side first: a rank that exited right after building a
    group broke a slower peer still connecting to it ("Connection closed by peer").
    """
    assert run_distributed(_return_early_on_rank_1, world_size=2, args=(str(tmp_path),)) == [
        "running",
        "returned",
    ]
    _assert_all_gone(tmp_path)


_CALLER = """
import os, subprocess, sys, time
from pathlib import Path

import torch.distributed as dist


def hang(pid_dir):
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    Path(pid_dir, f"forkserver-of-{dist.get_rank()}.pid").write_text(str(os.getppid()))
    child = subprocess.Popen(["sleep", "600"])
    Path(pid_dir, f"child-of-{dist.get_rank()}.pid").write_text(str(child.pid))
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    from caller import hang
    from rng_tracker.parallel.testing import run_distributed

    run_distributed(hang, world_size=2, args=(sys.argv[1],), timeout=600)
"""


def test_no_rank_outlives_a_caller_killed_by_sigterm(tmp_path):
    """A caller killed before its cleanup runs (SIGTERM to pytest, a CI job cancelled) takes its
    ranks, what they started and the forkserver with it: they used to run on for ever."""
    (tmp_path / "caller.py").write_text(_CALLER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    caller = subprocess.Popen([sys.executable, str(tmp_path / "caller.py"), str(pid_dir)])
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.glob("*.pid"))) < 6:
            assert caller.poll() is None, "the caller exited before its ranks started"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        time.sleep(0.2)  # the last pid file is fully written
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) == -signal.SIGTERM
        deadline = time.monotonic() + 20
        while True:
            try:
                _assert_all_gone(pid_dir)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        caller.kill()
        caller.wait()
        for path in pid_dir.glob("*.pid"):  # leave nothing behind if the test failed
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(path.read_text()), signal.SIGKILL)


def _module_level() -> int:  # pragma: no cover - never runs: every call below is refused
    return 1


_BAD_CALLS = [
    (
        {"world_size": "2"},
        "ParallelConfigTypeError",
        TypeError,
        "world_size must be an int, got str",
    ),
    ({"world_size": 2.5}, "ParallelConfigTypeError", TypeError, "got float 2.5"),
    ({"world_size": True}, "ParallelConfigTypeError", TypeError, "got the bool True"),
    ({"world_size": 0}, "ParallelConfigError", ValueError, "world_size must be a positive int"),
    ({"fn": 5}, "HarnessUsageError", TypeError, "fn must be a module-level function"),
    ({"args": (threading.Lock(),)}, "HarnessUsageError", TypeError, "cannot be pickled"),
    ({"kwargs": {"lock": threading.Lock()}}, "HarnessUsageError", TypeError, "cannot be pickled"),
    ({"args": 5}, "HarnessUsageError", TypeError, "args must be a tuple or list"),
    ({"args": "ab"}, "HarnessUsageError", TypeError, "args must be a tuple or list"),
    ({"kwargs": [("a", 1)]}, "HarnessUsageError", TypeError, "kwargs must be a mapping"),
    ({"kwargs": {1: 2}}, "HarnessUsageError", TypeError, "kwargs must be a mapping"),
    ({"backend": 5}, "HarnessUsageError", TypeError, "backend must be"),
    ({"timeout": "60"}, "HarnessUsageError", TypeError, "timeout must be seconds"),
    ({"timeout": -1.0}, "ParallelConfigError", ValueError, "timeout must be a positive"),
    ({"timeout": float("nan")}, "ParallelConfigError", ValueError, "timeout must be a positive"),
    # past multiprocessing's longest wait: an OverflowError from it, after the ranks had started
    ({"timeout": 2.2e6}, "ParallelConfigError", ValueError, "at most 1e\\+06"),
    ({"timeout": 1e10}, "ParallelConfigError", ValueError, "at most 1e\\+06"),
]


@pytest.mark.parametrize(("kwargs", "error", "builtin", "match"), _BAD_CALLS)
def test_bad_calls_are_refused_before_anything_is_created(
    kwargs, error, builtin, match, tmp_path, monkeypatch
):
    """world_size='2' or 2.5 and unpicklable arguments raised bare TypeErrors (2.5 after making
    the rendezvous directory, which stayed behind); fn=5 started a rank that then failed."""
    import tempfile

    from rng_tracker import errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a work dir would appear
    before = torch.get_rng_state()
    call = {"fn": _module_level, "world_size": 1, **kwargs}
    with pytest.raises(getattr(errors, error), match=match) as info:
        run_distributed(call.pop("fn"), **call)
    assert isinstance(info.value, errors.RNGTrackerError) and isinstance(info.value, builtin)
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(torch.get_rng_state(), before)


def _explode_on_load() -> None:
    raise ValueError("this result does not load here")


class _LoadsBadly:
    """A result that pickles in the rank and raises when the calling process unpickles it."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return _explode_on_load, ()


def _return_a_result_that_loads_badly() -> _LoadsBadly:
    return _LoadsBadly()


def test_a_result_that_does_not_unpickle_is_reported_with_its_rank():
    """Unpickling a rank's result failed with that error itself, bare, naming no rank."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_return_a_result_that_loads_badly, world_size=1, timeout=60)
    assert set(info.value.failures) == {0}
    assert "rank 0 returned a result the calling process cannot unpickle" in str(info.value)
    assert "ValueError: this result does not load here" in info.value.failures[0]


@pytest.mark.parametrize(
    "clone",
    [copy.copy, copy.deepcopy, lambda e: pickle.loads(pickle.dumps(e))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_the_error_survives_pickle_and_copy(clone):
    """pickle and copy rebuilt the error from its message alone and failed (__init__ needs the
    failures too), so it could not cross processes (pytest-xdist) or be copied."""
    error = DistributedTestError("1 of 2 ranks failed in f:\n\nrank 1 raised: ...", {1: "raised"})
    error.extra = "kept"
    again = clone(error)
    assert type(again) is DistributedTestError and isinstance(again, RNGTrackerError)
    assert str(again) == str(error) and again.failures == {1: "raised"}
    assert again.extra == "kept"


_PRELOAD_PROBE = '''
import sys


def imported():
    """What this rank has imported before its function ran (the probe module imports neither)."""
    return "colorsys" in sys.modules, "wave" in sys.modules


def import_broken():
    import preload_broken  # noqa: F401
'''

_PRELOAD_SCRIPT = """
import os
import sys
from rng_tracker.errors import HarnessUsageError
from rng_tracker.parallel.testing import preload_modules, run_distributed
import preload_probe

for bad in ("no_such_module_here", "colorsys wave", 5):
    try:
        preload_modules(bad)
    except HarnessUsageError as error:
        print("refused", bad, "|", error)
preload_modules("colorsys", "preload_broken")
print(run_distributed(preload_probe.imported, world_size=2, timeout=120))
try:
    run_distributed(preload_probe.import_broken, world_size=2, timeout=120)
except Exception as error:
    print("broken", type(error).__name__, "|", str(error).splitlines()[-1])
print(run_distributed(preload_probe.imported, world_size=2, timeout=120))
print(os.environ.get("RNG_TRACKER_HARNESS_PRELOAD"))
preload_modules("colorsys")  # preloaded already: nothing to add, nothing refused
try:
    preload_modules("wave")
except HarnessUsageError as error:
    print("late", "|", error)
print("colorsys" in sys.modules)
import multiprocessing.forkserver, signal, time  # noqa: E401
server = multiprocessing.forkserver._forkserver._forkserver_pid
os.kill(server, signal.SIGKILL)
for _ in range(200):  # dead (a zombie until multiprocessing reaps it), not reaped here
    with open(f"/proc/{server}/stat") as stat:
        if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
            break
    time.sleep(0.01)
print(run_distributed(preload_probe.imported, world_size=2, timeout=120))
"""


def test_preloaded_modules_are_imported_in_every_rank_before_it_starts(tmp_path):
    """A rank imported what it used itself, each time (seconds per rank for a framework):
    preload_modules imports them once in the process the ranks fork from. It refuses, changing
    nothing, names that are no module, and a module added after the first run (whose forkserver
    already runs); it imports nothing in the calling process. A preloaded module that raised
    (not ImportError) stopped the forkserver and every run failed with an opaque EOFError; now
    only a rank that imports it fails, with the module's own error. A forkserver that died is
    started again with the preload list."""
    (tmp_path / "preload_probe.py").write_text(_PRELOAD_PROBE)
    (tmp_path / "preload_broken.py").write_text('raise RuntimeError("broken at import")\n')
    done = subprocess.run(
        [sys.executable, "-c", _PRELOAD_SCRIPT],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused no_such_module_here | ") and "no module named" in lines[0]
    assert lines[1].startswith("refused colorsys wave | ") and "takes module names" in lines[1]
    assert lines[2].startswith("refused 5 | ") and "takes module names" in lines[2]
    assert lines[3] == "[(True, False), (True, False)]"
    assert lines[4] == "broken DistributedTestError | RuntimeError: broken at import"
    assert lines[5] == "[(True, False), (True, False)]"  # the forkserver still serves
    assert lines[6] == "None"  # the preload list was in the forkserver's environment only
    assert lines[7].startswith("late | preload_modules('wave') came after")
    assert lines[8] == "False"  # the caller itself imported nothing
    # a forkserver that died was restarted bare by multiprocessing: now with the preload list
    assert lines[9] == "[(True, False), (True, False)]"
