"""Layout-invariant random ops on DTensors (rng_tracker.parallel.dtensor).

Invariant: for any mesh and placements, the gathered result of an op on a DTensor equals
bitwise the same op on the full tensor from the same generator state, and every rank's
generator ends where the full op leaves it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from rng_tracker.errors import DTensorPlacementError
from rng_tracker.kernels import IndexMap
from rng_tracker.parallel._placement import local_index

# --- pure part: placements + mesh + global shape -> this rank's index lists -----------

_PURE_PLACEMENTS = [Shard(0), Shard(1), Shard(2), Replicate(), _StridedShard(0, split_factor=2)]


def _torch_local(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The local tensor as torch's own placement code cuts it (left to right over mesh axes)."""
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = placement._split_tensor(local, mesh_shape[axis], with_padding=False)
            local = pieces[coordinate[axis]]
    return local


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3, 2), (2, 2, 2)])
@pytest.mark.parametrize("global_shape", [(8, 12, 4), (7, 5, 3), (3, 10, 1), (1, 2, 9)])
def test_local_index_matches_torch_split(mesh_shape, global_shape) -> None:
    """The index lists select exactly the elements torch's Shard/_StridedShard split gives each rank."""
    full = torch.arange(torch.Size(global_shape).numel()).reshape(global_shape)
    for placements in itertools.product(_PURE_PLACEMENTS, repeat=len(mesh_shape)):
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            expected = _torch_local(full, mesh_shape, coordinate, placements)
            index = local_index(global_shape, mesh_shape, coordinate, placements)
            got = full[
                torch.meshgrid(
                    *(torch.tensor(i, dtype=torch.long) for i in index.indices), indexing="ij"
                )
            ]
            assert index.local_shape == tuple(expected.shape), (placements, coordinate)
            assert torch.equal(got, expected), (placements, coordinate)
            affine = index.affine()  # full holds global flat indices: got is the map itself
            if affine is not None and got.numel():
                index_map = IndexMap(offset=affine[0], dims=affine[1], logical_numel=full.numel())
                assert torch.equal(index_map.global_index(torch.arange(got.numel())), got.flatten())
            # the boxes tile the local tensor: each box is a contiguous block of the logical one
            for slices, region in index.boxes():
                assert region.global_shape == tuple(full.shape)
                extents = [cut.stop - cut.start for cut in slices]
                block = full[tuple(slice(o, o + e) for o, e in zip(region.offset, extents))]
                assert torch.equal(block, expected[slices])


def test_strided_shards_take_the_affine_map_or_boxes() -> None:
    """Even strided shards are one affine map; uneven ones (runs of two lengths) are boxes."""
    even = local_index((8, 3), (4,), (1,), [_StridedShard(0, split_factor=2)])
    assert even.indices[0] == (1, 5)
    assert even.affine() == (3, ((2, 12), (1, 3), (3, 1)))
    uneven = local_index((7, 3), (2,), (1,), [_StridedShard(0, split_factor=2)])
    assert uneven.indices[0] == (2, 3, 6)
    assert uneven.affine() is None
    assert [(slices, region.offset) for slices, region in uneven.boxes()] == [
        ((slice(0, 2), slice(0, 3)), (2, 0)),
        ((slice(2, 3), slice(0, 3)), (6, 0)),
    ]


