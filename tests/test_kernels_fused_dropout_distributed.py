"""On 4 gloo ranks: with a replicated stream, the ranks' shard masks assemble to the unsharded mask
(equal chunks along one dim, and a 2 x 2 grid of torch.chunk's uneven splits placed by Region)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rng_tracker import DATA_PARALLEL_RNG, get_rng_tracker, model_parallel_seed
from rng_tracker.kernels import Chunk, Region, dropout

SHAPE = (8, 8, 20)  # every dim divides by the 4 ranks
UNEVEN = (5, 7, 3)  # a 2 x 2 grid over dims 0 and 1: rows 3 + 2, columns 4 + 3


def _shard_masks(dim: int, impl: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model_parallel_seed(
        77, tp_rank=rank, pp_rank=0, dp_rank=0, cp_rank=0, ep_rank=0, etp_rank=rank
    )  # data-parallel-rng is replicated
    tracker = get_rng_tracker("cpu")
    logical = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    with tracker.fork(DATA_PARALLEL_RNG):
        local = dropout(
            logical.chunk(world, dim=dim)[rank].contiguous(),
            0.5,
            shard=Chunk(dim, rank, world, extent=SHAPE[dim]),
            impl=impl,
        )
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    model_parallel_seed(77, tp_rank=rank, pp_rank=0, dp_rank=0, cp_rank=0, ep_rank=0, etp_rank=rank)
    with tracker.fork(DATA_PARALLEL_RNG):
        whole = dropout(logical, 0.5, impl=impl)
    return {"assembled": torch.cat(parts, dim=dim), "whole": whole}


_CASES = ((0, "torch"), (-1, "torch"), (1, "triton"))


def _each_case() -> list[dict]:
    return [_shard_masks(dim, impl) for dim, impl in _CASES]  # one launch of 4 ranks for all


def test_rank_shards_assemble_to_the_unsharded_mask():
    from rng_tracker.parallel.testing import run_distributed

    for results in run_distributed(_each_case, world_size=4):
        for (dim, impl), result in zip(_CASES, results, strict=True):
            assert torch.equal(result["assembled"], result["whole"]), (dim, impl)


def _grid_masks(impl: str) -> dict:
    rank = dist.get_rank()
    row, column = divmod(rank, 2)
    model_parallel_seed(78, tp_rank=rank, pp_rank=0, dp_rank=0, cp_rank=0, ep_rank=0, etp_rank=rank)
    tracker = get_rng_tracker("cpu")
    rows = torch.ones(UNEVEN).chunk(2, dim=0)
    local = rows[row].chunk(2, dim=1)[column]
    offset = (row * rows[0].shape[0], column * rows[0].chunk(2, dim=1)[0].shape[1], 0)
    with tracker.fork(DATA_PARALLEL_RNG):
        mask = dropout(local, 0.5, shard=Region(UNEVEN, offset), impl=impl) != 0
    model_parallel_seed(78, tp_rank=rank, pp_rank=0, dp_rank=0, cp_rank=0, ep_rank=0, etp_rank=rank)
    with tracker.fork(DATA_PARALLEL_RNG):
        whole = dropout(torch.ones(UNEVEN), 0.5, impl=impl) != 0
    return {"offset": offset, "mask": mask, "whole": whole}


def test_uneven_grid_regions_assemble_to_the_unsharded_mask():
    from rng_tracker.parallel.testing import run_distributed

    results = run_distributed(_grid_masks, world_size=4, args=("torch",))
    assembled = torch.zeros(UNEVEN, dtype=torch.bool)
    covered = torch.zeros(UNEVEN, dtype=torch.int64)
    for result in results:
        (r0, c0, _), mask = result["offset"], result["mask"]
        box = (slice(r0, r0 + mask.shape[0]), slice(c0, c0 + mask.shape[1]))
        assembled[box] = mask
        covered[box] += 1
        assert torch.equal(result["whole"], results[0]["whole"])
    assert torch.equal(covered, torch.ones_like(covered))  # the 4 boxes tile the tensor
    assert torch.equal(assembled, results[0]["whole"])
