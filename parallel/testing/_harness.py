"""Run a function on N real torch.distributed ranks, each its own process.

Ranks rendezvous through a FileStore in a private temp dir (no ports, so concurrent
pytest-xdist workers never clash). Processes are forked from a forkserver that has
torch imported already, so a rank starts in a fraction of a second. Every failure is
reported with its rank: a raised exception with its traceback, a death by signal or
``os._exit``, a hang with the Python stack the rank was in, and a result that does not unpickle.
Each rank leads its own process group, so stopping a rank stops the processes it started too,
and a rank stops itself when the calling process is gone, even one killed before it could clean up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import numbers
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from rng_tracker._validate import checked_size
from rng_tracker.errors import (
    DistributedTestError,
    HarnessUsageError,
    ParallelConfigError,
)
from rng_tracker.parallel.testing import _preload

# After one rank fails, the others usually block in a collective: wait this long for them.
_GRACE_AFTER_FAILURE_S = 3.0
_STACK_DUMP_WAIT_S = 1.0
# How often a rank looks for its caller where the OS cannot wake it (no pidfd).
_CALLER_POLL_S = 0.5
# The longest timeout: multiprocessing's wait takes at most 2**31 - 1 ms (about 24.8 days).
_MAX_TIMEOUT_S = 1_000_000.0


_CONTEXT: multiprocessing.context.BaseContext | None = None
# What the forkserver imports before it forks any rank (preload_modules adds to it).
_PRELOAD = ["torch", "torch.distributed"]


def _context() -> multiprocessing.context.BaseContext:
    """The start method's context, its forkserver running with the preload list (started again
    with it where it died: multiprocessing would restart it bare, and ranks would import all)."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([_preload.__name__])
        else:
            ctx = multiprocessing.get_context("spawn")
        _CONTEXT = ctx
    if _CONTEXT.get_start_method() == "forkserver":
        _start_forkserver()
    return _CONTEXT


def _start_forkserver() -> None:
    """Start the forkserver with the names it is to preload in its environment (only in its:
    this process's environment is as it was). A forkserver already running keeps its imports
    (checking that it runs is one non-blocking wait)."""
    previous = os.environ.get(_preload.PRELOAD_ENV)
    os.environ[_preload.PRELOAD_ENV] = ",".join(_PRELOAD)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ[_preload.PRELOAD_ENV]
        else:
            os.environ[_preload.PRELOAD_ENV] = previous


def preload_modules(*modules: str) -> None:
    """Import ``modules`` once in the process the ranks are forked from, so that every rank of
    every later :func:`run_distributed` starts with them imported.

    A rank otherwise imports what it uses itself, each time: seconds per rank for a framework
    (megatron.core takes about 6 s), which dominates a suite of short distributed tests. Call it
    before this process's first run (in ``conftest.py``, say); torch and torch.distributed are
    always preloaded. A module whose import raises is left out (the runs go on; a rank that
    imports it gets its error). Where there is no forkserver (not Linux) ranks are spawned and
    import everything themselves.
    """
    for name in modules:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise HarnessUsageError(f"preload_modules takes module names, got {name!r}")
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package that does not import
            found = False
        if not found:
            raise HarnessUsageError(
                f"preload_modules: no module named {name!r} is installed; check the name"
            )
    new = [name for name in modules if name not in _PRELOAD]
    if new and _CONTEXT is not None:
        raise HarnessUsageError(
            f"preload_modules({', '.join(map(repr, new))}) came after this process's first "
            "run_distributed, whose forkserver is already running with its imports; call it "
            "before the first run (at the top of conftest.py, say)"
        )
    _PRELOAD.extend(new)


