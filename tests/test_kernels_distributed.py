"""On 4 gloo ranks: with a replicated stream, the ranks' shard masks assemble to the unsharded mask."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rng_tracker import DATA_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
from rng_tracker.kernels import Shard, dropout

SHAPE = (8, 8, 20)  # every dim divides by the 4 ranks


def _shard_masks(dim: int, impl: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model_parallel_seed(77, tp_rank=rank, pp_rank=0, dp_rank=0)  # data-parallel-rng is replicated
    tracker = get_rng_tracker("cpu")
    logical = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    with tracker.fork(DATA_PARALLEL_RNG):
        local = dropout(
            logical.chunk(world, dim=dim)[rank].contiguous(),
            0.5,
            shard=Shard(dim, rank, world, extent=SHAPE[dim]),
            impl=impl,
        )
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    model_parallel_seed(77, tp_rank=rank, pp_rank=0, dp_rank=0)
    with tracker.fork(DATA_PARALLEL_RNG):
        whole = dropout(logical, 0.5, impl=impl)
    return {"assembled": torch.cat(parts, dim=dim), "whole": whole}


def test_rank_shards_assemble_to_the_unsharded_mask():
    from rng_tracker.parallel.testing import run_distributed

    for dim, impl in ((0, "torch"), (-1, "torch"), (1, "triton")):
        for result in run_distributed(_shard_masks, world_size=4, args=(dim, impl)):
            assert torch.equal(result["assembled"], result["whole"]), (dim, impl)
