"""The Triton kernel lowers for Hopper (sm_90) without a GPU: ahead-of-time compilation to PTX.

The interpreter, which the other kernel tests use, accepts programs that real lowering
rejects; this compiles every variant for an sm_90 target and checks the PTX for what the
design relies on: vectorised loads of x and residual, and no FMA contraction (the product
x * scale must round before the residual is added, as in the reference).
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
    for aligned in (True, False):
        signature = {n: f"*{dtype}" for n in ("x_ptr", "bias_ptr", "residual_ptr", "out_ptr")}
        signature.update(seed_ptr="*i64", numel="i32", bias_numel="i32", threshold="u32", scale="fp32",
                         row="i32", gap="i32", offset="i32")
        constants = {"HAS_BIAS": True, "HAS_RESIDUAL": True, "ALIGNED": aligned, "OUT_BF16": dtype == "bf16", "BLOCK": 256}
        signature.update({c: "constexpr" for c in constants})
        # What a launch specialises on for aligned pointers and a numel divisible by 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(5), names.index("numel"))}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(c),): v for c, v in constants.items()}, attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        report.append({"dtype": dtype, "aligned": aligned,
                       "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
                       "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", ptx))})
json.dump(report, sys.stdout)
"""


def test_kernel_lowers_to_sm90_ptx_with_vector_loads_and_no_fma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    done = subprocess.run(
        [sys.executable, "-c", _LOWER], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert len(report) == 6
    for variant in report:
        assert variant["fma"] == 0, variant
        if variant["aligned"]:
            assert variant["vector_loads"] > 0, variant
