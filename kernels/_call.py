"""One fused dropout call as every kernel path receives it.

``residual + keep * (x + bias) * scale``, where the mask is the one of x's place in the logical
tensor. The public functions validate the call once (tensors, p, the index map); the dispatcher
and the kernels read it as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rng_tracker.kernels._index_map import IndexMap


class DropoutCall(NamedTuple):
    """The tensors, p and index map of one call (a tuple: made in well under a microsecond)."""

    x: torch.Tensor  # (any shape)
    bias: torch.Tensor | None  # (x.shape[-1],), or None
    residual: torch.Tensor | None  # x.shape, or None
    p: float  # in [0, 1]
    index_map: IndexMap  # where x sits in the logical tensor
