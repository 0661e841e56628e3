"""Where a local tensor sits in the logical tensor, and its elements' global indices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rng_tracker.errors import KernelInputError, KernelInputTypeError

__all__ = ["Layout", "Shard", "layout_of"]


@dataclass(frozen=True, slots=True)
class Shard:
    """The local tensor is chunk ``index`` of ``count`` equal chunks of the logical tensor along ``dim``."""

    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        for name in ("dim", "index", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise KernelInputTypeError(f"Shard.{name} must be an int, got {value!r}")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise KernelInputError(f"Shard needs count >= 1 and 0 <= index < count, got {self}")


@dataclass(frozen=True, slots=True)
class Layout:
    """Local flat index l → global flat index g = l + (l // row) * gap + offset.

    ``row`` is the local extent of the sharded dim times everything after it; ``gap``
    skips the other ranks' chunks (0 when the shard is one contiguous block of the
    logical tensor); ``aligned`` means groups of 4 consecutive local elements are groups
    of 4 consecutive global ones (one Philox call feeds them).
    """

    numel: int
    logical_numel: int
    row: int
    gap: int
    offset: int

    @property
    def aligned(self) -> bool:
        return self.offset % 4 == 0 and (self.gap == 0 or self.row % 4 == 0)

    def global_indices(self, device: torch.device) -> torch.Tensor:
        local = torch.arange(self.numel, dtype=torch.int64, device=device)
        if self.gap == 0 and self.offset == 0:
            return local
        return local + torch.div(local, self.row, rounding_mode="floor") * self.gap + self.offset


def layout_of(shape: torch.Size, shard: Shard | None) -> Layout:
    """The index map of a local tensor of ``shape`` placed by ``shard`` (None: the whole tensor)."""
    numel = shape.numel()
    if shard is None:
        return Layout(numel=numel, logical_numel=numel, row=max(numel, 1), gap=0, offset=0)
    if not isinstance(shard, Shard):
        raise KernelInputTypeError(f"shard must be a Shard or None, got {type(shard).__name__}")
    if not shape:
        raise KernelInputError("a 0-dim tensor cannot be a shard; pass shard=None")
    if not -len(shape) <= shard.dim < len(shape):
        raise KernelInputError(
            f"Shard.dim {shard.dim} is out of range for a {len(shape)}-dim tensor"
        )
    dim = shard.dim % len(shape)
    row = shape[dim:].numel()
    contiguous_block = shape[:dim].numel() == 1  # e.g. dim 0: no other rank's chunk in between
    return Layout(
        numel=numel,
        logical_numel=numel * shard.count,
        row=max(row, 1),
        gap=0 if contiguous_block else (shard.count - 1) * row,
        offset=shard.index * row,
    )
