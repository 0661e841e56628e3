"""Whether this thread runs inside one of rng_tracker's checkpoints (a checkpointed forward or
its recompute), and inside a forward of torch's own checkpoint that none of them replays: what
the tracker and ``invariant_random`` read to tell rng_tracker's checkpoints (which replay every
stream and mode) from torch's."""

from __future__ import annotations

import threading
from typing import Any

from rng_tracker._torch_private import innermost_pack_hook, is_torch_checkpoint_hook

# Per thread, per open rng_tracker checkpoint (outermost first): the innermost saved-tensor pack
# hook when it was entered, which is torch's checkpoint's own where rng_tracker's runs in it.
_OPEN = threading.local()


def _open() -> list[Any]:
    hooks = getattr(_OPEN, "hooks", None)
    if hooks is None:
        hooks = _OPEN.hooks = []
    return hooks


def is_checkpointing() -> bool:
    """Whether this thread runs inside a checkpointed forward or its recompute (Megatron's
    ``is_checkpointing``), in any mode of ``rng_tracker.checkpoint``, ``reentrant_checkpoint``
    or under ``rng_context_fn``."""
    return bool(getattr(_OPEN, "hooks", None))


def enter_checkpointing() -> None:
    _open().append(innermost_pack_hook())


def leave_checkpointing() -> None:
    _open().pop()


def in_unreplayed_torch_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a forward of torch's non-reentrant
    checkpoint that no rng_tracker checkpoint runs in (e.g. torch's own, nested in ours): its
    recompute replays the default generators, not the tracker's streams or function modes."""
    hook = innermost_pack_hook()
    if hook is None or not is_torch_checkpoint_hook(hook):
        return False
    hooks = getattr(_OPEN, "hooks", None)
    return not hooks or hooks[-1] is not hook
