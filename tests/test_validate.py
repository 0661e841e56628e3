"""The one integer check: bools refused, __index__ accepted, bounds named, typed errors; the one
flag check: only real bools; and the one instance check. Each refusal shows the value it got."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rng_tracker._validate import checked_flag, checked_instance, checked_int
from rng_tracker.errors import (
    ArgumentTypeError,
    InvalidSeedError,
    InvalidSeedTypeError,
    RNGTrackerError,
)


def test_accepts_index_types_and_refuses_bools_and_floats() -> None:
    assert checked_int(torch.tensor(3), "rank", type_error=InvalidSeedTypeError) == 3
    for bad in (True, 1.0, "1", None):
        with pytest.raises(InvalidSeedTypeError, match="rank must be an int"):
            checked_int(bad, "rank", type_error=InvalidSeedTypeError)


def test_bounds_raise_the_value_error_naming_the_bound() -> None:
    kwargs = {"type_error": InvalidSeedTypeError, "value_error": InvalidSeedError}
    with pytest.raises(InvalidSeedError, match="seed must be >= 0, got -1"):
        checked_int(-1, "seed", minimum=0, **kwargs)
    with pytest.raises(InvalidSeedError, match="seed must be <= 7, got 8"):
        checked_int(8, "seed", maximum=7, **kwargs)
    assert checked_int(7, "seed", minimum=0, maximum=7, **kwargs) == 7


def test_range_messages_read_as_the_docs_write_them() -> None:
    kwargs = {"type_error": InvalidSeedTypeError, "value_error": InvalidSeedError}
    with pytest.raises(
        InvalidSeedError, match=r"seed must be in \[0, 2\*\*64\), got 18446744073709551616$"
    ):
        checked_int(2**64, "seed", minimum=0, maximum=2**64 - 1, **kwargs)
    with pytest.raises(InvalidSeedError, match=r"step must be in \[0, 9\], got 10: why$"):
        checked_int(10, "step", minimum=0, maximum=9, note=": why", **kwargs)
    with pytest.raises(InvalidSeedError, match="size must be a positive int, got 0"):
        checked_int(0, "size", minimum=1, **kwargs)
    with pytest.raises(InvalidSeedTypeError, match="size must be an int, got the bool True"):
        checked_int(True, "size", minimum=1, **kwargs)
    assert checked_int(2**64 - 1, "seed", minimum=0, maximum=2**64 - 1, **kwargs) == 2**64 - 1


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(False), np.True_])
def test_bools_in_any_form_are_refused_as_ints(bad) -> None:
    """A 0-dim bool tensor has __index__ (True reads as 1): it is a bool, not an int."""
    with pytest.raises(InvalidSeedTypeError, match="seed must be an int, got") as info:
        checked_int(bad, "seed", type_error=InvalidSeedTypeError, minimum=0)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert checked_int(torch.tensor(1), "seed", type_error=InvalidSeedTypeError) == 1
    assert checked_int(np.int64(1), "seed", type_error=InvalidSeedTypeError) == 1


def test_flags_take_python_and_numpy_bools_only() -> None:
    assert checked_flag(True, "flag") is True
    assert checked_flag(np.False_, "flag") is False
    for bad in ("no", "", 1, 0, None, torch.tensor(True), 1.0):
        with pytest.raises(ArgumentTypeError, match="flag must be a bool, got"):
            checked_flag(bad, "flag")
    with pytest.raises(ArgumentTypeError, match=r"got str 'x{10}.*\.\.\.$") as info:
        checked_flag("x" * 10_000, "flag")
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert len(str(info.value)) < 200


def test_instances_pass_through_and_refusals_show_the_value_cut() -> None:
    generator = torch.Generator()
    assert (
        checked_instance(generator, torch.Generator, "generator must be a Generator") is generator
    )
    with pytest.raises(InvalidSeedTypeError, match=r"^g must be a Generator, got int 7$"):
        checked_instance(7, torch.Generator, "g must be a Generator", error=InvalidSeedTypeError)
    with pytest.raises(ArgumentTypeError, match=r"got list \[0, 0, .*\.\.\.$") as info:
        checked_instance([0] * 10_000, torch.Generator, "g must be a Generator")
    assert len(str(info.value)) < 200
    with pytest.raises(
        InvalidSeedTypeError, match=r"^seed must be an int, got str 'x{10}.*\.\.\.$"
    ):
        checked_int("x" * 10_000, "seed", type_error=InvalidSeedTypeError)
