"""Layout-invariant random ops on DTensors (rng_tracker.parallel.dtensor).

Invariant: for any mesh and placements, the gathered result of an op on a DTensor equals
bitwise the same op on the full tensor from the same generator state, and every rank's
generator ends where the full op leaves it; keyed (``seed=``/``site=``), it equals the kernels'
keyed op on the full tensor and draws nothing. Plain tensors, placements the library cannot
place exactly, and arguments of a wrong type or value (bounds torch refuses, a site that is not
a name, a mesh that is not a DeviceMesh) are typed errors that draw nothing.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from rng_tracker.errors import DTensorPlacementError
from rng_tracker.parallel._placement import local_index_of

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
        _assert_bias_grad(bias.grad.full_tensor(), ref_bias.grad, placements, case)


def _assert_bias_grad(got, want, placements, case) -> None:
    """The bias gradient sums the output gradient over rows. Where x is sharded, each rank
    reduces its local block, whose shape steers the order of torch's sum, and the ranks' sums
    are then added: equal up to rounding. Where no rank holds a shard (replicated or partial
    x), each sums the whole tensor as the reference does: equal bit for bit."""
    from torch.distributed.tensor import Partial

    if not all(isinstance(p, (Replicate, Partial)) for p in placements):  # a Shard, strided too
        tol = 1e-5 if want.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:
        assert torch.equal(got, want), case


@pytest.mark.distributed(world_size=4, timeout=300)
def test_ops_gathered_equal_full_tensor_ops(rank: int) -> None:
    """dropout/bias_dropout_add/uniform_/normal_ on every layout gather to the full-tensor op,
    bitwise, gradients too (the bias gradient up to summation order where x is sharded: see
    :func:`_assert_bias_grad`); and the edge cases of :func:`_check_edges`."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {s: init_device_mesh("cpu", s) for s in [(4,), (2, 2)]}
    gen = torch.Generator().manual_seed(7)  # same data on every rank
    for (mesh_shape, placements), shape, dtype in itertools.product(_layouts(), _SHAPES, _DTYPES):
        for name in ("dropout", "bias_dropout_add", "uniform_", "normal_"):
            torch.manual_seed(100)  # one stream on all ranks
            _check_op(name, meshes[mesh_shape], placements, shape, dtype, gen)
    torch.manual_seed(100)
    _check_edges(meshes[(4,)], rank)


def _check_edges(mesh, rank: int) -> None:
    """A bias of None; a Partial("max") init (every rank holds the draw); the replicated-stream
    check; what cannot be placed exactly is a typed error and draws nothing."""
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from rng_tracker import kernels
    from rng_tracker.errors import KernelInPlaceError, RNGConsistencyError
    from rng_tracker.parallel import dtensor as dt

    y = distribute_tensor(torch.ones(4, 8), mesh, [Shard(0)])
    torch.manual_seed(14)
    got = dt.bias_dropout_add(y, None, y, _P).full_tensor()
    torch.manual_seed(14)
    assert torch.equal(got, kernels.bias_dropout_add(torch.ones(4, 8), None, torch.ones(4, 8), _P))
    # a 0-d DTensor is one element (it raised IndexError)
    three = torch.tensor(3.0)
    for seed in range(8):  # some keep it, some drop it
        scalar = distribute_tensor(three, mesh, [Replicate()])
        torch.manual_seed(seed)
        dropped = dt.dropout(scalar, 0.5).full_tensor()
        added = dt.bias_dropout_add(scalar, None, scalar, 0.5).full_tensor()
        torch.manual_seed(seed)
        assert torch.equal(dropped, kernels.dropout(three, 0.5))
        assert torch.equal(added, kernels.bias_dropout_add(three, None, three, 0.5))
    peak = DTensor.from_local(torch.zeros(3, 5), mesh, [Partial("max")])
    torch.manual_seed(15)
    dt.normal_(peak)
    torch.manual_seed(15)
    assert torch.equal(peak.full_tensor(), torch.empty(3, 5).normal_())

    # inplace=True: the result in x, x returned; a Partial("sum") x holds it as an init would
    full = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    mine = full.clone() if rank == 0 else torch.zeros(4, 8)
    for target in (
        distribute_tensor(full.clone(), mesh, [Shard(0)]),
        DTensor.from_local(mine, mesh, [Partial()], run_check=False),
    ):
        torch.manual_seed(16)
        written = dt.dropout(target, _P, True, True)
        torch.manual_seed(16)
        assert written is target and torch.equal(target.full_tensor(), kernels.dropout(full, _P))
    leaf = distribute_tensor(torch.ones(4, 8), mesh, [Shard(0)]).requires_grad_()
    state = torch.get_rng_state()
    with pytest.raises(KernelInPlaceError, match="leaf tensor that requires grad"):
        dt.dropout(leaf, _P, True, True)
    assert torch.equal(torch.get_rng_state(), state)

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


