"""Whether HF accelerate's ``save_state`` is asking for a state it writes on every node.

accelerate calls ``state_dict()`` of a registered object on every process and writes it from the
main process, or, with ``ProjectConfiguration(save_on_each_node=True)``, from each node's local
main process (for nodes without a shared file system); ``load_state`` reads the file on every
process. :class:`~rng_tracker.dcp.RNGStateful` must then hand every local main all ranks' entries,
not only rank 0. This module reads the answer from the call stack, as ``_dcp_context`` does for
DCP: the frame of accelerate's ``checkpointing.save_custom_state`` whose ``obj`` is the owner,
and its ``save_on_each_node`` argument. accelerate names:

| relies on | public? | guard |
| --- | --- | --- |
| ``accelerate.checkpointing.save_custom_state`` with locals ``obj`` and ``save_on_each_node`` | the function is importable, not documented | not found: the save is taken as main-process only, and ``RNGStateful(saved_by="each_node")`` says it explicitly; ``tests/test_accelerate.py`` runs ``save_on_each_node=True`` on two simulated nodes |
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from rng_tracker._optional_module import OptionalModule

_checkpointing_module = OptionalModule("accelerate.checkpointing")


def _save_custom_state_code() -> Any:
    module = _checkpointing_module()  # not imported: accelerate is not saving
    function = getattr(module, "save_custom_state", None)
    return None if function is None else getattr(inspect.unwrap(function), "__code__", None)


def accelerate_saves_on_each_node(owner: object) -> bool:
    """True inside accelerate's ``save_state`` of ``owner`` with ``save_on_each_node=True``."""
    code = _save_custom_state_code()
    if code is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("obj") is owner:
            return bool(frame.f_locals.get("save_on_each_node", False))
        frame = frame.f_back
    return False
