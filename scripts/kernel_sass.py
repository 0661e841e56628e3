"""Static machine-code size of the fused dropout kernel for a GPU target, without a GPU.

Compiles each variant ahead of time (Triton's bundled ptxas, sm_90 by default) and prints
its SASS instructions per thread and per element, and its registers. This is a count of
instructions in the code (slow paths that typical values never take included), not a speed
figure: speed comes from scripts/bench_dropout.py on a GPU. Run without TRITON_INTERPRET.

    python scripts/kernel_sass.py [--capability 90]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lowering import ELEMENTS_PER_THREAD, Variant, compile_variant, sass_opcodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="CUDA compute capability")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter's kernel cannot be compiled")

    print(f"sm_{args.capability}, {ELEMENTS_PER_THREAD} elements per thread; NOPs excluded")
    header = f"{'op':<18}{'dtype':<7}{'layout':<16}{'SASS/thread':>11}{'per element':>13}"
    print(f"{header}{'registers':>11}")
    for op, with_inputs in (("dropout", False), ("bias_dropout_add", True)):
        for dtype in ("bf16", "fp32"):
            for gap in (False, True):
                variant = Variant(
                    dtype, has_bias=with_inputs, has_residual=with_inputs, divisions=int(gap)
                )
                opcodes, registers = sass_opcodes(
                    compile_variant(variant, args.capability)["cubin"]
                )
                layout = "sharded (gap)" if gap else "unsharded"
                per_element = len(opcodes) / ELEMENTS_PER_THREAD
                print(
                    f"{op:<18}{dtype:<7}{layout:<16}{len(opcodes):>11}{per_element:>13.1f}"
                    f"{registers:>11}"
                )


if __name__ == "__main__":
    main()
