"""Which torch.distributed.checkpoint (DCP) call, if any, is asking a ``Stateful`` for its state.

DCP calls ``state_dict()`` of every top-level ``Stateful`` before a save *and* before a load,
without saying which, and loads strictly: a key the load-time ``state_dict()`` returns that the
checkpoint lacks fails the whole load. :class:`~rng_tracker.dcp.RNGStateful` writes one entry per
rank, so at load it must ask only for entries the checkpoint holds (a grown world has ranks that
wrote none), and it must know whether it is saving (each rank writes its own entry) or loading.

This module finds the answer on the call stack: the frame of torch's ``load`` (its
``storage_reader`` is set up before it calls ``state_dict()``) or of ``_stateful_to_state_dict``
(called by ``save`` and ``async_save``). It reads those frames' locals, and reads the
checkpoint's metadata through the reader DCP itself built. An ``RNGStateful`` nested in another
``Stateful`` (whose ``state_dict()`` calls its own) is found through that outer one, whose
method runs between the two on the stack. torch names:

| relies on | public? | guard |
| --- | --- | --- |
| ``state_dict_loader.load`` with locals ``storage_reader``, ``state_dict``, ``process_group``, ``no_dist`` | the function is public, its locals are not | a missing local raises :class:`~rng_tracker.errors.StateDictError` naming it; ``tests/test_dcp_resume_anywhere.py`` runs plain ``dcp.save``/``load``, ``tests/test_torchtitan_checkpoint.py`` torchtitan's ``CheckpointManager`` (sync and async) |
| ``state_dict_saver._stateful_to_state_dict`` (local ``state_dict``), called by ``save``/``async_save`` (locals ``process_group``, ``no_dist``) | private | not found: the call is taken as not a DCP save, and ``RNGStateful(saved_by="each_rank")`` says it explicitly |
| ``StorageReader.read_metadata().state_dict_metadata`` | public | |
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rng_tracker.errors import StateDictError


@dataclass(frozen=True, slots=True)
class DCPCall:
    """The DCP save or load that is running: its kind, the user's state dict and its options."""

    kind: Literal["save", "load"]
    state_dict: Any  # the dict the user gave dcp.save/dcp.load (top-level Statefuls in it)
    storage_reader: Any  # the load's StorageReader (None for a save)
    process_group: Any  # the process group the DCP call coordinates over (None: the world)
    no_dist: bool
    key: str  # the top-level key of the owner, or of the Stateful it is nested in
    nested: bool  # the owner sits inside the Stateful under ``key``, not at the top level


def _code(module: str, name: str) -> Any:
    """The code object of ``module.name`` beneath its decorators, or None where torch lacks it."""
    try:
        __import__(module)
        function = getattr(sys.modules[module], name)
    except (ImportError, AttributeError):
        return None
    return getattr(inspect.unwrap(function), "__code__", None)


# Process-wide: code objects of DCP's entry points, the same for every thread.
_CODES: dict[str, Any] = {}


def _codes() -> dict[str, Any]:
    if not _CODES:  # torch.distributed.checkpoint takes seconds to import: only when needed
        _CODES["load"] = _code("torch.distributed.checkpoint.state_dict_loader", "load")
        _CODES["stateful"] = _code(
            "torch.distributed.checkpoint.state_dict_saver", "_stateful_to_state_dict"
        )
        _CODES["save"] = _code("torch.distributed.checkpoint.state_dict_saver", "save")
        _CODES["async_save"] = _code("torch.distributed.checkpoint.state_dict_saver", "async_save")
    return _CODES


def _local(frame: Any, name: str, where: str) -> Any:
    if name not in frame.f_locals:
        raise StateDictError(
            f"torch's {where} has no local {name!r} in this torch version, so RNGStateful cannot "
            "tell what the checkpoint holds; pass saved_by='each_rank' and load on the saved "
            "layout, or report this torch version"
        )
    return frame.f_locals[name]


