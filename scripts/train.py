"""The end-to-end job: train TinyGPT with tensor, sequence, data and pipeline parallelism under torchrun.

    torchrun --standalone --nproc-per-node 4 scripts/train.py --tp 2 --dp 2 --sp \
        --recompute selective --rng-mode invariant --steps 30 --save out/ckpt
    torchrun --standalone --nproc-per-node 4 scripts/train.py --tp 2 --pp 2 --microbatches 2 \
        --global-batch 16 --rng-mode keyed --steps 40 --resume out/ckpt

CPU/gloo by default (nccl when every rank has a GPU). Prints progress (step, loss, tokens/s),
verifies RNG consistency across all ranks at the start and the end, and a summary.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rng_tracker.errors import RNGTrackerError
from rng_tracker.parallel.demo.trainer import TrainConfig, train


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    parser.add_argument(
        "--dp", type=int, default=None, help="data-parallel size (default: world / (tp * pp))"
    )
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per DP rank")
    parser.add_argument(
        "--global-batch", type=int, default=16, help="sequences per step over all ranks"
    )
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--recompute", choices=("none", "full", "selective"), default="none")
    parser.add_argument(
        "--rng-mode", choices=("megatron", "invariant", "keyed"), default="megatron"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--save", default=None, help="directory to commit a DCP checkpoint to at the end"
    )
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    parser.add_argument("--log-every", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    if use_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        )
    dist.init_process_group("nccl" if use_gpu else "gloo", timeout=timedelta(minutes=10))
    world = dist.get_world_size()
    dp = args.dp if args.dp is not None else world // (args.tp * args.pp)
    if args.tp * dp * args.pp != world:
        if dist.get_rank() == 0:
            print(
                f"error: --tp {args.tp} x --dp {dp} x --pp {args.pp} must equal the number of "
                f"processes ({world})",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return 2
    cfg = TrainConfig(
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        global_batch=args.global_batch,
        schedule=args.schedule,
        sp=args.sp,
        recompute=args.recompute,
        rng_mode=args.rng_mode,
        steps=args.steps,
        seed=args.seed,
        save=args.save,
        resume=args.resume,
        log_every=args.log_every,
    )
    if dist.get_rank() == 0:
        print(
            f"TinyGPT on {world} ranks ({'nccl' if use_gpu else 'gloo'}): tp={args.tp} dp={dp} "
            f"pp={args.pp} microbatches={args.microbatches} global_batch={args.global_batch} "
            f"sp={args.sp} recompute={args.recompute} rng_mode={args.rng_mode} "
            f"steps={args.steps} seed={args.seed}",
            flush=True,
        )
    try:
        result = train(cfg)
    except RNGTrackerError as exc:  # a refused resume or a bad checkpoint: the same on every rank
        if dist.get_rank() == 0:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if dist.get_rank() == 0:
        ok = all(r is None or r.ok for r in (result.report_start, result.report_end))
        print("\nsummary")
        print(
            f"  loss              {result.losses[0]:.6f} -> {result.losses[-1]:.6f} over "
            f"{len(result.losses)} steps"
        )
        print(f"  throughput        {result.tokens_per_s:.0f} tokens/s ({result.seconds:.1f} s)")
        print(
            f"  replicated state  {'bitwise identical across each TP group' if result.replicated_equal else 'DIVERGED'}"
        )
        print(
            f"  RNG consistency   {'verified at start and end' if ok else 'FAILED (see reports above)'}"
        )
        if args.save:
            print(
                f"  checkpoint        {args.save} committed at step {len(result.losses)} "
                f"(run {result.run_id[:8]}; resume with --resume {args.save})"
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
