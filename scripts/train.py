"""The end-to-end job: train TinyGPT with tensor, sequence, data and pipeline parallelism.

    python scripts/train.py --nproc-per-node 4 --tp 2 --dp 2 --sp \
        --recompute selective --rng-mode invariant --steps 30 --save out/ckpt
    torchrun --standalone --nproc-per-node 4 scripts/train.py --tp 2 --pp 2 --microbatches 2 \
        --global-batch 16 --rng-mode keyed --steps 40 --resume out/ckpt

Every argument, the save target and the checkpoint to resume are checked before any rank
starts work: a bad one prints one line (``error: <Error>: what to change``) on stderr and
exits 2. With ``--nproc-per-node N`` this script checks them once and then starts N ranks
under torchrun itself, so its exit status is the job's; started by torchrun directly, every
rank checks and exits 2, and torchrun reports its own status. Without either it runs as one
process. CPU/gloo by default (nccl when every rank has a GPU). Prints progress (step, loss,
tokens/s), verifies RNG consistency across all ranks at the start and the end, and a summary.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from rng_tracker.errors import RNGTrackerError
from rng_tracker.parallel.transformer import GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _examples_path  # noqa: F401  (examples/ onto sys.path: the job is not installed)
from gpt_training.trainer import TrainConfig, preflight, train


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr and exit 2, as the job's own are."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--steps", type=int, default=20, help="train until this step (from 0)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--save", default=None, help="directory to commit a DCP checkpoint to at the end"
    )
    parser.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="let --save replace a checkpoint of another run in that directory",
    )
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="check every argument, then start this many ranks under torchrun (--standalone)",
    )
    return parser.parse_args(argv)


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        global_batch=args.global_batch,
        schedule=args.schedule,
        steps=args.steps,
        seed=args.seed,
        save=args.save,
        resume=args.resume,
        log_every=args.log_every,
        overwrite=args.overwrite,
        model=GPTConfig(
            rng_mode=args.rng_mode, recompute=args.recompute, sequence_parallel=args.sp
        ),
    )


def _refuse(exc: RNGTrackerError, *, rank: str) -> int:
    """Print the refusal as one line and return exit status 2. Under a plain torchrun every rank
    prints it (``rank``: "rank r: "): rank 0 alone may be stopped by torchrun, once another
    rank has exited, before it prints."""
    message = " ".join(str(exc).split())  # one line, whatever the message holds
    print(f"{rank}error: {type(exc).__name__}: {message}", file=sys.stderr, flush=True)
    return 2


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _launch(nproc: int, argv: list[str]) -> int:
    """Run ``nproc`` ranks of this script under torchrun; the job's exit status. A SIGTERM or
    SIGHUP to this process (``timeout``, ``kill``, a closed terminal) is passed on to torchrun,
    which stops the ranks: the job never runs on, detached, after its launcher."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), os.path.abspath(__file__), *_without_nproc(argv)]
    job = subprocess.Popen(command)
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: job.send_signal(signum))
        for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        return job.wait()
    except BaseException:  # KeyboardInterrupt and the like: stop the job before leaving
        job.terminate()
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = f"rank {os.environ['RANK']}: " if under_torchrun else ""
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        print(
            f"error: --nproc-per-node must be a positive integer, got {args.nproc_per_node}",
            file=sys.stderr,
        )
        return 2
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc_per_node or 1
    cfg = _config(args)
    try:
        preflight(cfg, world=world, dp=args.dp)
    except RNGTrackerError as exc:  # the same verdict on every rank, and nothing has started
        return _refuse(exc, rank=rank)
    if not under_torchrun and args.nproc_per_node is not None:
        return _launch(args.nproc_per_node, argv)

    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    if use_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        )
    backend = "nccl" if use_gpu else "gloo"
    if under_torchrun:
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    else:  # one process and no launcher: an in-memory store is all it needs
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    dp = world // (args.tp * args.pp)
    if dist.get_rank() == 0:
        print(
            f"TinyGPT on {world} ranks ({backend}): tp={args.tp} dp={dp} "
            f"pp={args.pp} microbatches={args.microbatches} global_batch={args.global_batch} "
            f"sp={args.sp} recompute={args.recompute} rng_mode={args.rng_mode} "
            f"steps={args.steps} seed={args.seed}",
            flush=True,
        )
    try:
        result = train(cfg)
    except RNGTrackerError as exc:  # found while loading: the same on every rank
        dist.destroy_process_group()
        return _refuse(exc, rank=rank)
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
