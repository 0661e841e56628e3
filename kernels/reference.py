"""The mask function and fused dropout in plain torch (the reference path).

Element with global flat index g keeps its value iff word(g) >= ceil(p * 2**32), i.e.
iff word(g) / 2**32 >= p exactly, where word(g) is word g % 4 of Philox4x32-10 under
the key at counter (lo32(c), hi32(c), c2, c3), c = base + g // 4, from the seed tensor
[key, base, c2, c3] (c2 = c3 = 0 for generator draws). The seed is read with tensor ops
only, so a seed on a GPU costs no host sync.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

from rng_tracker._torch_private import functorch_transforms_active
from rng_tracker._validate import checked_instance, known_true, shown_value
from rng_tracker.errors import KernelInputError, KernelInputTypeError
from rng_tracker.kernels._call import DropoutCall, check_tensor
from rng_tracker.kernels._index_map import IndexMap
from rng_tracker.kernels.philox import philox4x32_unchecked

__all__ = ["fused_dropout_reference", "keep_mask", "keep_scale", "keep_threshold"]

_MASK32 = 0xFFFFFFFF


def check_p(p: object) -> float:
    """``p`` as a float in [0, 1], or a typed error (every kernel and the DTensor ops share it)."""
    if type(p) is float and 0.0 <= p <= 1.0:  # the usual case, without the ABC check
        return p
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise KernelInputTypeError(f"p must be a float, got {shown_value(p)}")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise KernelInputError(f"dropout probability p must be in [0, 1], got {p}")
    return p


def keep_threshold(p: float) -> int:
    """The smallest 32-bit word that is kept: ceil(p * 2**32) (exact in float64)."""
    return keep_threshold_unchecked(check_p(p))


def keep_scale(p: float) -> float:
    """The scale of kept elements: 1 / (1 - p) rounded to fp32 (0 for p = 1), as a Python float
    that every kernel's fp32 argument holds exactly."""
    return keep_scale_unchecked(check_p(p))


def keep_threshold_unchecked(p: float) -> int:
    """:func:`keep_threshold` of a ``p`` that :func:`check_p` already passed."""
    return math.ceil(p * 4294967296.0)


def keep_scale_unchecked(p: float) -> float:
    """:func:`keep_scale` of a ``p`` that :func:`check_p` already passed."""
    return struct.unpack("<f", struct.pack("<f", 1.0 / (1.0 - p) if p < 1 else 0.0))[0]


def _check_seed(seed: object) -> None:
    """Refuse a seed that is not an int64 tensor [key, base, c2, c3] (its values are not read)."""
    if not isinstance(seed, torch.Tensor):
        raise KernelInputTypeError(f"seed must be an int64 tensor, got {type(seed).__name__}")
    check_seed_shape(seed)


def check_seed_shape(seed: torch.Tensor) -> None:
    """Refuse a seed tensor that is not int64 of shape (4,): the words [key, base, c2, c3]."""
    if seed.dtype != torch.int64 or seed.shape != (4,):
        raise KernelInputError(
            f"seed must be an int64 tensor of 4 words [key, base, c2, c3], got {seed.dtype} of "
            f"shape {tuple(seed.shape)}"
        )


def read_seed_words(seed: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The words of a seed tensor where reading them is free (a plain CPU tensor, nothing
    traced, fake or batched), with c2 and c3 checked to be in [0, 2**32); else None (a seed on a
    device is not read on the host: no sync, and only the low 32 bits of c2 and c3 count)."""
    readable = (
        type(seed) is torch.Tensor  # not a fake tensor (shape-only) or another subclass
        and seed.device.type == "cpu"
        and not torch.compiler.is_compiling()
    )
    if not readable or functorch_transforms_active() is not False:
        return None
    key, base, c2, c3 = seed.tolist()
    if not (0 <= c2 < 2**32 and 0 <= c3 < 2**32):
        raise KernelInputError(f"seed words c2 and c3 must be in [0, 2**32), got {c2} and {c3}")
    return key, base, c2, c3


def _checked_index_map(index_map: object) -> IndexMap:
    return checked_instance(
        index_map,
        IndexMap,
        "index_map must be an IndexMap (e.g. index_map_of(x.shape, shard))",
        error=KernelInputTypeError,
    )


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
    return philox4x32_unchecked(philox_key, counters)


def keep_mask(
    seed: torch.Tensor, p: float, index_map: IndexMap, device: torch.device
) -> torch.Tensor:
    """Bool mask (local flat order) of the elements kept, from the seed tensor [key, base, c2, c3]."""
    _check_seed(seed)
    read_seed_words(seed)
    p = check_p(p)
    _checked_index_map(index_map)
    if not isinstance(device, torch.device):
        raise KernelInputTypeError(f"device must be a torch.device, got {type(device).__name__}")
    return _keep_mask(seed, p, index_map, device)


def _keep_mask(
    seed: torch.Tensor, p: float, index_map: IndexMap, device: torch.device
) -> torch.Tensor:
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
    return words >= keep_threshold_unchecked(p)


def fused_dropout_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    index_map: IndexMap,
) -> torch.Tensor:
    """residual + keep * (x + bias) / (1 - p), computed in fp32 and rounded once to x's dtype."""
    p = _check_reference_call(x, bias, residual, seed, p, index_map)
    return fused_dropout_reference_unchecked(DropoutCall(x, bias, residual, p, index_map), seed)


def fused_dropout_reference_unchecked(call: DropoutCall, seed: torch.Tensor) -> torch.Tensor:
    """:func:`fused_dropout_reference` of a call already checked: the ops' reference kernel,
    whose calls the public functions checked once (``kernels._call``)."""
    x, bias, residual, p, index_map = call
    keep = _keep_mask(seed, p, index_map, x.device).view(x.shape)
    value = x.float()
    if bias is not None:
        value = value + bias.float()
    scale = torch.tensor(keep_scale_unchecked(p), dtype=torch.float32, device=x.device)
    value = torch.where(keep, value * scale, torch.zeros((), dtype=torch.float32, device=x.device))
    if residual is not None:
        value = residual.float() + value
    return value.to(x.dtype)


def _check_reference_call(
    x: object, bias: object, residual: object, seed: object, p: object, index_map: object
) -> float:
    """Refuse what fused_dropout_reference cannot compute; ``p`` as checked."""
    check_tensor("x", x)
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None:
            check_tensor(name, t, like=x)
    _check_seed(seed)
    read_seed_words(seed)
    p = check_p(p)
    check_call_shapes(x, bias, residual, _checked_index_map(index_map))
    return p


def check_call_shapes(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, index_map: IndexMap
) -> None:
    """Refuse a bias that is not (x.shape[-1],), a residual that is not x.shape, or an index map
    whose extents do not multiply to x.numel(): every kernel reads bias, residual and its output
    by x's elements alone (the reference and, called straight, the registered ops check them)."""
    for name, t, shape in (("bias", bias, x.shape[-1:]), ("residual", residual, x.shape)):
        if t is not None and (t.shape != shape or (name == "bias" and x.dim() == 0)):
            raise KernelInputError(
                f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)} (x has shape "
                f"{tuple(x.shape)})"
            )
    # after a graph break the map's sizes are new symbols, unrelated to x's (known_true)
    if known_true(index_map.numel != x.numel()):
        raise KernelInputError(
            f"the IndexMap covers {index_map.numel} local elements but x has {x.numel()} "
            f"(shape {tuple(x.shape)}); its extents must multiply to x.numel()"
        )
