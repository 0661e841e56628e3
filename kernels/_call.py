"""One fused dropout call as every kernel path receives it.

``residual + keep * (x + bias) * scale``, where the mask is the one of x's place in the logical
tensor. The public functions validate the call once (tensors, p, the index map); the dispatcher
and the kernels read it as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rng_tracker.errors import KernelInputError, KernelInputTypeError
from rng_tracker.kernels._index_map import IndexMap

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels compute in


class DropoutCall(NamedTuple):
    """The tensors, p and index map of one call (a tuple: made in well under a microsecond)."""

    x: torch.Tensor  # (any shape)
    bias: torch.Tensor | None  # (x.shape[-1],), or None
    residual: torch.Tensor | None  # x.shape, or None
    p: float  # in [0, 1]
    index_map: IndexMap  # where x sits in the logical tensor


_new_tuple = tuple.__new__


def dropout_call(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    p: float,
    index_map: IndexMap,
) -> DropoutCall:
    """``DropoutCall(x, bias, residual, p, index_map)`` without NamedTuple's Python-level
    ``__new__`` (a third of its cost: this runs on every call)."""
    return _new_tuple(DropoutCall, (x, bias, residual, p, index_map))


def check_tensor(name: str, t: object, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t``, refused unless it is a tensor of a dtype the kernels compute in (and, with
    ``like``, on x's device): what every public entry point checks of x, bias and residual."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputTypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise KernelInputError(
            f"{name} has dtype {t.dtype}; fused dropout supports fp32, fp16 and bf16: cast it "
            f"(e.g. {name}.float())"
        )
    if like is not None and t.device != like.device:
        raise KernelInputError(f"{name} is on {t.device} but x is on {like.device}; move it there")
    return t
