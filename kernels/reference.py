"""The mask function and fused dropout in plain torch (the reference path).

Element with global flat index g keeps its value iff word(g) >= ceil(p * 2**32), i.e.
iff word(g) / 2**32 >= p exactly, where word(g) is word g % 4 of Philox4x32-10 under
the key at counter (lo32(c), hi32(c), c2, c3), c = base + g // 4, from the seed tensor
[key, base, c2, c3] (c2 = c3 = 0 for generator draws). The seed is read with tensor ops
only, so a seed on a GPU costs no host sync.
"""

from __future__ import annotations

import math
import struct

import torch

from rng_tracker.kernels._index_map import IndexMap
from rng_tracker.kernels.philox import philox4x32

__all__ = ["fused_dropout_reference", "keep_mask", "keep_scale", "keep_threshold"]

_MASK32 = 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """The smallest 32-bit word that is kept: ceil(p * 2**32) (exact in float64)."""
    return math.ceil(p * 4294967296.0)


def keep_scale(p: float) -> float:
    """The scale of kept elements: 1 / (1 - p) rounded to fp32 (0 for p = 1), as a Python float
    that every kernel's fp32 argument holds exactly."""
    return struct.unpack("<f", struct.pack("<f", 1.0 / (1.0 - p) if p < 1 else 0.0))[0]


def _words(seed: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 output (…, 4) for the global groups ``group`` = g // 4 (int64, …)."""
    seed = seed.to(device=group.device, dtype=torch.int64, non_blocking=True)
    key, base, c2, c3 = seed.unbind(0)
    philox_key = torch.stack((key & _MASK32, (key >> 32) & _MASK32))  # (2,)
    c = base + group  # wraps mod 2**64 like uint64
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


def keep_mask(
    seed: torch.Tensor, p: float, index_map: IndexMap, device: torch.device
) -> torch.Tensor:
    """Bool mask (local flat order) of the elements kept, from the seed tensor [key, base, c2, c3]."""
    if index_map.numel == 0:
        return torch.zeros(0, dtype=torch.bool, device=device)
    if index_map.aligned:  # one Philox call per group of 4 local elements
        groups = torch.arange(0, index_map.numel, 4, dtype=torch.int64, device=device)
        words = _words(seed, index_map.global_index(groups) // 4).reshape(-1)[: index_map.numel]
    elif device.type == "cpu":
        # Runs of local elements share a global group (a row of a box is contiguous): one
        # Philox call per distinct group in a run, not one per element. (A host-side size,
        # so CPU only: elsewhere it would sync.)
        g = index_map.global_indices(device)
        group, run = torch.unique_consecutive(g // 4, return_inverse=True)
        words = _words(seed, group)[run, g % 4]
    else:
        g = index_map.global_indices(device)
        words = _words(seed, g // 4).gather(-1, (g % 4).unsqueeze(-1)).squeeze(-1)
    return words >= keep_threshold(p)


def fused_dropout_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    index_map: IndexMap,
) -> torch.Tensor:
    """residual + keep * (x + bias) / (1 - p), computed in fp32 and rounded once to x's dtype."""
    keep = keep_mask(seed, p, index_map, x.device).view(x.shape)
    value = x.float()
    if bias is not None:
        value = value + bias.float()
    scale = torch.tensor(keep_scale(p), dtype=torch.float32, device=x.device)
    value = torch.where(keep, value * scale, torch.zeros((), dtype=torch.float32, device=x.device))
    if residual is not None:
        value = residual.float() + value
    return value.to(x.dtype)
