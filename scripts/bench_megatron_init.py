"""Build time and peak memory of megatron-core's GPTModel: megatron's init vs invariant init.

megatron-core 0.19.2's own ``GPTModel`` (local spec, fp32, untied output layer) at TP=1 and
TP=2 on 2 gloo CPU ranks, 1 thread each (TP=1 runs data-parallel 2: every rank builds the whole
model). Modes, each in the same processes: ``install()`` with ``use_cpu_initialization=False``
(megatron's GPU-style init: each rank draws its shard from its tracker stream) and ``=True``
(megatron builds each full master weight on every rank and keeps its shard), and
``install(invariant=True)`` (keyed values per shard from ``sharded_state_dict()`` boxes; the
same path for either flag). Time: the whole ``GPTModel(...)`` construction (allocation and init),
the slowest rank, best of ``--repeats`` (modes interleaved). Peak: CPU heap above the local shards during
construction (glibc mallinfo2 sampled after every op, in a separate untimed build), max over
ranks. Ratios are to the two megatron modes measured in the same run.

    .venv/bin/python scripts/bench_megatron_init.py [--layers 12 --hidden 768 --repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _memory import PeakHeap, heap_bytes

from rng_tracker.parallel.testing._harness import run_distributed

_MODES = {  # name: (invariant, use_cpu_initialization)
    "megatron gpu-init": (False, False),
    "megatron cpu-init": (False, True),
    "invariant": (True, False),
    "invariant cpu-init": (True, True),
}


@contextlib.contextmanager
def _cuda_device_is_the_cpu() -> Iterator[None]:
    # megatron allocates use_cpu_initialization=False parameters on torch.cuda.current_device()
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


def _build(tp: int, args: argparse.Namespace, cpu_init: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import rng_tracker.megatron as rm

    rm.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=cpu_init,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    with _cuda_device_is_the_cpu():
        return GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=args.vocab,
            max_sequence_length=args.seq,
        )


def _measure(tp: int, args: argparse.Namespace) -> dict[str, tuple[float, int, int]]:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)  # GPTModel's deprecation notice
    torch.set_num_threads(1)
    import megatron.core.parallel_state as ps

    import rng_tracker.megatron as rm

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)

    def installed(mode: str) -> bool:
        rm.uninstall()
        rm.install(invariant=_MODES[mode][0])
        return _MODES[mode][1]

    for mode in _MODES:  # warm-up: imports, the keyed kernel's first load
        _build(tp, args, installed(mode))
    best = dict.fromkeys(_MODES, float("inf"))
    for _ in range(args.repeats):  # modes interleaved, so a load change hits them alike
        for mode in _MODES:
            cpu_init = installed(mode)
            dist.barrier()
            start = time.perf_counter()
            model = _build(tp, args, cpu_init)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best[mode] = min(best[mode], elapsed.item())
            del model
    out = {}
    for mode in _MODES:
        cpu_init = installed(mode)
        dist.barrier()
        base = heap_bytes()
        with PeakHeap() as tracker:
            model = _build(tp, args, cpu_init)
        local = sum(p.numel() * p.element_size() for p in model.parameters())
        extra = torch.tensor([float(tracker.peak - base - local)])
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        out[mode] = (best[mode], max(0, int(extra.item())), local)
        del model
    ps.destroy_model_parallel()
    rm.uninstall()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("NO_VCS_VERSION", "1")
    h, f = args.hidden, 4 * args.hidden
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    total = args.layers * per_layer + 2 * args.vocab * h + args.seq * h + 2 * h
    print(
        f"# megatron-core GPTModel, {total / 1e6:.1f} M fp32 parameters ({args.layers} layers, "
        f"hidden {h}, vocab {args.vocab}, untied output), 2 gloo CPU ranks, 1 thread each; "
        f"time = whole construction, slowest rank, best of {args.repeats}; peak = CPU heap above "
        "the local shards during construction (max over ranks)"
    )
    print(
        "| layout | mode | build time | vs megatron gpu-init | vs megatron cpu-init | "
        "peak above local | local shards |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tp in (1, 2):
        result = run_distributed(_measure, world_size=2, args=(tp, args), timeout=3600)[0]
        gpu, cpu = result["megatron gpu-init"][0], result["megatron cpu-init"][0]
        for mode, (seconds, peak, local) in result.items():
            print(
                f"| tp{tp} | {mode} | {seconds:.2f} s | {seconds / gpu:.2f}x | {seconds / cpu:.2f}x "
                f"| {peak / 2**20:.1f} MiB | {local / 2**20:.1f} MiB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
