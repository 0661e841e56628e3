"""One integer check for every argument the library takes as an int (ranks, sizes, seeds, steps)."""

from __future__ import annotations

import operator

__all__ = ["checked_int"]


def checked_int(
    value: object,
    what: str,
    *,
    type_error: type[Exception],
    value_error: type[Exception] | None = None,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """``value`` as an int in [``minimum``, ``maximum``] (either bound optional).

    Anything with ``__index__`` is accepted (numpy and 0-dim integer tensors included); a bool is
    refused, since ``True`` as a rank or a size is a mistake, not a 1. A non-int raises
    ``type_error``, an int out of range ``value_error`` (``type_error`` when not given); both
    messages name ``what``.
    """
    if isinstance(value, bool):
        raise type_error(f"{what} must be an int, got the bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise type_error(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    out_of_range = value_error or type_error
    if minimum is not None and result < minimum:
        raise out_of_range(f"{what} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise out_of_range(f"{what} must be <= {maximum}, got {result}")
    return result