def test_local_index_refuses_unknown_placements() -> None:
    """A placement the library cannot place is a typed error, not a guess."""
    with pytest.raises(DTensorPlacementError, match="is not Shard, _StridedShard"):
        local_index((4, 4), (2,), (0,), [object()])
    with pytest.raises(DTensorPlacementError, match="placements for a 2-axis mesh"):
        local_index((4, 4), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(DTensorPlacementError, match="shards dim 2"):
        local_index((4, 4), (2,), (0,), [Shard(2)])


# --- the ops on 4 gloo ranks ----------------------------------------------------------

_P = 0.3
_SHAPES = [(8, 12), (7, 5)]  # even, and uneven (a rank of a 4-way split of 5 is empty)
_DTYPES = [torch.float32, torch.bfloat16]


def _layouts() -> list[tuple[tuple[int, ...], tuple]]:
    from torch.distributed.tensor import Partial

    basic = [Shard(0), Shard(1), Replicate(), Partial()]
    one_d = [(p,) for p in basic] + [(_StridedShard(0, split_factor=2),)]
    two_d = [
        *itertools.product(basic, repeat=2),
        (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP2 (dp) + TP (tp) on one dim
        (_StridedShard(1, split_factor=2), Shard(1)),
        (_StridedShard(0, split_factor=2), Replicate()),  # uneven: runs of 2 and 1 rows
    ]
    return [((4,), p) for p in one_d] + [((2, 2), p) for p in two_d]


def _make(full: torch.Tensor, mesh, placements, parts: list[torch.Tensor] | None = None):
    """A DTensor of ``full`` (``parts``: the Partial summands, one per rank) as a grad leaf."""
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    kept = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = distribute_tensor(full, mesh, kept, src_data_rank=None).to_local()
    if parts is not None and any(isinstance(p, Partial) for p in placements):
        # coordinate along the Partial axes picks this rank's summand
        coord = mesh.get_coordinate()
        flat = 0
        for axis, p in enumerate(placements):
            if isinstance(p, Partial):
                flat = flat * mesh.size(axis) + coord[axis]
        whole = distribute_tensor(parts[flat], mesh, kept, src_data_rank=None).to_local()
        local = whole
    out = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
    return out.detach().requires_grad_()


def _summands(shape, dtype, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    # halves in [-4, 4): every sum of up to 4 of them is exact in bf16 and fp32
    return [(torch.randint(-8, 8, shape, generator=gen) / 2).to(dtype) for _ in range(count)]


def _check_op(name, mesh, placements, shape, dtype, gen) -> None:
    from torch.distributed.tensor import Partial, distribute_tensor

    from rng_tracker import kernels
    from rng_tracker.parallel import dtensor as dt

    n_partial = math.prod(mesh.size(a) for a, p in enumerate(placements) if isinstance(p, Partial))
    parts = _summands(shape, dtype, n_partial, gen)
    full = parts[0].clone()
    for part in parts[1:]:
        full = full + part
    case = (name, placements, shape, dtype)
    if name in ("uniform_", "normal_"):
        t = _make(torch.zeros(shape, dtype=dtype), mesh, placements).detach()
        start = torch.get_rng_state()
        (dt.uniform_(t, -0.5, 2.0) if name == "uniform_" else dt.normal_(t, 0.5, 2.0))
        after = torch.get_rng_state()
        torch.set_rng_state(start)
        ref = torch.empty(shape, dtype=dtype)
        ref.uniform_(-0.5, 2.0) if name == "uniform_" else ref.normal_(0.5, 2.0)
        assert torch.equal(t.full_tensor(), ref), case
        assert torch.equal(after, torch.get_rng_state()), case
        return
    x = _make(full, mesh, placements, parts)
    assert torch.equal(x.full_tensor(), full), case
    residual_full = torch.randn(shape, generator=gen).to(dtype)
    bias_full = torch.randn(shape[-1:], generator=gen).to(dtype)
    grad_full = torch.randn(shape, generator=gen).to(dtype)
    ref_x = full.clone().requires_grad_()
    ref_bias = bias_full.clone().requires_grad_()
    ref_residual = residual_full.clone().requires_grad_()
    start = torch.get_rng_state()
    if name == "dropout":
        out = dt.dropout(x, _P)
    else:  # bias sharded over the last mesh axis, residual replicated: both get re-placed
        bias = distribute_tensor(bias_full, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
        residual = distribute_tensor(residual_full, mesh, [Replicate()] * mesh.ndim)
        bias, residual = bias.detach().requires_grad_(), residual.detach().requires_grad_()
        out = dt.bias_dropout_add(x, bias, residual, _P)
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    if name == "dropout":
        ref = kernels.dropout(ref_x, _P)
    else:
        ref = kernels.bias_dropout_add(ref_x, ref_bias, ref_residual, _P)
    assert torch.equal(after, torch.get_rng_state()), case
    assert torch.equal(out.full_tensor(), ref), case
    out.backward(distribute_tensor(grad_full, mesh, out.placements, src_data_rank=None))
    ref.backward(grad_full)
    assert torch.equal(x.grad.full_tensor(), ref_x.grad), case
    if name == "bias_dropout_add":
        assert torch.equal(residual.grad.full_tensor(), ref_residual.grad), case
        # the bias gradient sums over rows that other ranks hold: equal up to summation order
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(bias.grad.full_tensor(), ref_bias.grad, rtol=tol, atol=tol)


@pytest.mark.distributed(world_size=4, timeout=300)
def test_ops_gathered_equal_full_tensor_ops(rank: int) -> None:
    """dropout/bias_dropout_add/uniform_/normal_ on every layout gather to the full-tensor op, bitwise, gradients too."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {s: init_device_mesh("cpu", s) for s in [(4,), (2, 2)]}
    gen = torch.Generator().manual_seed(7)  # same data on every rank
    for (mesh_shape, placements), shape, dtype in itertools.product(_layouts(), _SHAPES, _DTYPES):
        for name in ("dropout", "bias_dropout_add", "uniform_", "normal_"):
            torch.manual_seed(100)  # one stream on all ranks
            _check_op(name, meshes[mesh_shape], placements, shape, dtype, gen)


# --- invariant_random(): torch's own calls routed on DTensors --------------------------


def test_mode_sees_every_routed_function() -> None:
    """Guard against torch changes: each routed function still reaches a torch function mode.
    On plain tensors the init routes (init="full") run torch's own op (same values, same
    generator state); the dropout routes run the layout-invariant kernel
    (tests/test_invariant_plain.py checks their values)."""
    import torch.nn.functional as F

    from rng_tracker.parallel.dtensor import _ROUTES, _InvariantRandomMode

    seen = []

    class Recording(_InvariantRandomMode):
        def __init__(self) -> None:
            super().__init__(init="full")  # the opt-in mode whose init is torch's own

        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    def inits() -> list[torch.Tensor]:
        return [
            torch.nn.init.uniform_(torch.empty(64), -1.0, 1.0),
            torch.nn.init.normal_(torch.empty(64), 0.0, 2.0),
            torch.nn.init.kaiming_uniform_(torch.empty(8, 8), a=0.5),
            torch.empty(64).uniform_(-1.0, 1.0),
            torch.empty(64).normal_(0.0, 2.0),
        ]

    def drops() -> None:
        x = torch.ones(4, 8, 6)
        F.dropout(x, 0.5)
        torch.nn.Dropout(0.5)(x)
        torch.dropout(x, 0.5, True)
        F.dropout1d(x, 0.5)
        F.dropout2d(x.unsqueeze(-1), 0.5)
        F.dropout3d(x.unsqueeze(-1).unsqueeze(-1), 0.5)
        F.alpha_dropout(x, 0.5, training=True)
        F.feature_alpha_dropout(x, 0.5, training=True)
        torch.empty(8).bernoulli_(0.5)

    torch.manual_seed(3)
    expected = inits()
    state = torch.get_rng_state()
    torch.manual_seed(3)
    with Recording():
        got = inits()
        assert torch.equal(torch.get_rng_state(), state)
        drops()
    assert set(_ROUTES) <= set(seen), set(_ROUTES) - set(seen)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_enable_disable_pair_keeps_the_mode_stack() -> None:
    """enable/disable push and pop exactly one mode, idempotently, and refuse to pop another mode."""
    from torch.overrides import TorchFunctionMode, _len_torch_function_stack

    from rng_tracker.errors import InvariantRandomModeError
    from rng_tracker.parallel.dtensor import (
        disable_invariant_random,
        enable_invariant_random,
        invariant_random,
    )

    base = _len_torch_function_stack()
    enable_invariant_random()
    enable_invariant_random()
    assert _len_torch_function_stack() == base + 1
    with TorchFunctionMode(), pytest.raises(InvariantRandomModeError, match="exit it first"):
        disable_invariant_random()
    disable_invariant_random()
    disable_invariant_random()
    assert _len_torch_function_stack() == base
    with pytest.raises(ZeroDivisionError), invariant_random():
        assert _len_torch_function_stack() == base + 1
        _ = 1 / 0
    assert _len_torch_function_stack() == base


def test_plain_tensors_are_a_typed_error_and_draw_nothing() -> None:
    """The DTensor ops refuse plain tensors before anything is drawn."""
    from rng_tracker.errors import DTensorInputTypeError
    from rng_tracker.parallel import dtensor as dt

    state = torch.get_rng_state()
    x = torch.ones(4, 4)
    for call in (
        lambda: dt.dropout(x, 0.5),
        lambda: dt.bias_dropout_add(x, None, x, 0.5),
        lambda: dt.uniform_(x),
        lambda: dt.normal_(x),
    ):
        with pytest.raises(DTensorInputTypeError, match="must be a DTensor"):
            call()
    assert torch.equal(torch.get_rng_state(), state)


class _Block(torch.nn.Module):
    """A pre-norm MLP block with dropout on the normed input, the hidden and the output."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        self.drop_in = torch.nn.Dropout(_P)
        self.drop_mid = torch.nn.Dropout(_P)
        self.drop_out = torch.nn.Dropout(_P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, hidden)
        y = self.drop_in(self.norm(x))
        y = self.drop_mid(torch.nn.functional.gelu(self.up(y)))  # (batch, seq, 2 hidden)
        return x + self.drop_out(self.down(y))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.up.reset_parameters()  # nn.init.kaiming_uniform_ and nn.init.uniform_
        torch.nn.init.xavier_normal_(self.down.weight)  # Tensor.normal_ inside
        torch.nn.init.trunc_normal_(self.down.bias, std=0.5)  # Tensor.uniform_, then pointwise
        self.norm.weight.normal_(1.0, 0.1)  # Tensor.normal_ directly
        torch.nn.init.normal_(self.norm.bias, 0.0, 0.5)


class _KernelDropout(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rng_tracker import kernels

        return kernels.dropout(x, self.p)


def _record_masks(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    masks = []

    def hook(module, inputs, output) -> None:
        full = output.full_tensor() if isinstance(output, DTensor) else output
        masks.append((full != 0).detach())

    for name, module in model.named_children():
        if name.startswith("drop"):
            module.register_forward_hook(hook)
    return masks


@pytest.mark.distributed(world_size=4, timeout=300)
def test_invariant_random_on_a_parallelized_module(rank: int) -> None:
    """Under invariant_random() a parallelize_module TP+SP block inits (in the default keyed
    mode and in the full mode, which is torch's own init) and drops exactly as the unsharded
    block with the fused kernel; outside it, torch's own DTensor randomness runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.overrides import _len_torch_function_stack

    from rng_tracker.parallel import dtensor as dt

    mesh = init_device_mesh("cpu", (4,))
    hidden = 8
    model = _Block(hidden)
    reference = _Block(hidden)
    for name in ("drop_in", "drop_mid", "drop_out"):
        setattr(reference, name, _KernelDropout(_P))
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    # the default (keyed) init: the unsharded block under the same mode, nothing drawn
    torch.manual_seed(11)
    with dt.invariant_random():
        model.init_weights()
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(11).get_state())
    with dt.invariant_random():
        reference.init_weights()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.full_tensor(), theirs), name
    # init="full": torch's own init of the unsharded block, from the same generator state
    torch.manual_seed(11)
    with dt.invariant_random(init="full"):
        model.init_weights()
    after_init = torch.get_rng_state()
    torch.manual_seed(11)
    reference.init_weights()
    assert torch.equal(torch.get_rng_state(), after_init)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.full_tensor(), theirs), name

    x_full = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(5))
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    ours_masks, ref_masks = _record_masks(model), _record_masks(reference)
    torch.manual_seed(12)
    with dt.invariant_random():
        out = model(x)
    after = torch.get_rng_state()
    torch.manual_seed(12)
    ref = reference(x_full)
    assert torch.equal(torch.get_rng_state(), after)
    assert len(ours_masks) == 3
    for site, (a, b) in enumerate(zip(ours_masks, ref_masks, strict=True)):
        assert torch.equal(a, b), site
    # the row-parallel matmul sums over shards: values agree up to summation order
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-5)

    # Outside the mode: torch's DTensor dropout, untouched. On a CPU mesh it runs the
    # local op on every shard from the same generator state (pytorch#138329).
    assert _len_torch_function_stack() == 0
    y = distribute_tensor(torch.ones(4, 8), mesh, [Shard(0)])
    torch.manual_seed(13)
    torch_out = torch.nn.functional.dropout(y, _P)
    torch.manual_seed(13)
    assert torch.equal(torch_out.to_local(), torch.nn.functional.dropout(torch.ones(1, 8), _P))
    torch.manual_seed(13)
    with dt.invariant_random():
        ours_out = torch.nn.functional.dropout(y, _P)
    assert not torch.equal(ours_out.full_tensor(), torch_out.full_tensor())
    torch.manual_seed(13)
    z = y.clone()
    with dt.invariant_random():
        same = torch.nn.functional.dropout(z, _P, inplace=True)
        state = torch.get_rng_state()
        assert torch.nn.Dropout(_P).eval()(y) is y  # eval draws nothing, returns x
        assert torch.equal(torch.get_rng_state(), state)
    assert same is z
    assert torch.equal(z.full_tensor(), ours_out.full_tensor())

    # bias None; a Partial("max") init (every rank holds the draw)
    from rng_tracker import kernels

    torch.manual_seed(14)
    got = dt.bias_dropout_add(y, None, y, _P).full_tensor()
    torch.manual_seed(14)
    assert torch.equal(got, kernels.bias_dropout_add(torch.ones(4, 8), None, torch.ones(4, 8), _P))
    peak = DTensor.from_local(torch.zeros(3, 5), mesh, [Partial("max")])
    torch.manual_seed(15)
    dt.normal_(peak)
    torch.manual_seed(15)
    assert torch.equal(peak.full_tensor(), torch.empty(3, 5).normal_())

    # What cannot be placed exactly is a typed error, and draws nothing.
    from rng_tracker.errors import DTensorPlacementError, RNGConsistencyError

    dt.assert_same_generator_state(mesh)
    torch.manual_seed(rank)
    with pytest.raises(RNGConsistencyError, match="differs across mesh"):
        dt.assert_same_generator_state(mesh)

    state = torch.get_rng_state()
    avg = DTensor.from_local(torch.zeros(2, 2), mesh, [Partial("avg")])
    with pytest.raises(DTensorPlacementError, match="Partial"):
        dt.normal_(avg)
    lying = DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)], shape=(8, 2), stride=(2, 1))
    with pytest.raises(DTensorPlacementError, match="does not describe its shards"):
        dt.dropout(lying, _P)
    assert torch.equal(torch.get_rng_state(), state)