def find_dcp_call(owner: object) -> DCPCall | None:
    """The DCP save or load whose state dict holds ``owner``, or None.

    Only a DCP call that has ``owner`` among its top-level values, or a top-level ``Stateful``
    whose method is running below it on the stack (``owner`` nested in it), counts, so a
    ``state_dict()`` that some other code calls while a DCP call is on the stack is not
    mistaken for part of it.
    """
    codes = _codes()
    if codes["load"] is None and codes["stateful"] is None:
        return None
    start = sys._getframe(1)
    frame = start
    while frame is not None:
        code = frame.f_code
        if code is codes["load"] and codes["load"] is not None:
            state_dict = _local(frame, "state_dict", "dcp.load")
            place = _place(state_dict, owner, start, frame)
            if place is not None:
                return DCPCall(
                    "load",
                    state_dict,
                    _local(frame, "storage_reader", "dcp.load"),
                    frame.f_locals.get("process_group"),
                    bool(frame.f_locals.get("no_dist", False)),
                    *place,
                )
        if code is codes["stateful"] and codes["stateful"] is not None:
            state_dict = _local(frame, "state_dict", "dcp's _stateful_to_state_dict")
            place = _place(state_dict, owner, start, frame)
            if place is not None:
                caller = _caller(frame, (codes["save"], codes["async_save"]))
                group = None if caller is None else caller.f_locals.get("process_group")
                no_dist = caller is not None and bool(caller.f_locals.get("no_dist", False))
                return DCPCall("save", state_dict, None, group, no_dist, *place)
        frame = frame.f_back
    return None


def _place(state_dict: Any, owner: object, start: Any, dcp_frame: Any) -> tuple[str, bool] | None:
    """The top-level key that holds ``owner`` in ``state_dict`` and whether it holds it nested
    (in a Stateful whose method runs between ``start`` and ``dcp_frame``), or None."""
    if not isinstance(state_dict, dict):
        return None
    for key, value in state_dict.items():
        if value is owner:
            return str(key), False
    running = []  # the objects whose methods run between the owner's call and DCP's
    frame = start
    while frame is not None and frame is not dcp_frame:
        this = frame.f_locals.get("self")
        if this is not None:
            running.append(this)
        frame = frame.f_back
    for key, value in state_dict.items():
        if any(value is this for this in running):
            return str(key), True
    return None


def _caller(frame: Any, codes: tuple[Any, ...], depth: int = 8) -> Any:
    """The nearest frame above ``frame`` (through DCP's logging wrappers) running one of ``codes``."""
    frame = frame.f_back
    while frame is not None and depth > 0:
        if frame.f_code in codes:
            return frame
        frame, depth = frame.f_back, depth - 1
    return None


def saved_keys(call: DCPCall, is_entry: Callable[[str], bool]) -> set[str]:
    """The keys of the owner's entries in the checkpoint being loaded (``rank3``, ``shared``, ...).

    Reads the checkpoint's metadata through the load's own reader: DCP's metadata lists every
    saved key, so this costs what DCP's own metadata read costs (once more). Nested in a
    Stateful, the owner's entries are the keys below ``call.key`` whose last part
    ``is_entry``; they must all sit at one place there.
    """
    prefix = call.key + "."
    try:
        metadata = call.storage_reader.read_metadata()
        keys = metadata.state_dict_metadata
    except Exception as exc:  # the reader's own failure, e.g. no such checkpoint
        raise StateDictError(
            f"the checkpoint's metadata could not be read ({type(exc).__name__}: {exc}); "
            "check the checkpoint path"
        ) from exc
    below = [key[len(prefix) :] for key in keys if key.startswith(prefix)]
    if not call.nested:
        return set(below)
    places: dict[str, set[str]] = {}
    for key in below:
        place, _, last = key.rpartition(".")
        if is_entry(last):
            places.setdefault(place, set()).add(last)
    if len(places) > 1:
        raise StateDictError(
            f"the checkpoint holds RNG state at {len(places)} places inside {call.key!r} "
            f"({', '.join(sorted(f'{call.key}.{p}' for p in places))}), so an RNGStateful nested "
            "there cannot tell which is its own; put each RNGStateful at the top level of the "
            "state dict given to dcp.save and dcp.load, under its own key"
        )
    return next(iter(places.values()), set())
