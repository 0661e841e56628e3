"""Init time and peak memory: torch's default DTensor init vs invariant init, default and full.

One run, 4 gloo CPU ranks, a transformer-shaped parameter set (torchtitan's init: trunc_normal_
for linears, normal_ for the embedding) at TP=1, TP=2, TP=4 and TP=2 x FSDP=2 (FSDP2's
_StridedShard on the TP shard). Per layout and mode: the slowest rank's init time (best of
``--repeats``) and the peak CPU heap above the local shards during init (glibc mallinfo2,
sampled after every op), printed with their ratios to torch's default. Modes: ``invariant_random()``
(the default: keyed init, names by the order of init draws), ``invariant_random(model)`` (keyed
by parameter name) and ``invariant_random(init="full")`` (torch's values on the full tensor).

    .venv/bin/python scripts/bench_init.py [--layers 4 --dim 512 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import PeakHeap, heap_bytes

from rng_tracker.parallel.testing._harness import run_distributed


def _shapes(layers: int, dim: int, vocab: int) -> list[tuple[str, tuple[int, int], int]]:
    """(name, global shape, TP shard dim) of a Llama-like model."""
    out = [("tok_embeddings.weight", (vocab, dim), 0)]
    for i in range(layers):
        out += [
            (f"layers.{i}.attention.wqkv.weight", (3 * dim, dim), 0),
            (f"layers.{i}.attention.wo.weight", (dim, dim), 1),
            (f"layers.{i}.feed_forward.w1.weight", (4 * dim, dim), 0),
            (f"layers.{i}.feed_forward.w2.weight", (dim, 4 * dim), 1),
            (f"layers.{i}.feed_forward.w3.weight", (4 * dim, dim), 0),
        ]
    return [*out, ("output.weight", (vocab, dim), 0)]


def _model(layout: str, shapes: list[tuple[str, tuple[int, int], int]]) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    tp = {"tp1": 1, "tp2": 2, "tp4": 4, "tp2xfsdp2": 2}[layout]
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Module()
    for name, shape, dim in shapes:
        if layout == "tp2xfsdp2":  # FSDP2 shards dim 0 of the TP shard
            dp = _StridedShard(0, split_factor=2) if dim == 0 else Shard(0)
            placements = [dp, Shard(dim)]
        else:  # the dp axis replicates (pure TP; TP=1 is a 1-way shard)
            placements = [Replicate(), Shard(dim)]
        param = distribute_tensor(torch.empty(shape), mesh, placements)
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(param))
    return model


def _init(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.startswith("tok_embeddings"):
            torch.nn.init.normal_(param)
        else:
            torch.nn.init.trunc_normal_(param, std=0.02, a=-0.06, b=0.06)


def _measure(layout: str, layers: int, dim: int, vocab: int, repeats: int) -> dict[str, tuple]:
    import torch.distributed as dist

    from rng_tracker.parallel.invariant import invariant_random

    torch.set_num_threads(1)
    model = _model(layout, _shapes(layers, dim, vocab))
    modes = {
        "torch": lambda: _nullcontext(),
        "default": lambda: invariant_random(),
        "named": lambda: invariant_random(model),
        "full": lambda: invariant_random(init="full"),
    }
    out = {}
    for mode, context in modes.items():
        with torch.no_grad(), context():
            _init(model)  # warm-up (builds the keyed kernel on first use)
        best, peak = float("inf"), 0
        for _ in range(repeats):
            torch.manual_seed(0)
            dist.barrier()
            base = heap_bytes()
            start = time.perf_counter()
            with torch.no_grad(), context(), PeakHeap() as tracker:
                _init(model)
            elapsed = torch.tensor([time.perf_counter() - start])
            extra = torch.tensor([float(tracker.peak - base)])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(extra, op=dist.ReduceOp.MAX)
            best, peak = min(best, elapsed.item()), max(peak, int(extra.item()))
        out[mode] = (best, peak)
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    out["local_bytes"] = (local,)
    return out


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = sum(s[0] * s[1] for _, s, _ in _shapes(args.layers, args.dim, args.vocab))
    print(
        f"# init of {total / 1e6:.1f} M fp32 parameters ({args.layers} layers, dim {args.dim}, "
        f"vocab {args.vocab}) on 4 gloo CPU ranks, 1 thread each; time = slowest rank, best of "
        f"{args.repeats}; peak = CPU heap above the local shards during init (max over ranks)"
    )
    print(
        "| layout | torch default | invariant_random() (ratio) | invariant_random(model) "
        '(ratio) | init="full" (ratio) | torch peak | default peak | full peak | local shard |'
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout in ("tp1", "tp2", "tp4", "tp2xfsdp2"):
        result = run_distributed(
            _measure,
            world_size=4,
            args=(layout, args.layers, args.dim, args.vocab, args.repeats),
            timeout=1800,
        )[0]
        torch_s = result["torch"][0]

        def mib(n: int) -> str:
            return f"{n / 2**20:.1f} MiB"

        def timed(mode: str, result: dict = result, torch_s: float = torch_s) -> str:
            return f"{result[mode][0] * 1e3:.1f} ms ({result[mode][0] / torch_s:.2f}x)"

        print(
            f"| {layout} | {torch_s * 1e3:.1f} ms | {timed('default')} | {timed('named')} | "
            f"{timed('full')} | {mib(result['torch'][1])} | {mib(result['default'][1])} | "
            f"{mib(result['full'][1])} | {mib(result['local_bytes'][0])} |",
            flush=True,
        )
    print("target: invariant_random() (the default) <= 1.00x torch's default at every layout")


if __name__ == "__main__":
    main()
