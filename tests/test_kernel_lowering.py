"""The Triton kernel lowers for Hopper (sm_90) without a GPU: ahead-of-time compilation to PTX.

The interpreter, which the other kernel tests use, accepts programs that real lowering
rejects; this compiles the kernel's variants for an sm_90 target and checks the PTX for what
the design relies on: each group of 4 elements of x, bias, residual and output moves as one
vector even when numel is not a multiple of 16; index arithmetic costs at most one 64-bit
modulo per group and no division for unsharded or contiguous-block layouts; bf16 output
rounds in hardware (cvt.rn); and no FMA contraction (the product x * scale must round before the residual is added, as in the
reference). It checks the lowering, not the speed: speed needs a GPU (scripts/bench_dropout.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_LOWER = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rng_tracker.kernels.triton_dropout import _fused_dropout_kernel as kernel

names = kernel.arg_names
report = []
for dtype in ("fp32", "fp16", "bf16"):
    for aligned, gap in ((True, False), (True, True), (False, True)):
        signature = {n: f"*{dtype}" for n in ("x_ptr", "bias_ptr", "residual_ptr", "out_ptr")}
        signature.update(seed_ptr="*i64", numel="i32", bias_numel="i32", threshold="u32", scale="fp32",
                         row="i32", gap="i32", offset="i32")
        constants = {"HAS_BIAS": True, "HAS_RESIDUAL": True, "HAS_GAP": gap, "ALIGNED": aligned,
                     "WHOLE_GROUPS": True, "BIAS_BY_GROUP": True, "BF16_IN_SOFTWARE": False, "BLOCK": 256}
        signature.update({c: "constexpr" for c in constants})
        # Aligned pointers, as a launch specialises them; numel and bias_numel with no
        # divisibility known (numel % 4 == 0 is all WHOLE_GROUPS promises).
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(c),): v for c, v in constants.items()}, attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        loads = re.findall(r"\bld\.global[\w.]*", ptx)
        stores = re.findall(r"\bst\.global[\w.]*", ptx)
        report.append({"dtype": dtype, "aligned": aligned, "gap": gap,
                       "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
                       "hardware_bf16_rne": len(re.findall(r"\bcvt\.rn\.bf16(?:x2)?\.f32", ptx)),
                       "scalar_loads": sum(".v" not in op and not op.endswith(".b64") for op in loads),
                       "vector_stores": sum(".v" in op for op in stores),
                       "scalar_stores": sum(".v" not in op for op in stores),
                       "div": len(re.findall(r"\bdiv\.[su]64", ptx)),
                       "rem": len(re.findall(r"\brem\.[su]64", ptx))})
json.dump(report, sys.stdout)
"""


def test_kernel_lowers_to_sm90_ptx_with_vector_access_cheap_indexing_and_no_fma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    done = subprocess.run(
        [sys.executable, "-c", _LOWER], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert len(report) == 9
    for variant in report:
        assert variant["fma"] == 0, variant
        # On a GPU, bf16 output rounds to nearest even in hardware (as torch's CUDA cast does).
        assert (variant["hardware_bf16_rne"] > 0) == (variant["dtype"] == "bf16"), variant
        if variant["aligned"]:
            # x, bias and residual load a group as one vector, the output stores one.
            assert variant["scalar_loads"] == 0 and variant["scalar_stores"] == 0, variant
            assert variant["vector_stores"] > 0, variant
            # One bias column per group (not a modulo per element); a division only with a gap.
            assert variant["rem"] <= variant["vector_stores"], variant
            if not variant["gap"]:
                assert variant["div"] == 0, variant
