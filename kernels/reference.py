"""The mask function and fused dropout in plain torch (the reference path).

Element with global flat index g keeps its value iff word(g) >= ceil(p * 2**32), i.e.
iff word(g) / 2**32 >= p exactly, where word(g) is word g % 4 of Philox4x32-10 under
the key at counter (lo32(c), hi32(c), c2, c3), c = base + g // 4, from the seed tensor
[key, base, c2, c3] (c2 = c3 = 0 for generator draws). The seed is read with tensor ops
only, so a seed on a GPU costs no host sync.
"""

from __future__ import annotations

import math

import torch

from rng_tracker.kernels.philox import philox4x32
from rng_tracker.kernels.shard import Layout

__all__ = ["fused_dropout_reference", "keep_mask", "keep_threshold"]

_MASK32 = 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """The smallest 32-bit word that is kept: ceil(p * 2**32) (exact in float64)."""
    return math.ceil(p * 4294967296.0)


def _words(seed: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 output (…, 4) for the counters of global indices ``g`` (int64, …)."""
    seed = seed.to(device=g.device, dtype=torch.int64, non_blocking=True)
    key, base, c2, c3 = seed.unbind(0)
    philox_key = torch.stack((key & _MASK32, (key >> 32) & _MASK32))  # (2,)
    c = base + torch.div(g, 4, rounding_mode="floor")  # wraps mod 2**64 like uint64
    counters = torch.stack(
        (
            c & _MASK32,
            (c >> 32) & _MASK32,
            (c2 & _MASK32).expand_as(c),
            (c3 & _MASK32).expand_as(c),
        ),
        dim=-1,
    )
    return philox4x32(philox_key, counters)


def keep_mask(seed: torch.Tensor, p: float, layout: Layout, device: torch.device) -> torch.Tensor:
    """Bool mask (local flat order) of the elements kept, from the seed tensor [key, base, c2, c3]."""
    if layout.numel == 0:
        return torch.zeros(0, dtype=torch.bool, device=device)
    if layout.aligned:  # one Philox call per group of 4 local elements
        groups = torch.arange(0, layout.numel, 4, dtype=torch.int64, device=device)
        words = _words(seed, layout.global_index(groups)).reshape(-1)[: layout.numel]
    else:
        g = layout.global_indices(device)
        words = _words(seed, g).gather(-1, (g % 4).unsqueeze(-1)).squeeze(-1)
    return words >= keep_threshold(p)


def fused_dropout_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    layout: Layout,
) -> torch.Tensor:
    """residual + keep * (x + bias) / (1 - p), computed in fp32 and rounded once to x's dtype."""
    keep = keep_mask(seed, p, layout, x.device).view(x.shape)
    value = x.float()
    if bias is not None:
        value = value + bias.float()
    scale = torch.tensor(1.0 / (1.0 - p) if p < 1 else 0.0, dtype=torch.float32, device=x.device)
    value = torch.where(keep, value * scale, torch.zeros((), dtype=torch.float32, device=x.device))
    if residual is not None:
        value = residual.float() + value
    return value.to(x.dtype)
