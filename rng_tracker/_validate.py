"""The checks every module shares: one integer check for every argument the library takes as an
int (ranks, sizes, seeds, steps) and its form for sizes, one flag check for every argument it
takes as a bool, one type check, and the search for two names given one value."""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import torch

from rng_tracker.errors import (
    ArgumentTypeError,
    ParallelConfigError,
    ParallelConfigTypeError,
    SeedReuseError,
)

_T = TypeVar("_T")
_SHOWN_AS_POWER = 2**16  # bounds from here up read as 2**k, as the docs write them
_SHOWN_VALUE_CHARS = 60  # a refused value's repr in a message is cut to this many characters


def shown_value(value: object) -> str:
    """``value``'s type and repr, cut to a message's length: what a refusal says it got."""
    shown = repr(value)
    if len(shown) > _SHOWN_VALUE_CHARS:
        shown = f"{shown[: _SHOWN_VALUE_CHARS - 3]}..."
    return f"{type(value).__name__} {shown}"


def _power_of_two_exponent(value: int) -> int | None:
    """k where ``value`` is 2**k and large enough to be written so, else None."""
    if value >= _SHOWN_AS_POWER and value & (value - 1) == 0:
        return value.bit_length() - 1
    return None


def _wanted(minimum: int | None, maximum: int | None) -> str:
    """The allowed range in words: "in [0, 2**64)", "a positive int", ">= 0", "<= 7"."""
    if minimum is not None and maximum is not None:
        exponent = _power_of_two_exponent(maximum + 1)
        if exponent is not None:
            return f"in [{minimum}, 2**{exponent})"
        return f"in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive int"
    if minimum is not None:
        return f">= {minimum}"
    return f"<= {maximum}"


def known_true(condition: bool | torch.SymBool) -> bool:
    """Whether ``condition`` holds; one on symbolic sizes (torch.compile, export, make_fx) only
    where it is decided without a guard, so a check neither specialises a traced size nor narrows
    an exported one's range. A registered op checks its real sizes again when it runs."""
    if type(condition) is bool and not torch.compiler.is_compiling():
        return condition
    # (Dynamo shows a symbolic bool to traced code as a bool.) Whatever made a symbolic value
    # loaded torch's shape machinery; importing it here would load sympy with rng_tracker.
    return torch.fx.experimental.symbolic_shapes.statically_known_true(condition)


def checked_int(
    value: object,
    what: str,
    *,
    type_error: type[Exception],
    value_error: type[Exception] | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
    note: str = "",
) -> int:
    """``value`` as an int in [``minimum``, ``maximum``] (either bound optional).

    Anything with ``__index__`` is accepted (numpy and 0-dim integer tensors included); a bool is
    refused (a 0-dim bool tensor too), since ``True`` as a rank or a size is a mistake, not a 1.
    A non-int raises ``type_error``, an int out of range ``value_error`` (``type_error`` when not
    given); both messages name ``what``, and the range message ends with ``note`` (why the range
    is what it is).
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise type_error(f"{what} must be an int, got the bool {value!r}")
    # a symbolic size (torch.compile, export) stays symbolic: index() would specialise it
    # (Dynamo shows a symbolic int to traced code as an int)
    if type(value) is int or isinstance(value, torch.SymInt):
        result = value
    else:
        try:
            result = operator.index(value)
        except TypeError:
            raise type_error(f"{what} must be an int, got {shown_value(value)}") from None
    if (minimum is not None and known_true(result < minimum)) or (
        maximum is not None and known_true(result > maximum)
    ):
        raise (value_error or type_error)(
            f"{what} must be {_wanted(minimum, maximum)}, got {result}{note}"
        )
    return result


def checked_dim(
    value: object,
    what: str,
    shape: Sequence[int],
    *,
    type_error: type[Exception],
    value_error: type[Exception],
) -> int:
    """``value`` as a dim of a tensor of ``shape``, negative ones counted from the end and
    returned as their non-negative index."""
    dim = checked_int(value, what, type_error=type_error)
    if not -len(shape) <= dim < len(shape):
        raise value_error(f"{what}={dim} is not a dim of x, which has shape {tuple(shape)}")
    return dim % len(shape)


def checked_size(value: object, what: str, *, minimum: int = 1, note: str = "") -> int:
    """A size or count (a parallel size, a tensor extent, a batch): an int >= ``minimum``; a
    non-int raises :class:`ParallelConfigTypeError`, a smaller int :class:`ParallelConfigError`."""
    return checked_int(
        value,
        what,
        type_error=ParallelConfigTypeError,
        value_error=ParallelConfigError,
        minimum=minimum,
        note=note,
    )


def checked_instance(
    value: object, kind: type[_T], what: str, *, error: type[Exception] = ArgumentTypeError
) -> _T:
    """``value`` if it is a ``kind``, else ``error`` with the message "``what``, got <its type
    and repr>" (``what`` says what the argument must be, e.g. "tracker must be an
    RNGStatesTracker")."""
    if not isinstance(value, kind):
        raise error(f"{what}, got {shown_value(value)}")
    return value


def _is_numpy_bool(value: object) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def checked_flag(
    value: object, what: str, *, type_error: type[Exception] = ArgumentTypeError
) -> bool:
    """``value`` as a bool: a Python or numpy bool. Anything else (the str ``'no'``, an int, a
    tensor) raises ``type_error`` naming ``what``: its truth value would decide silently."""
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise type_error(f"{what} must be a bool, got {shown_value(value)}")


def first_repeat(values: Iterable[tuple[str, Hashable]]) -> tuple[str, str, Hashable] | None:
    """The first two names given the same value, and the value, or None if all differ (two
    streams of one seed or state would draw identical values)."""
    first_with: dict[Hashable, str] = {}
    for name, value in values:
        if value in first_with:
            return first_with[value], name, value
        first_with[value] = name
    return None


def refuse_repeat(
    values: Iterable[tuple[str, Hashable]], message: Callable[[str, str, Hashable], str]
) -> None:
    """Raise :class:`SeedReuseError` with ``message(first, second, value)`` when two names share
    a value (see :func:`first_repeat`)."""
    repeat = first_repeat(values)
    if repeat is not None:
        raise SeedReuseError(message(*repeat))
