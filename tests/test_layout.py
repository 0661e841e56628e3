"""rng_tracker._layout: one word, one keyword and one Protocol for the parallel layout.

- ``ParallelLayout`` declares what seeding, checkpointing and verification read of a layout;
  rng_tracker's ``ParallelState`` and the adapter of Megatron's ``parallel_state`` both are one
  (checked on the classes here, and on live objects in tests/test_megatron_state.py).
- ``layout=`` is the keyword of ``model_parallel_seed``, ``checkpoint`` and
  ``verify_rng_consistency``; the old ``state=``/``parallel_state=`` still work, warning, and
  both names at once are an ``ArgumentConflictError`` that changes no RNG state.
- ``checkpoint`` keeps ``layout=`` to itself: it is never passed to the checkpointed function.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from rng_tracker import ParallelLayout, RNGStatesTracker, checkpoint, model_parallel_seed
from rng_tracker.errors import ArgumentConflictError, RNGTrackerError
from rng_tracker.parallel import ParallelState, verify_rng_consistency
from rng_tracker.parallel._megatron_state import MegatronParallelState


class _Layout:
    """A layout that is not rng_tracker's: a user's own object with the four members."""

    world_size = 1

    def __init__(self, **ranks: int) -> None:
        self.ranks = ranks
        self.asked: list[str] = []

    def rank(self, axis: str) -> int:
        return self.ranks.get(axis, 0)

    def size(self, axis: str) -> int:
        return 1

    def group(self, axis: str) -> torch.distributed.ProcessGroup:
        self.asked.append(axis)
        raise _GroupAsked(axis)


class _GroupAsked(Exception):
    """Raised by _Layout.group: proves which layout a call asked for its group."""


_MEMBERS = ("world_size", "rank", "size", "group")


@pytest.mark.parametrize("cls", [ParallelState, MegatronParallelState])
def test_parallel_state_and_the_megatron_adapter_are_parallel_layouts(cls: type) -> None:
    """Both classes have every member the Protocol declares, with its parameters, and
    world_size is a property: anything that takes a ParallelLayout takes either."""
    assert {name for name in dir(ParallelLayout) if not name.startswith("_")} == set(_MEMBERS)
    assert isinstance(inspect.getattr_static(cls, "world_size"), property)
    for name in ("rank", "size", "group"):
        declared = list(inspect.signature(getattr(ParallelLayout, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == declared, name
    assert isinstance(_Layout(), ParallelLayout)
    assert not isinstance(object(), ParallelLayout)


def _same_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same stream names holding the same states, bitwise."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _rng_states(tracker: RNGStatesTracker) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.get_rng_state(), tracker.get_states()


def test_model_parallel_seed_takes_layout_and_its_old_name_state() -> None:
    """layout= places the rank; state= (deprecated) places it the same way, warning; both at
    once raise ArgumentConflictError (also an RNGTrackerError and a TypeError) before any
    generator or stream changes."""
    tracker = RNGStatesTracker("cpu")
    plan = model_parallel_seed(7, layout=_Layout(tp=1, pp=2), tracker=tracker)
    assert (plan.coordinates["tp"], plan.coordinates["pp"]) == (1, 2)
    seeded = tracker.get_states()
    with pytest.warns(DeprecationWarning, match=r"model_parallel_seed\(state=\.\.\.\).*layout="):
        old = model_parallel_seed(7, state=_Layout(tp=1, pp=2), tracker=tracker)
    assert old == plan
    assert _same_states(tracker.get_states(), seeded)

    before = _rng_states(tracker)
    with pytest.raises(ArgumentConflictError, match="layout= and state=") as refused:
        model_parallel_seed(8, layout=_Layout(), state=_Layout(tp=1), tracker=tracker)
    assert isinstance(refused.value, RNGTrackerError) and isinstance(refused.value, TypeError)
    cpu, streams = _rng_states(tracker)
    assert torch.equal(cpu, before[0])
    assert _same_states(streams, before[1])


def test_checkpoint_takes_layout_and_its_old_name_parallel_state() -> None:
    """distribute_saved_activations splits over the TP group of layout=, or of the deprecated
    parallel_state= (warning); both at once are an ArgumentConflictError."""
    x = torch.randn(4, 4, requires_grad=True)
    for mode in (False, True):
        given = _Layout()
        with pytest.raises(_GroupAsked, match="tp"):
            checkpoint(
                torch.sin, x, use_reentrant=mode, distribute_saved_activations=True, layout=given
            )
        assert given.asked == ["tp"]
        old = _Layout()
        with (
            pytest.warns(DeprecationWarning, match=r"checkpoint\(parallel_state=\.\.\.\)"),
            pytest.raises(_GroupAsked),
        ):
            checkpoint(
                torch.sin,
                x,
                use_reentrant=mode,
                distribute_saved_activations=True,
                parallel_state=old,
            )
        assert old.asked == ["tp"]
    with pytest.raises(ArgumentConflictError, match="layout= and parallel_state="):
        checkpoint(torch.sin, x, layout=_Layout(), parallel_state=_Layout())


def test_checkpoint_never_passes_layout_to_the_function() -> None:
    """layout= is checkpoint's own keyword: the function gets the other keywords, and one that
    takes a layout of its own gets it through functools.partial (docs/migrating.md)."""
    seen: list[dict] = []

    def block(t: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(dict(kwargs))
        return t.sin()

    x = torch.randn(3, requires_grad=True)
    mine = _Layout(tp=3)
    checkpoint(block, x, layout=_Layout(), scale=2).sum().backward()
    assert seen == [{"scale": 2}, {"scale": 2}]  # the forward and the recompute
    seen.clear()
    checkpoint(functools.partial(block, layout=mine), x, layout=_Layout()).sum().backward()
    assert seen == [{"layout": mine}, {"layout": mine}]


def test_verify_rng_consistency_refuses_both_names_before_any_collective() -> None:
    """verify_rng_consistency(layout, state=...) is refused at once (no process group is
    needed to say so); the old name alone is checked on real ranks in tests/test_verify.py."""
    with pytest.raises(ArgumentConflictError, match="layout= and state="):
        verify_rng_consistency(_Layout(), state=_Layout())