def _default_backend(world_size: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has exited (at once if it already has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (not Linux, or a kernel before 5.3): poll
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while True:
                os.kill(pid, 0)
                time.sleep(_CALLER_POLL_S)
        return
    select.select([pidfd], [], [])
    os.close(pidfd)


def _stop_with_caller(caller_pid: int) -> None:
    """Kill this rank and what it started once the process that called run_distributed is gone.

    The ranks are the forkserver's children, not the caller's, and hold no pipe of the caller's
    that would close: a caller killed before its ``finally`` (SIGTERM, SIGKILL) would leave them,
    and through them the forkserver, running for ever.
    """

    def watch() -> None:
        _wait_for_exit(caller_pid)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="rng_tracker-caller-watch", daemon=True).start()


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    workdir: str,
    environ: dict[str, str],
    sys_path: list[str],
    payload: bytes,
    timeout: float,
    caller_pid: int,
) -> None:
    os.setpgid(0, 0)  # first: whatever this rank starts is in the group that _stop kills
    _stop_with_caller(caller_pid)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    sys.path[:] = sys_path
    stack_file = open(os.path.join(workdir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
        data = pickle.dumps(result)
    except BaseException:
        with open(os.path.join(workdir, f"error-{rank}.txt"), "w") as out:
            out.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    tmp = os.path.join(workdir, f"result-{rank}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, os.path.join(workdir, f"result-{rank}.pkl"))
    _finish_together()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the closing barrier was the goodbye


def _finish_together() -> None:
    """Wait until every rank has returned before this one exits.

    gloo completes a connection on one side before the other: a rank that has finished
    building a group may exit while a slower peer is still connecting to it, and that peer
    fails with "Connection closed by peer". A closing barrier keeps every rank's sockets
    open until all ranks are done. A barrier that fails means a peer died, which that
    peer's report names; this rank's result stands.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a peer died: its own report says why
        dist.barrier()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _stack_of(process: multiprocessing.process.BaseProcess, workdir: str, rank: int) -> str:
    path = os.path.join(workdir, f"stack-{rank}.txt")
    try:
        os.kill(process.pid, signal.SIGUSR1)
    except (ProcessLookupError, TypeError):
        return "(no stack: the process is gone)"
    deadline = time.monotonic() + _STACK_DUMP_WAIT_S
    text = ""
    while time.monotonic() < deadline:
        text = _read(path)
        if text.strip():
            time.sleep(0.05)  # let the dump finish
            return _read(path).strip()
        time.sleep(0.02)
    return "(no stack: the rank had not started running Python code of its own)"


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a rank that still runs, with every process it started (its process group), and
    wait for it: "no process outlives the call" covers a hung rank's children too."""
    if process.pid is None:
        return  # never started
    if process.exitcode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # not yet its own group's leader, so it has no children yet
            process.kill()
    process.join()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _payload(fn: object, args: object, kwargs: object) -> bytes:
    """``(fn, args, kwargs)`` pickled for the ranks, or a :class:`HarnessUsageError` saying why
    the rank processes could not run them."""
    if not callable(fn):
        raise HarnessUsageError(
            f"fn must be a module-level function the ranks can import, got {type(fn).__name__} "
            f"{fn!r}"
        )
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise HarnessUsageError(
            f"{qualname} is not importable by the rank processes; define it at module level"
        )
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise HarnessUsageError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and (
        not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)
    ):
        raise HarnessUsageError(
            f"kwargs must be a mapping of str keyword names or None, got {type(kwargs).__name__}"
        )
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:  # pickle raises TypeError, AttributeError or PicklingError
        raise HarnessUsageError(
            f"{qualname or type(fn).__name__} and its arguments cannot be pickled for the ranks "
            f"({type(exc).__name__}: {exc}); pass picklable values and build the rest in fn"
        ) from None


def _check_options(backend: object, timeout: object) -> None:
    if backend is not None and not isinstance(backend, str):
        raise HarnessUsageError(
            f"backend must be a torch.distributed backend name such as 'gloo', or None, got "
            f"{type(backend).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise HarnessUsageError(f"timeout must be seconds (a float), got {type(timeout).__name__}")
    if not 0 < timeout <= _MAX_TIMEOUT_S:
        raise ParallelConfigError(
            f"timeout must be a positive number of seconds, at most {_MAX_TIMEOUT_S:g} (the longest "
            f"wait multiprocessing takes), got {timeout}"
        )


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    backend: str | None = None,
    timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return their results in rank order.

    ``fn`` must be importable (a module-level function) and its arguments and results
    picklable. Each rank has the default process group initialised (gloo on CPU, nccl
    when there is a GPU per rank). Raises :class:`DistributedTestError` naming every
    failed rank; no process outlives the call.
    """
    world_size = checked_size(world_size, "world_size")
    payload = _payload(fn, args, kwargs)
    qualname = getattr(fn, "__qualname__", "")
    _check_options(backend, timeout)
    backend = backend or _default_backend(world_size)
    ctx = _context()
    processes: list[multiprocessing.process.BaseProcess] = []
    workdir = tempfile.mkdtemp(prefix="rng_tracker_dist_")
    failures: dict[int, str] = {}
    try:
        processes += [
            ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    backend,
                    workdir,
                    dict(os.environ),
                    list(sys.path),
                    payload,
                    timeout,
                    os.getpid(),
                ),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        running = dict(enumerate(processes))
        while running:
            now = time.monotonic()
            limit = (
                deadline
                if first_failure is None
                else min(deadline, first_failure + _GRACE_AFTER_FAILURE_S)
            )
            multiprocessing.connection.wait(
                [p.sentinel for p in running.values()], timeout=max(0.0, limit - now)
            )
            for rank, process in list(running.items()):
                if process.exitcode is None:
                    continue
                del running[rank]
                process.join()
                error = _read(os.path.join(workdir, f"error-{rank}.txt"))
                if error:
                    failures[rank] = f"rank {rank} raised:\n{error.rstrip()}"
                elif process.exitcode < 0:
                    failures[rank] = f"rank {rank} died: killed by {_signal_name(process.exitcode)}"
                elif process.exitcode != 0 or not os.path.exists(
                    os.path.join(workdir, f"result-{rank}.pkl")
                ):
                    failures[rank] = (
                        f"rank {rank} died: exited with code {process.exitcode} without a result"
                    )
                if rank in failures and first_failure is None:
                    first_failure = time.monotonic()
            now = time.monotonic()
            if running and (
                now >= deadline
                or (first_failure is not None and now >= first_failure + _GRACE_AFTER_FAILURE_S)
            ):
                if now >= deadline:
                    why = f"hung: no result after {timeout:g} s"
                else:
                    first = min(failures)
                    why = f"was stopped {_GRACE_AFTER_FAILURE_S:g} s after rank {first} failed"
                for rank, process in running.items():
                    if not os.path.exists(os.path.join(workdir, f"result-{rank}.pkl")):
                        failures[rank] = (
                            f"rank {rank} {why}; it was at:\n{_stack_of(process, workdir, rank)}"
                        )
                    _stop(process)
                running.clear()
        results = []
        if not failures:
            for rank in range(world_size):
                try:
                    with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as f:
                        results.append(pickle.load(f))
                except Exception:  # unpickling runs the result's own code: any error is possible
                    failures[rank] = (
                        f"rank {rank} returned a result the calling process cannot unpickle:\n"
                        f"{traceback.format_exc().rstrip()}"
                    )
        if failures:
            report = "\n\n".join(failures[rank] for rank in sorted(failures))
            raise DistributedTestError(
                f"{len(failures)} of {world_size} ranks failed in {qualname}:\n\n{report}", failures
            )
        return results
    finally:
        for process in processes:
            _stop(process)
        shutil.rmtree(workdir, ignore_errors=True)
