"""Keyed dropout on DTensors through public calls only: ``dtensor.dropout(x, p, site=/seed=)``,
``dtensor.bias_dropout_add(..., site=/seed=)`` and ``dtensor.region_of(x)``.

Claim: on a spread of tests/test_dtensor.py's layouts (1-d and 2x2 meshes; Shard, Replicate,
Partial, even and uneven ``_StridedShard``), even and uneven shapes, keyed dropout and bias-dropout-add of a DTensor gather bitwise
to the kernels' keyed op on the full tensor with the same seed words, gradients too, and draw
nothing from any generator. Where this rank's local tensor is one box, ``region_of(x)`` gives the
``Region`` with which ``rng_tracker.kernels.dropout(x.to_local(), p, shard=..., seed=...)`` draws
exactly the DTensor op's local mask (what user code needed torch's private
``compute_local_shape_and_global_offset`` for); elsewhere it is a typed error.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_dtensor import _P, _SHAPES, _layouts, _make, _summands


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


def _check(mesh, placements, shape, gen) -> None:
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
    bias = distribute_tensor(bias_full, mesh, [Replicate()] * mesh.ndim)
    residual = distribute_tensor(residual_full, mesh, [Replicate()] * mesh.ndim)
    fused = dt.bias_dropout_add(x, bias, residual, _P, site="block.3.attention")
    want = kernels.bias_dropout_add(full, bias_full, residual_full, _P, seed=seed)
    assert torch.equal(fused.full_tensor(), want), case
    assert torch.equal(torch.get_rng_state(), before), case

    # region_of: the public way to place a local shard for the kernels
    boxes = len(dt.local_index_of(x).boxes()) if not partial else 0
    if partial or boxes != 1:
        with pytest.raises(DTensorPlacementError):
            dt.region_of(x)
        return
    local = kernels.dropout(x.to_local().detach(), _P, shard=dt.region_of(x), seed=seed)
    assert torch.equal(local, out.to_local().detach()), case


@pytest.mark.distributed(world_size=4, timeout=300)
def test_keyed_dropout_on_dtensors_from_public_calls(rank: int) -> None:
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
        _check(meshes[mesh_shape], placements, shape, gen)
    x = _make(torch.ones(8, 12), meshes[(4,)], _layouts()[0][1])
    with pytest.raises(KernelInputError, match="not both"):
        dt.dropout(x, _P, site="block.3.attention", seed=keyed.seed_tensor("block.3.attention"))
