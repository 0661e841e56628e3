"""The Triton kernel's launch shape on this GPU: groups per program and warps, measured.

    python scripts/tune_triton_launch.py [--log2 26 28]

For dropout and bias-dropout-add, bf16 and fp32, at each size: GB/s of the kernel (launched
straight, the seed words as arguments) for every (groups per program, warps) pair, against a
device-to-device copy of the same tensor measured in the same run. The launch shape changes
which thread computes an element, never its mask (a function of the global index): the script
stops if two shapes write different outputs.
Without CUDA it exits with status 2 and measures nothing.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from rng_tracker.kernels import _triton_kernel
from rng_tracker.kernels._call import dropout_call
from rng_tracker.kernels._index_map import index_map_of

SHAPES = list(itertools.product((128, 256, 512, 1024), (4, 8)))  # (groups per program, warps)


def _launch_gbs(call, moved_bytes: int, groups: int, warps: int) -> float:
    from triton.testing import do_bench

    _triton_kernel._GROUPS_PER_PROGRAM, _triton_kernel.NUM_WARPS = groups, warps
    ms = do_bench(lambda: _triton_kernel.fused_dropout_triton(call, (5, 0, 0, 0)), rep=200)
    return moved_bytes / (ms / 1e3) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2", type=int, nargs="+", default=[26, 28])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_triton_launch.py: no CUDA device here; nothing was measured", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    default = (_triton_kernel._GROUPS_PER_PROGRAM, _triton_kernel.NUM_WARPS)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; default {default}")
    print(
        f"{'op':<17}{'dtype':<9}{'N':>5}  {'copy GB/s':>9}  "
        + "".join(f"{f'{g}x{w}':>10}" for g, w in SHAPES)
        + "   (GB/s; groups of 4 per program x warps; ratio to copy under)"
    )
    for op, log2, dtype in itertools.product(
        ("dropout", "bias_dropout_add"), args.log2, (torch.bfloat16, torch.float32)
    ):
        n = 2**log2
        x = torch.randn(n // 1024, 1024, device="cuda", dtype=dtype)
        bias = residual = None
        streams = 2
        if op == "bias_dropout_add":
            bias = torch.randn(1024, device="cuda", dtype=dtype)
            residual = torch.randn_like(x)
            streams = 3
        call = dropout_call(x, bias, residual, 0.1, index_map_of(x.shape, None))
        moved = streams * n * x.element_size()
        out = torch.empty_like(x)
        copy_ms = do_bench(lambda out=out, x=x: out.copy_(x), rep=200)
        copy = 2 * n * x.element_size() / (copy_ms / 1e3) / 1e9
        figures = [_launch_gbs(call, moved, g, w) for g, w in SHAPES]
        outputs = []
        for g, w in SHAPES:  # every shape writes the same bits
            _triton_kernel._GROUPS_PER_PROGRAM, _triton_kernel.NUM_WARPS = g, w
            outputs.append(_triton_kernel.fused_dropout_triton(call, (5, 0, 0, 0)))
        if not all(torch.equal(outputs[0], other) for other in outputs[1:]):
            raise SystemExit(f"{op} {dtype} 2^{log2}: launch shapes wrote different outputs")
        del outputs
        name = str(dtype).replace("torch.", "")
        print(
            f"{op:<17}{name:<9}{'2^' + str(log2):>5}  {copy:9.1f}  "
            + "".join(f"{f:10.1f}" for f in figures)
        )
        print(f"{'':<42}" + "".join(f"{f / copy:10.3f}" for f in figures), flush=True)
    _triton_kernel._GROUPS_PER_PROGRAM, _triton_kernel.NUM_WARPS = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
