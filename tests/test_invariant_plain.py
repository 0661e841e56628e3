"""invariant_random() on plain tensors: one device draws what any DTensor placement draws.

Claim: under ``invariant_random()`` every routed dropout and init op on a plain tensor gives
bitwise the full tensor the same op gives on a DTensor of any placements (1-D and 2-D
meshes, FSDP-style strided shards), from the same generator state, and leaves the generator
in the same state - in the default init mode (keyed: O(local shard), nothing drawn) and in
the opt-in full-tensor mode (torch's values); ops without an invariant route are a typed
error on a DTensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rng_tracker.errors import (
    InvariantRandomConfigError,
    InvariantRandomUnsupportedError,
    RNGTrackerError,
)
from rng_tracker.kernels import dropout as kernel_dropout
from rng_tracker.parallel.dtensor import (
    disable_invariant_random,
    enable_invariant_random,
    invariant_random,
)


def _ops() -> dict[str, object]:
    """name -> op(x) for each routed random op; x is (4, 6, 8), float32."""
    return {
        "F.dropout": lambda x: F.dropout(x, 0.3),
        "nn.Dropout": lambda x: torch.nn.Dropout(0.4)(x),
        "torch.dropout": lambda x: torch.dropout(x, 0.5, True),
        "dropout1d": lambda x: F.dropout1d(x, 0.5),
        "dropout2d": lambda x: F.dropout2d(x.unsqueeze(-1), 0.5).squeeze(-1),
        "dropout3d": lambda x: F.dropout3d(x.unsqueeze(-1).unsqueeze(-1), 0.5).flatten(2),
        "alpha_dropout": lambda x: F.alpha_dropout(x, 0.2, training=True),
        "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x, 0.2, training=True),
        "bernoulli_": lambda x: torch.empty_like(x).bernoulli_(0.7),
        "uniform_": lambda x: torch.nn.init.uniform_(torch.empty_like(x), -2.0, 3.0),
        "normal_": lambda x: torch.nn.init.normal_(torch.empty_like(x), 0.5, 2.0),
        "trunc_normal_": lambda x: torch.nn.init.trunc_normal_(torch.empty_like(x), std=0.02),
        # torch's rejection samplers: resample while mask.any() (made global on a DTensor)
        "trunc_normal_ resampled": lambda x: torch.nn.init.trunc_normal_(
            torch.empty_like(x), a=-1.0, b=1.0
        ),
        "trunc_normal_ narrow": lambda x: torch.nn.init.trunc_normal_(
            torch.empty_like(x), a=-0.2, b=0.2
        ),
        "kaiming_uniform_": lambda x: torch.nn.init.kaiming_uniform_(torch.empty_like(x), a=1.0),
        "kaiming_normal_": lambda x: torch.nn.init.kaiming_normal_(torch.empty_like(x)),
        "xavier_uniform_": lambda x: torch.nn.init.xavier_uniform_(torch.empty_like(x)),
        "xavier_normal_": lambda x: torch.nn.init.xavier_normal_(torch.empty_like(x)),
        "Tensor.uniform_": lambda x: torch.empty_like(x).uniform_(-1.0, 1.0),
        "Tensor.normal_": lambda x: torch.empty_like(x).normal_(1.0, 0.5),
    }


_INIT_OPS = frozenset(
    {
        "uniform_",
        "normal_",
        "trunc_normal_",
        "trunc_normal_ resampled",
        "trunc_normal_ narrow",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "Tensor.uniform_",
        "Tensor.normal_",
    }
)


def test_plain_dropout_is_the_invariant_kernel_and_init_full_is_torch() -> None:
    """On a plain tensor, F.dropout draws rng_tracker.kernels.dropout's mask (torch's own
    F.dropout draws another), and init="full" draws torch's own values."""
    x = torch.randn(64, 32)
    torch.manual_seed(5)
    want = kernel_dropout(x, 0.3)
    want_state = torch.get_rng_state()
    torch.manual_seed(5)
    with invariant_random(init="full"):
        got = F.dropout(x, 0.3)
        assert torch.equal(torch.get_rng_state(), want_state)
        init = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02)
    torch.manual_seed(5)
    assert not torch.equal(F.dropout(x, 0.3), got)  # torch's own mask is another one
    torch.manual_seed(5)
    kernel_dropout(x, 0.3)
    assert torch.equal(got, want)
    assert torch.equal(init, torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02))


