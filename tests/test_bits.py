"""rng_tracker/_bits.py: the one key mix and the one signed-64 cast of keyed randomness.

Invariants: ``mix_key`` is a bijection of [0, 2**64) for each domain (checked by inverting it
step by step), and keyed dropout's and keyed init's keys are both ``mix_key`` of the seed, each in
its own domain, so the two never share a key; ``signed64`` stores the same 64 bits an int64
tensor holds (checked against torch's own reinterpretation of uint64 bits).
"""

from __future__ import annotations

import random

import torch

from rng_tracker import KeyedRNG
from rng_tracker._bits import MASK64, mix_key, signed64
from rng_tracker.kernels._keyed_fill import init_key

_DROPOUT_DOMAIN = 0x6B65796564524E47  # b"keyedRNG", rng_tracker/_keyed.py
_INIT_DOMAIN = 0x6B65796564494E49  # b"keyedINI", rng_tracker/kernels/_keyed_fill.py
_EDGES = (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)


def _unshift(z: int, shift: int) -> int:
    """The inverse of ``z ^ (z >> shift)`` on 64 bits."""
    x = z
    for _ in range(64 // shift + 1):
        x = z ^ (x >> shift)
    return x & MASK64


def _unmix(key: int, domain: int) -> int:
    """splitmix64's finaliser run backwards (its multipliers are odd, so invertible mod 2**64)."""
    z = _unshift(key, 31)
    z = _unshift((z * pow(0x94D049BB133111EB, -1, 2**64)) & MASK64, 27)
    z = _unshift((z * pow(0xBF58476D1CE4E5B9, -1, 2**64)) & MASK64, 30)
    return z ^ domain


def test_mix_key_is_a_bijection_in_each_domain() -> None:
    """Every seed comes back from its key (so distinct seeds never share a key), the key is in
    [0, 2**64), and the same seed gets different keys in different domains."""
    rng = random.Random(7)
    seeds = [*_EDGES, *(rng.getrandbits(64) for _ in range(200))]
    for domain in (0, _DROPOUT_DOMAIN, _INIT_DOMAIN):
        for seed in seeds:
            key = mix_key(seed, domain)
            assert 0 <= key <= MASK64
            assert _unmix(key, domain) == seed
    assert all(mix_key(s, 1) != mix_key(s, 2) for s in seeds)


def test_keyed_dropout_and_keyed_init_keys_are_the_one_mix_in_two_domains() -> None:
    """KeyedRNG's Philox key (word 0 of a site's seed tensor) and keyed init's key are both
    ``mix_key`` of the seed, each in its own domain, and never equal for the same seed."""
    for seed in (0, 1, 12345, 2**63, 2**64 - 1):
        rng = KeyedRNG(seed=seed)
        rng.register("site")
        dropout_key = int(rng.seed_tensor("site")[0])
        assert _unmix(dropout_key & MASK64, _DROPOUT_DOMAIN) == seed
        assert dropout_key == signed64(mix_key(seed, _DROPOUT_DOMAIN))
        init = init_key(seed)
        assert _unmix(init, _INIT_DOMAIN) == seed
        assert init == mix_key(seed, _INIT_DOMAIN)
        assert init != dropout_key & MASK64


def test_signed64_is_the_int64_view_of_the_same_bits() -> None:
    """``signed64(v)`` equals what an int64 tensor reads from v's 64 bits (torch's uint64 ->
    int64 reinterpretation), at the edges and on random values."""
    rng = random.Random(11)
    values = [*_EDGES, *(rng.getrandbits(64) for _ in range(200))]
    as_uint64 = torch.tensor(values, dtype=torch.uint64)
    assert as_uint64.view(torch.int64).tolist() == [signed64(v) for v in values]
