"""Ahead-of-time compilation of the fused dropout kernel for a GPU target, on any machine.

No GPU is needed: Triton lowers to PTX and its bundled ptxas assembles the cubin. This is
how CI checks the lowering (tests/test_kernels_triton_kernel.py) and how scripts/kernel_sass.py
prints the instruction counts in docs/benchmarks.md. Import it with TRITON_INTERPRET unset:
under the interpreter the kernel is not a compilable function.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from rng_tracker.errors import KernelUnavailableError
from rng_tracker.kernels._triton_kernel import (
    _GROUPS_PER_PROGRAM,
    HAS_TRITON,
    NUM_WARPS,
    TRITON_IMPORT_ERROR,
)

__all__ = ["ELEMENTS_PER_THREAD", "Variant", "compile_variant", "sass_opcodes"]

ELEMENTS_PER_THREAD = 4 * _GROUPS_PER_PROGRAM // (32 * NUM_WARPS)


@dataclass(frozen=True, slots=True)
class Variant:
    """One specialisation of the kernel: element type and the constexpr switches of a launch.

    Pointers are taken as 16-byte aligned (launches specialise on that); numel and the
    bias length carry no divisibility hint, so what the code gets is what any size gets.
    """

    dtype: str  # "fp32", "fp16" or "bf16"
    has_bias: bool = True
    has_residual: bool = True
    divisions: int = 0  # merged dims of the index map minus 1: 0 unsharded, 1 an equal-chunk shard
    aligned: bool = True
    whole_groups: bool = True
    bias_by_group: bool = True
    seed_in_args: bool = False  # the seed words as int64 arguments (a straight eager call)

    def constants(self) -> dict[str, object]:
        return {
            "HAS_BIAS": self.has_bias,
            "HAS_RESIDUAL": self.has_residual,
            "DIVISIONS": self.divisions,
            "ALIGNED": self.aligned,
            "WHOLE_GROUPS": self.whole_groups,
            "BIAS_BY_GROUP": self.bias_by_group,
            "BF16_IN_SOFTWARE": False,  # a GPU rounds in hardware
            "SEED_IN_ARGS": self.seed_in_args,
            "BLOCK": _GROUPS_PER_PROGRAM,
        }


def _kernel():
    if not HAS_TRITON:
        raise KernelUnavailableError(f"compiling the kernel needs triton ({TRITON_IMPORT_ERROR})")
    import triton

    from rng_tracker.kernels._triton_kernel import _fused_dropout_kernel

    if not isinstance(_fused_dropout_kernel, triton.runtime.JITFunction):
        raise KernelUnavailableError(
            "the kernel was imported under TRITON_INTERPRET=1 and cannot be compiled; "
            "import rng_tracker.kernels in a process without TRITON_INTERPRET"
        )
    return _fused_dropout_kernel


def compile_variant(variant: Variant, capability: int = 90) -> Mapping[str, str | bytes]:
    """The kernel's assembly for ``variant`` on CUDA compute ``capability``: "ptx", "cubin", ..."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _kernel()
    names = kernel.arg_names
    signature: dict[str, str] = {
        name: f"*{variant.dtype}" for name in ("x_ptr", "bias_ptr", "residual_ptr", "out_ptr")
    }
    signature.update(seed_ptr="*i64", numel="i32", bias_numel="i32", threshold="u32")
    signature.update(dict.fromkeys(("key_arg", "base_arg", "word2_arg", "word3_arg"), "i64"))
    signature.update(scale="fp32", offset="i32", last_stride="i32")
    signature.update(
        {name: "i32" for name in ("inner1", "gap1", "inner2", "gap2", "inner3", "gap3")}
    )
    constants = variant.constants()
    signature.update(dict.fromkeys(constants, "constexpr"))
    pointers = [
        names.index(n) for n in ("x_ptr", "bias_ptr", "residual_ptr", "out_ptr", "seed_ptr")
    ]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(index,): [["tt.divisibility", 16]] for index in pointers},
    )
    target = GPUTarget("cuda", capability, 32)
    # As the launch in triton_dropout.py: no FMA contraction.
    options = {"enable_fp_fusion": False, "num_warps": NUM_WARPS}
    return triton.compile(source, target=target, options=options).asm


def sass_opcodes(cubin: bytes) -> tuple[list[str], int]:
    """The SASS opcodes of a cubin (padding NOPs left out) and its registers per thread."""
    import tempfile

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = _run(os.path.join(tools, "nvdisasm"), "-c", file.name)
        usage = _run(os.path.join(tools, "cuobjdump"), "--dump-resource-usage", file.name)
    opcodes = re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", listing, re.M
    )
    registers = re.search(r"REG:(\d+)", usage)
    if registers is None:
        raise KernelUnavailableError(f"cuobjdump printed no register count:\n{usage}")
    return [op for op in opcodes if op != "NOP"], int(registers.group(1))


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KernelUnavailableError(
            f"{os.path.basename(command[0])} failed: {done.stderr[-2000:]}"
        )
    return done.stdout