def test_the_default_init_is_keyed_and_draws_nothing() -> None:
    """The default init mode is keyed: with no model= it keys each draw by its place among the
    block's init draws and the seed (torch.initial_seed() by default), computes in place, draws
    nothing from the generator, and is the same on every call order-alike block (not torch's
    values)."""
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with invariant_random():
        a = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03)
        b = torch.nn.init.normal_(torch.empty(16, 8))
        c = torch.nn.init.kaiming_uniform_(torch.empty(16, 8), a=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # keyed: nothing drawn
    with invariant_random(init="keyed", seed=5):
        again = [
            torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03),
            torch.nn.init.normal_(torch.empty(16, 8)),
            torch.nn.init.kaiming_uniform_(torch.empty(16, 8), a=1.0),
        ]
    for got, want in zip((a, b, c), again, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(a, b)  # distinct draws, distinct names
    assert a.abs().max() <= 0.03  # truncated to [a, b]
    torch.manual_seed(5)
    torch_values = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03)
    assert not torch.equal(a, torch_values)


def test_config_and_unsupported_errors_are_typed() -> None:
    with pytest.raises(InvariantRandomConfigError, match="init must be"):
        enable_invariant_random(init="sharded")  # type: ignore[arg-type]
    with pytest.raises(InvariantRandomConfigError, match="model must be an nn"):
        enable_invariant_random(model="model")  # type: ignore[arg-type]
    with pytest.raises(InvariantRandomConfigError, match="seed must be an int"):
        enable_invariant_random(torch.nn.Linear(2, 2), init="keyed", seed=-1)
    with pytest.raises(InvariantRandomConfigError, match="seed must be an int"):
        enable_invariant_random(seed=-1)
    with pytest.raises(InvariantRandomConfigError, match="seed= keys init='keyed' only"):
        enable_invariant_random(init="full", seed=3)
    disable_invariant_random()  # none of them was turned on: a no-op
    assert issubclass(InvariantRandomConfigError, RNGTrackerError)
    assert issubclass(InvariantRandomConfigError, ValueError)
    state = torch.get_rng_state()
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="float p"):
        torch.empty(4).bernoulli_(torch.full((4,), 0.5))
    assert torch.equal(torch.get_rng_state(), state)
    assert issubclass(InvariantRandomUnsupportedError, TypeError)


@pytest.mark.distributed(world_size=4, timeout=300)
def test_one_device_equals_any_mesh(rank: int) -> None:
    """Every routed op on a plain tensor == the same op on DTensors over (4,) and (2, 2) meshes
    (Shard, Replicate, FSDP-style _StridedShard + Shard): gathered bitwise, and the same
    generator state after; init="keyed" too; unrouted random ops on a DTensor are refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    meshes = {s: init_device_mesh("cpu", s) for s in [(4,), (2, 2)]}
    layouts = [
        ((4,), [Shard(0)]),
        ((4,), [Shard(2)]),
        ((4,), [Replicate()]),
        ((2, 2), [Shard(1), Shard(2)]),
        ((2, 2), [_StridedShard(2, split_factor=2), Shard(2)]),
    ]
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) / 7.0 + 0.5
    for name, op in _ops().items():
        # the init ops in both init modes: keyed (the default) and full; dropout has one
        for init in ("keyed", "full") if name in _INIT_OPS else ("keyed",):
            torch.manual_seed(11)
            with invariant_random(init=init):
                want = op(base.clone())
            want_state = torch.get_rng_state()
            # full: the 2-D mesh layouts only (it has its own DTensor-op tests, test_dtensor.py)
            for mesh_shape, placements in layouts if init == "keyed" else layouts[3:]:
                x = distribute_tensor(base.clone(), meshes[mesh_shape], placements)
                torch.manual_seed(11)
                with invariant_random(init=init):
                    got = op(x)
                assert torch.equal(got.full_tensor(), want), (name, init, mesh_shape, placements)
                assert torch.equal(torch.get_rng_state(), want_state), (name, init, placements)

    # keyed init: the plain module and its DTensor-sharded twin hold the same values
    model = torch.nn.Linear(8, 12)
    with invariant_random(model, init="keyed", seed=7):
        model.reset_parameters()
    weight_layouts = [
        ((4,), [Shard(1)]),
        ((2, 2), [Shard(0), Shard(1)]),
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ]
    for mesh_shape, placements in weight_layouts:
        sharded = torch.nn.Linear(8, 12)
        sharded.weight = torch.nn.Parameter(
            distribute_tensor(sharded.weight.detach(), meshes[mesh_shape], placements)
        )
        state = torch.get_rng_state()
        with invariant_random(sharded, init="keyed", seed=7):
            sharded.reset_parameters()
        assert torch.equal(torch.get_rng_state(), state)  # keyed: nothing drawn
        assert torch.equal(sharded.weight.full_tensor(), model.weight)
        assert torch.equal(sharded.bias, model.bias)

    x = distribute_tensor(base.clone(), meshes[(4,)], [Shard(0)])
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="exponential_"):
        x.exponential_()
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="rand_like"):
        torch.rand_like(x)
