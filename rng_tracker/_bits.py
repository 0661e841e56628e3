"""64-bit integer helpers of keyed randomness: the key mix and the signed-64 cast.

Keyed dropout (``_keyed``) and keyed init (``kernels._keyed_fill``) both turn a user's seed into
a 64-bit Philox key with :func:`mix_key`, each under its own domain constant, so the two never
share a key; an int64 tensor holds such a key (or any value in [0, 2**64)) as
:func:`signed64` of it.
"""

from __future__ import annotations

MASK64 = 2**64 - 1


def mix_key(seed: int, domain: int) -> int:
    """The 64-bit Philox key of ``seed`` in [0, 2**64): splitmix64's finaliser of ``seed ^ domain``.

    A bijection of [0, 2**64) (xorshifts and odd multiplies are invertible), so distinct seeds
    never share a key; ``domain`` keeps the keys of different uses apart.
    """
    z = (seed ^ domain) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def signed64(value: int) -> int:
    """``value`` in [0, 2**64) as the int64 of the same 64 bits (what an int64 tensor stores)."""
    return value - 2**64 if value >= 2**63 else value
