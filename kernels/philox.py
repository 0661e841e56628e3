"""Philox4x32 in plain torch: the reference every dropout kernel is tested against.

32-bit words are held in int64 tensors; 32x32→64-bit products are split into 16-bit
halves so nothing overflows int64. Runs on any device torch supports.
"""

from __future__ import annotations

import torch

from rng_tracker._validate import checked_int
from rng_tracker.errors import KernelInputError, KernelInputTypeError

__all__ = ["PHILOX_KEY_A", "PHILOX_KEY_B", "PHILOX_ROUND_A", "PHILOX_ROUND_B", "philox4x32"]

PHILOX_ROUND_A = 0xD2511F53  # multiplies counter word 0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplies counter word 2
PHILOX_KEY_A = 0x9E3779B9  # Weyl increments of the key
PHILOX_KEY_B = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * b, for a and b below 2**32."""
    low_part = b & 0xFFFF
    high_part = b >> 16
    lo = a * low_part  # < 2**48
    hi = a * high_part  # < 2**48
    mid = lo + ((hi & 0xFFFF) << 16)  # < 2**49
    return (hi >> 16) + (mid >> 32), mid & _MASK32


def philox4x32(
    key: tuple[int, int] | torch.Tensor, counters: torch.Tensor, rounds: int = 10
) -> torch.Tensor:
    """Philox4x32-``rounds`` of ``counters`` (…, 4) under ``key`` (k0, k1); returns (…, 4) words.

    ``key`` is a pair of ints or an int tensor broadcastable to (…, 2); words are int64
    tensors holding values in [0, 2**32). Word values are checked where that reads no device
    memory (CPU tensors, outside torch.compile).
    """
    counters = _checked_words("counters", counters, 4)
    rounds = checked_int(
        rounds, "rounds", type_error=KernelInputTypeError, value_error=KernelInputError, minimum=0
    )
    if isinstance(key, torch.Tensor):
        key = _checked_words("key", key, 2)
    elif isinstance(key, tuple | list) and len(key) == 2:
        key = tuple(
            checked_int(
                k,
                f"key[{i}]",
                type_error=KernelInputTypeError,
                value_error=KernelInputError,
                minimum=0,
                maximum=_MASK32,
            )
            for i, k in enumerate(key)
        )
    else:
        raise KernelInputTypeError(
            f"key must be a pair of 32-bit ints (k0, k1) or an int tensor of last dim 2, got "
            f"{type(key).__name__} {key!r}"
        )
    return philox4x32_unchecked(key, counters, rounds)


def _checked_words(name: str, words: object, last: int) -> torch.Tensor:
    """``words`` if it is an integer tensor of last dim ``last`` holding 32-bit words."""
    if not isinstance(words, torch.Tensor):
        raise KernelInputTypeError(
            f"{name} must be an int64 tensor of 32-bit words, got {type(words).__name__}"
        )
    if words.dtype.is_floating_point or words.dtype.is_complex or words.dtype == torch.bool:
        raise KernelInputError(f"{name} must be an integer tensor (int64), got {words.dtype}")
    if words.shape[-1:] != (last,):
        raise KernelInputError(
            f"{name} must have a last dim of {last}, got shape {tuple(words.shape)}"
        )
    if words.device.type == "cpu" and words.numel() and not torch.compiler.is_compiling():
        low, high = (int(v) for v in torch.aminmax(words.to(torch.int64)))
        if low < 0 or high > _MASK32:
            raise KernelInputError(
                f"{name} must hold 32-bit words in [0, 2**32), got values in [{low}, {high}]"
            )
    return words


def philox4x32_unchecked(
    key: tuple[int, int] | torch.Tensor, counters: torch.Tensor, rounds: int = 10
) -> torch.Tensor:
    """:func:`philox4x32` of arguments it would accept, unchecked (the kernels' hot path)."""
    counters = counters.to(torch.int64)
    c0, c1, c2, c3 = counters.unbind(-1)
    if isinstance(key, torch.Tensor):
        k0, k1 = key.to(device=counters.device, dtype=torch.int64).unbind(-1)
    else:
        k0 = torch.tensor(key[0] & _MASK32, dtype=torch.int64, device=counters.device)
        k1 = torch.tensor(key[1] & _MASK32, dtype=torch.int64, device=counters.device)
    for round_index in range(rounds):
        if round_index:
            k0 = (k0 + PHILOX_KEY_A) & _MASK32
            k1 = (k1 + PHILOX_KEY_B) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_ROUND_A, c0)
        hi1, lo1 = _mulhilo(PHILOX_ROUND_B, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)
