"""The Triton kernel lowers for Hopper (sm_90) without a GPU: ahead-of-time compilation.

The interpreter, which the other kernel tests use, accepts programs that real lowering
rejects; this compiles the kernel's variants for an sm_90 target and checks the PTX and SASS
for what the design relies on: each group of 4 elements of x, bias, residual and output moves
as one vector even when numel is not a multiple of 16; index arithmetic costs at most one
64-bit modulo per group and one division per merged dim of the index map but the last (none for
unsharded or contiguous-block layouts, and general maps of 4 merged dims compile); bf16 output
rounds in hardware (cvt.rn); and no FMA contraction in the PTX or in the SASS that Triton's
bundled ptxas makes of it (x * scale must round before the residual is added, as in the
reference). It checks the lowering, not the speed: speed needs a GPU (scripts/bench_dropout.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  the kernels extra, which scripts/test.sh installs: never skipped

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"  # _lowering.py: not installed

_LOWER = r"""
import json, re, sys
from _lowering import Variant, compile_variant, sass_opcodes  # scripts/_lowering.py

report = []
cases = [(dtype, aligned, divisions, False) for dtype in ("fp32", "fp16", "bf16")
         for aligned, divisions in ((True, 0), (True, 1), (False, 1))]
cases += [("fp32", True, 3, False), ("fp32", False, 3, False)]  # general maps: 4 merged dims
cases += [("fp32", True, 0, True), ("bf16", True, 1, True)]  # seed words as arguments
for dtype, aligned, divisions, seed_in_args in cases:
    variant = Variant(dtype, divisions=divisions, aligned=aligned, seed_in_args=seed_in_args)
    assembly = compile_variant(variant)
    ptx = assembly["ptx"]
    sass, registers = sass_opcodes(assembly["cubin"])
    loads = re.findall(r"\bld\.global[\w.]*", ptx)
    stores = re.findall(r"\bst\.global[\w.]*", ptx)
    report.append({"dtype": dtype, "aligned": aligned, "divisions": divisions,
                   "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
                   "sass_ffma": sum(op.startswith("FFMA") for op in sass),
                   "sass_stores": sum(op.startswith("STG") for op in sass),
                   "registers": registers,
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _LOWER], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert len(report) == 13
    for variant in report:
        # No FMA contraction, in the PTX nor in the machine code ptxas makes of it.
        assert variant["fma"] == 0 and variant["sass_ffma"] == 0, variant
        assert variant["sass_stores"] > 0 and 0 < variant["registers"] <= 255, variant
        # On a GPU, bf16 output rounds to nearest even in hardware (as torch's CUDA cast does).
        assert (variant["hardware_bf16_rne"] > 0) == (variant["dtype"] == "bf16"), variant
        if variant["aligned"]:
            # x, bias and residual load a group as one vector, the output stores one.
            assert variant["scalar_loads"] == 0 and variant["scalar_stores"] == 0, variant
            assert variant["vector_stores"] > 0, variant
            # One bias column per group (not a modulo per element); the map's divisions per group
            # (none for a contiguous block).
            assert variant["rem"] <= variant["vector_stores"], variant
            assert variant["div"] <= variant["divisions"] * variant["vector_stores"], variant