# --- keyed: seed= / site=, and region_of ---------------------------------------------


def _spread() -> list:
    """Every 1-d layout, and 2x2 layouts covering each placement kind and pair of dims."""
    keep = {
        "(Shard(dim=0), Shard(dim=1))",
        "(Shard(dim=1), Replicate())",
        "(Replicate(), Partial(sum))",
        "(Partial(sum), Shard(dim=0))",
        "(Partial(sum), Partial(sum))",
    }
    return [
        (mesh_shape, placements)
        for mesh_shape, placements in _layouts()
        if len(mesh_shape) == 1 or "Strided" in str(placements) or str(placements) in keep
    ]


def _check_keyed(mesh, placements, shape, gen) -> None:
    from torch.distributed.tensor import Partial, distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate

    from rng_tracker import get_keyed_rng, kernels
    from rng_tracker.errors import DTensorPlacementError
    from rng_tracker.parallel import dtensor as dt

    keyed = get_keyed_rng("cpu")
    seed = keyed.seed_tensor("block.3.attention")
    partial = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    parts = _summands(shape, torch.float32, math.prod(mesh.size(a) for a in partial), gen)
    full = sum(parts[1:], parts[0].clone())
    case = (placements, shape)
    x = _make(full, mesh, placements, parts)
    ref_x = full.clone().requires_grad_()
    before = torch.get_rng_state()
    out = dt.dropout(x, _P, site="block.3.attention")
    by_seed = dt.dropout(x, _P, seed=seed)
    assert torch.equal(torch.get_rng_state(), before), case  # keyed: nothing drawn
    ref = kernels.dropout(ref_x, _P, seed=seed)
    assert torch.equal(out.full_tensor(), ref), case
    assert torch.equal(by_seed.full_tensor(), ref), case
    grad = torch.randn(shape, generator=gen)
    out.backward(distribute_tensor(grad, mesh, out.placements, src_data_rank=None))
    ref.backward(grad)
    assert torch.equal(x.grad.full_tensor(), ref_x.grad), case

    bias_full = torch.randn(shape[-1:], generator=gen)
    residual_full = torch.randn(shape, generator=gen)
    bias = distribute_tensor(bias_full, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    residual = distribute_tensor(residual_full, mesh, [Replicate()] * mesh.ndim).requires_grad_()
    x_fused = x.detach().requires_grad_()
    fused = dt.bias_dropout_add(x_fused, bias, residual, _P, site="block.3.attention")
    refs = [t.clone().requires_grad_() for t in (full, bias_full, residual_full)]
    want = kernels.bias_dropout_add(*refs, _P, seed=seed)
    assert torch.equal(fused.full_tensor(), want), case
    assert torch.equal(torch.get_rng_state(), before), case
    grad = torch.randn(shape, generator=gen)
    fused.backward(distribute_tensor(grad, mesh, fused.placements, src_data_rank=None))
    want.backward(grad)
    assert torch.equal(x_fused.grad.full_tensor(), refs[0].grad), case
    assert torch.equal(residual.grad.full_tensor(), refs[2].grad), case
    _assert_bias_grad(bias.grad.full_tensor(), refs[1].grad, placements, case)

    # region_of: the public way to place a local shard for the kernels
    boxes = len(local_index_of(x).boxes()) if not partial else 0
    if partial or boxes != 1:
        with pytest.raises(DTensorPlacementError):
            dt.region_of(x)
        return
    local = kernels.dropout(x.to_local().detach(), _P, shard=dt.region_of(x), seed=seed)
    assert torch.equal(local, out.to_local().detach()), case


@pytest.mark.distributed(world_size=4, timeout=300)
def test_keyed_dropout_on_dtensors_from_public_calls(rank: int) -> None:
    """On a spread of the layouts above (1-d and 2x2 meshes; Shard, Replicate, Partial, even and
    uneven ``_StridedShard``), even and uneven shapes, keyed dropout and bias-dropout-add of a
    DTensor (``site=`` or ``seed=``) gather bitwise to the kernels' keyed op on the full tensor
    with the same seed words, gradients too (bitwise; the bias's up to summation order), and draw nothing from any generator. Where this
    rank's local tensor is one box, ``region_of(x)`` gives the ``Region`` with which
    ``rng_tracker.kernels.dropout(x.to_local(), p, shard=..., seed=...)`` draws exactly the
    DTensor op's local mask (what user code needed torch's private
    ``compute_local_shape_and_global_offset`` for); elsewhere it is a typed error."""
    from torch.distributed.device_mesh import init_device_mesh

    from rng_tracker import get_keyed_rng
    from rng_tracker.errors import KernelInputError
    from rng_tracker.parallel import dtensor as dt

    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(2024)
    keyed.register("block.3.attention")
    keyed.set_step(17)
    meshes = {s: init_device_mesh("cpu", s) for s in [(4,), (2, 2)]}
    gen = torch.Generator().manual_seed(5)  # the same data on every rank
    torch.manual_seed(rank)  # generators differ per rank: keyed masks must not care
    for (mesh_shape, placements), shape in itertools.product(_spread(), _SHAPES):
        _check_keyed(meshes[mesh_shape], placements, shape, gen)
    x = _make(torch.ones(8, 12), meshes[(4,)], _layouts()[0][1])
    with pytest.raises(KernelInputError, match="not both"):
        dt.dropout(x, _P, site="block.3.attention", seed=keyed.seed_tensor("block.3.attention"))


@pytest.mark.distributed(world_size=1, timeout=120)
def test_bad_arguments_are_typed_errors_that_draw_nothing(rank: int) -> None:
    """Bounds torch refuses, a generator, site, flag or mesh of the wrong type: typed errors,
    raised before anything is drawn or written (torch's bare RuntimeError/TypeError, an
    AttributeError or an unhashable-type TypeError before)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from rng_tracker import get_keyed_rng
    from rng_tracker.errors import (
        ArgumentTypeError,
        KernelInputError,
        KernelInputTypeError,
        KeyedTypeError,
        RNGTrackerError,
    )
    from rng_tracker.parallel import dtensor as dt

    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.full((4, 8), 7.0), mesh, [Shard(0)])
    ints = distribute_tensor(torch.zeros(4, 8, dtype=torch.int32), mesh, [Shard(0)])
    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(3)
    sites = keyed.sites
    for call, error, builtin, words in (
        (lambda: dt.uniform_(d, 1.0, 0.0), KernelInputError, ValueError, "a <= b"),
        (lambda: dt.uniform_(d, 0.0, float("nan")), KernelInputError, ValueError, "finite"),
        (lambda: dt.normal_(d, 0.0, -1.0), KernelInputError, ValueError, "std >= 0"),
        (lambda: dt.normal_(d, "x"), KernelInputTypeError, TypeError, "mean must be a real"),
        (lambda: dt.uniform_(d, generator="g"), KernelInputTypeError, TypeError,
         "generator must be a torch.Generator"),
        (lambda: dt.uniform_(ints), KernelInputTypeError, TypeError, "got torch.int32"),
        (lambda: dt.dropout(d, _P, site=[1]), KeyedTypeError, TypeError,
         "site must be the name .*got list"),
        (lambda: dt.dropout(d, _P, site=5), KeyedTypeError, TypeError, "got int 5"),
        (lambda: dt.bias_dropout_add(d, None, d, _P, site=("a",)), KeyedTypeError, TypeError,
         "got tuple"),
        (lambda: dt.dropout(d, _P, training="no"), ArgumentTypeError, TypeError,
         "training must be a bool"),
        (lambda: dt.bias_dropout_add(d, None, d, _P, training=1), ArgumentTypeError, TypeError,
         "training must be a bool"),
        (lambda: dt.dropout(d, _P, True, "no"), ArgumentTypeError, TypeError,
         "inplace must be a bool"),
        (lambda: dt.assert_same_generator_state("mesh"), ArgumentTypeError, TypeError,
         "mesh must be a DeviceMesh"),
        (lambda: dt.assert_same_generator_state(mesh, generator="g"), ArgumentTypeError,
         TypeError, "generator must be a torch.Generator"),
    ):  # fmt: skip
        state = torch.get_rng_state()
        with pytest.raises(error, match=words) as info:
            call()
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(d.to_local(), torch.full((4, 8), 7.0))
        assert keyed.sites == sites
    torch.manual_seed(9)
    dt.uniform_(d, 2, 2)  # a == b, as torch allows
    assert torch.equal(d.to_local(), torch.full((4, 8), 2.0))


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_residual_of_another_global_shape_is_refused_on_every_rank(rank: int) -> None:
    """x (4, 3) and residual (4, 4), both Shard(1): rank 0's local blocks are both (4, 2), so only
    rank 1 raised (local shapes were compared); rank 0 drew and returned a sum with the wrong
    tensor, and the ranks' generators parted. Global shapes are compared, on every rank alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from rng_tracker.parallel import dtensor as dt

    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(1)])
    residual = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    before = torch.get_rng_state()
    with pytest.raises(DTensorPlacementError, match=r"residual has shape \(4, 4\) but x has"):
        dt.bias_dropout_add(x, None, residual, 0.5)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_transposed_dtensor_draws_what_the_transposed_plain_tensor_draws(rank: int) -> None:
    """torch's CPU uniform_/normal_ fill memory in order, so a transposed tensor gets other values
    than a contiguous one. The full draw went into a contiguous buffer, so a transposed DTensor got
    the contiguous tensor's values; it now draws into a buffer of the DTensor's global strides."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from rng_tracker.parallel import dtensor as dt
    from rng_tracker.parallel.invariant import invariant_random

    def full_init_normal(t: torch.Tensor) -> None:
        with invariant_random(init="full"):
            torch.nn.init.normal_(t)

    mesh = init_device_mesh("cpu", (2,))
    draws = {  # the DTensor call and its one-device twin
        "uniform_": (dt.uniform_, torch.Tensor.uniform_),
        "normal_": (dt.normal_, torch.Tensor.normal_),
        "init='full'": (full_init_normal, full_init_normal),
    }
    for (name, (draw, draw_plain)), placement in itertools.product(
        draws.items(), [Shard(0), Replicate()]
    ):
        torch.manual_seed(3)
        plain = torch.zeros(6, 4).t()
        draw_plain(plain)
        want_state = torch.get_rng_state()
        transposed = distribute_tensor(torch.zeros(6, 4), mesh, [placement]).t()
        torch.manual_seed(3)
        draw(transposed)
        assert torch.equal(transposed.full_tensor(), plain), (name, placement)
        assert torch.equal(torch.get_rng_state(), want_state), (name, placement)
