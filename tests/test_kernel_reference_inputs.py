"""The public reference definition (rng_tracker.kernels.reference and .philox) checks its input:
p as the kernels check it, seeds, index maps, Philox keys, counters and rounds; each a typed
error, and valid input gives what it always gave."""

from __future__ import annotations

import math

import pytest
import torch

from rng_tracker.errors import KernelInputError, KernelInputTypeError, RNGTrackerError
from rng_tracker.kernels import IndexMap
from rng_tracker.kernels.philox import philox4x32
from rng_tracker.kernels.reference import (
    fused_dropout_reference,
    keep_mask,
    keep_scale,
    keep_threshold,
)

SEED = torch.tensor([1, 0, 5, 0])
MAP = IndexMap(0, ((32, 1),), 32)
COUNTERS = torch.zeros(4, dtype=torch.int64)
X = torch.ones(8, 4)
CPU = torch.device("cpu")

_BAD = [
    (lambda: keep_threshold(float("nan")), KernelInputError, r"\[0, 1\], got nan"),
    (lambda: keep_threshold(2.0), KernelInputError, r"\[0, 1\], got 2.0"),
    (lambda: keep_threshold("0.5"), KernelInputTypeError, "p must be a float, got str"),
    (lambda: keep_threshold(True), KernelInputTypeError, "p must be a float, got bool"),
    (lambda: keep_scale(float("nan")), KernelInputError, r"\[0, 1\], got nan"),
    (lambda: keep_scale(-1.0), KernelInputError, r"\[0, 1\], got -1.0"),
    (lambda: keep_mask(SEED, 0.5, "map", CPU), KernelInputTypeError, "index_map must be an"),
    (lambda: keep_mask(SEED[:3], 0.5, MAP, CPU), KernelInputError, "4 words"),
    (lambda: keep_mask(SEED.int(), 0.5, MAP, CPU), KernelInputError, "int64 tensor of 4 words"),
    (lambda: keep_mask([1, 0, 0, 0], 0.5, MAP, CPU), KernelInputTypeError, "seed must be"),
    (lambda: keep_mask(SEED, 1.5, MAP, CPU), KernelInputError, r"\[0, 1\], got 1.5"),
    (lambda: keep_mask(SEED, 0.5, MAP, "cpu"), KernelInputTypeError, "device must be"),
    (
        lambda: fused_dropout_reference(X, None, None, SEED, 1.5, MAP),
        KernelInputError,
        r"\[0, 1\], got 1.5",
    ),
    (
        lambda: fused_dropout_reference(X, None, None, SEED, 0.5, IndexMap(0, ((16, 1),), 16)),
        KernelInputError,
        "covers 16 local elements but x has 32",
    ),
    (
        lambda: fused_dropout_reference(X, torch.ones(3), None, SEED, 0.5, MAP),
        KernelInputError,
        r"bias must have shape \(4,\)",
    ),
    (
        lambda: fused_dropout_reference(X, None, torch.ones(4), SEED, 0.5, MAP),
        KernelInputError,
        r"residual must have shape \(8, 4\)",
    ),
    (
        lambda: fused_dropout_reference("x", None, None, SEED, 0.5, MAP),
        KernelInputTypeError,
        "x must be a tensor",
    ),
    (lambda: philox4x32((1, 2), [0, 0, 0, 0]), KernelInputTypeError, "counters must be"),
    (
        lambda: philox4x32((1, 2), torch.zeros(3, dtype=torch.int64)),
        KernelInputError,
        "last dim of 4",
    ),
    (lambda: philox4x32((1, 2), torch.full((4,), 0.5)), KernelInputError, "integer tensor"),
    (
        lambda: philox4x32((1, 2), torch.full((4,), -1)),
        KernelInputError,
        r"32-bit words in \[0, 2\*\*32\), got values in \[-1, -1\]",
    ),
    (lambda: philox4x32((1, 2), torch.full((4,), 2**32)), KernelInputError, "32-bit words"),
    (lambda: philox4x32((1, 2), COUNTERS, rounds=-3), KernelInputError, "rounds must be >= 0"),
    (lambda: philox4x32((1, 2), COUNTERS, rounds=2.5), KernelInputTypeError, "rounds must be"),
    (lambda: philox4x32((1, 2), COUNTERS, rounds=True), KernelInputTypeError, "bool True"),
    (lambda: philox4x32((1,), COUNTERS), KernelInputTypeError, "key must be a pair"),
    (lambda: philox4x32(5, COUNTERS), KernelInputTypeError, "key must be a pair"),
    (lambda: philox4x32((1, 2**32), COUNTERS), KernelInputError, r"key\[1\] must be in"),
    (lambda: philox4x32((1.0, 2), COUNTERS), KernelInputTypeError, r"key\[0\] must be an int"),
    (lambda: philox4x32(torch.tensor([1, 2, 3]), COUNTERS), KernelInputError, "last dim of 2"),
    (
        lambda: philox4x32(torch.tensor([1, -2]), COUNTERS),
        KernelInputError,
        "key must hold 32-bit words",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), _BAD)
def test_bad_reference_input_is_typed_and_draws_nothing(call, error, match) -> None:
    before = torch.get_rng_state()
    with pytest.raises(error, match=match) as info:
        call()
    builtin = TypeError if error is KernelInputTypeError else ValueError
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert torch.equal(torch.get_rng_state(), before)


def test_valid_reference_input_gives_what_it_gave() -> None:
    assert keep_threshold(0.0) == 0 and keep_threshold(0.5) == 2**31
    assert keep_threshold(1.0) == 2**32 and keep_threshold(1) == 2**32
    assert keep_scale(0.5) == 2.0 and keep_scale(1.0) == 0.0 and keep_scale(0) == 1.0
    assert keep_scale(0.1) == torch.tensor(1 / 0.9, dtype=torch.float32).item()
    assert keep_threshold(0.3) == math.ceil(0.3 * 2**32)
    counters = torch.tensor([[1, 2, 3, 4], [2**32 - 1, 0, 7, 9]])
    words = philox4x32((5, 6), counters)
    assert torch.equal(words, philox4x32(torch.tensor([5, 6]), counters))
    assert torch.equal(words[:1], philox4x32((5, 6), counters[:1].int(), rounds=10))
    assert torch.equal(philox4x32((5, 6), counters, rounds=0), counters)
    assert philox4x32((5, 6), torch.zeros(0, 4, dtype=torch.int64)).shape == (0, 4)
    mask = keep_mask(SEED, 0.5, MAP, CPU)
    out = fused_dropout_reference(X, None, None, SEED, 0.5, MAP)
    assert torch.equal(out, torch.where(mask.view(8, 4), 2.0, 0.0))
