"""torch's default DTensor randomness vs invariant_random() on torchtitan's Llama3 debug model.

One run, 4 gloo CPU ranks: the model built and parallelized by torchtitan (TP=2, FSDP=2, TP=4,
TP=2 x FSDP=2), initialised by torchtitan's ``init_weights``, one forward step with a dropout
site on the first block's w1 output, each data-parallel rank on its own samples of the global
batch (inside ``rng_tracker.batch_position``); each compared with the single-device model of the
same mode (parameters bitwise equal, max abs difference, dropout mask elements that differ).

    .venv/bin/python scripts/compare_torchtitan.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from rng_tracker.parallel.testing._harness import run_distributed


def _one(tp: int, dp_shard: int, parallel: bool, ours: bool) -> tuple[dict, list]:
    import test_torchtitan as titan
    import torch.distributed as dist

    from rng_tracker.parallel.invariant import disable_invariant_random, enable_invariant_random

    model = titan._build(tp, dp_shard, parallel=parallel)
    torch.manual_seed(0)
    masks: list[torch.Tensor] = []
    titan._add_dropout_site(model, masks)
    if ours:
        enable_invariant_random()
    try:
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        params = {n: titan._full(p) for n, p in model.named_parameters()}
        if not parallel:
            titan._steps(model, masks, 1)
            return params, masks
        # each data-parallel rank runs its own samples (torchtitan's mesh: fsdp outer, tp inner)
        titan._steps(model, masks, 1, dp=(dist.get_rank() // tp, dp_shard))
    finally:
        disable_invariant_random()
    per_rank = [torch.empty_like(masks[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, masks[0])
    return params, [torch.cat(per_rank[::tp])]  # the data-parallel ranks' samples, in order


def _compare(layouts: list[tuple[str, int, int]]) -> list[str]:
    import torch.distributed as dist

    rows = []
    for ours in (False, True):
        single = _one(1, 1, parallel=False, ours=ours)
        for name, tp, dp_shard in layouts:
            params, masks = _one(tp, dp_shard, parallel=True, ours=ours)
            differ = [n for n in params if not torch.equal(params[n], single[0][n])]
            worst = max(
                ((params[n] - single[0][n]).abs().max().item() for n in differ), default=0.0
            )
            mismatch = (masks[0] != single[1][0]).float().mean().item()
            mode = "invariant_random()" if ours else "torch default"
            rows.append(
                f"| {name} | {mode} | {len(params) - len(differ)} of {len(params)} | "
                f"{worst:.3g} | {100 * mismatch:.1f} % |"
            )
    return rows if dist.get_rank() == 0 else []


def main() -> None:
    rows = run_distributed(
        _compare, world_size=2, args=([("TP=2", 2, 1), ("FSDP=2", 1, 2)],), timeout=3000
    )[0]
    rows += run_distributed(
        _compare, world_size=4, args=([("TP=4", 4, 1), ("TP=2 x FSDP=2", 2, 2)],), timeout=3000
    )[0]
    print(
        "| layout | randomness | parameters bitwise equal to 1 device | max abs diff | "
        "dropout mask elements that differ from 1 device |"
    )
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
