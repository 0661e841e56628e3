"""The parallel layout: what the library needs to know of it, and where a call finds the process's.

:class:`ParallelLayout` is what seeding (``model_parallel_seed(layout=)``), checkpointing
(``checkpoint(layout=)``) and verification (``verify_rng_consistency(layout)``) take: this
rank's coordinate, the size and the process group of each parallel axis. rng_tracker's
:class:`~rng_tracker.parallel.ParallelState` and the adapter of Megatron's ``parallel_state``
both are one; any object with these four members is (the Protocol is checked structurally).

When a caller gives no layout, the public call asks :func:`process_layout` once and passes the
answer down, as torchtitan's ``set_determinism(parallel_dims, ...)`` takes its layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rng_tracker.errors import ArgumentTypeError

if TYPE_CHECKING:
    import torch.distributed as dist


@runtime_checkable
class ParallelLayout(Protocol):
    """The place of this process in the parallel layout, per axis (``"tp"``, ``"pp"``,
    ``"dp"``, ``"cp"``, ``"ep"``, ``"etp"``, ``"edp"``): what every ``layout=`` takes."""

    @property
    def world_size(self) -> int:
        """The number of ranks of the whole layout."""
        ...

    def rank(self, axis: str) -> int:
        """This process's coordinate on ``axis``."""
        ...

    def size(self, axis: str) -> int:
        """The number of ranks along ``axis``."""
        ...

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only on ``axis``."""
        ...


def process_layout() -> ParallelLayout | None:
    """The process's parallel layout: rng_tracker's parallel state, else Megatron's initialised
    ``parallel_state`` seen through the same interface; None when neither is set up."""
    from rng_tracker.parallel._megatron_state import current_layout  # lazy: core stays torch-only

    return current_layout()


def checked_layout(
    layout: object,
    caller: str,
    members: tuple[str, ...],
    *,
    error: type[Exception] = ArgumentTypeError,
) -> ParallelLayout:
    """``layout`` when it has the methods of :class:`ParallelLayout` that ``caller`` calls
    (``members``), else ``error``: a layout-like object with just those methods is accepted, as
    the calls never read more of it."""
    lacking = [name for name in members if not callable(getattr(layout, name, None))]
    if lacking:
        provides = ", ".join(f"{name}(axis)" for name in members)
        missing = ", ".join(f"{name}(axis)" for name in lacking)
        raise error(
            f"{caller}(layout=...) takes a parallel layout: layout must be a ParallelLayout, "
            f"which provides {provides}, such as rng_tracker.parallel.ParallelState; got "
            f"{type(layout).__name__}, which has no {missing}; pass a layout or None"
        )
    return layout  # type: ignore[return-value]
