"""The fused dropout Triton kernel: one pass over memory, masks regenerated from Philox.

Each program handles ``BLOCK`` groups of 4 consecutive elements. When the index_map is
aligned (the usual case) one Philox4x32-10 call feeds a whole group with its four
output words; otherwise every element computes its own counter and picks its word.
The global index follows the index_map's division form (``IndexMap.divisions``) with the number
of divisions a compile-time constant (0 to 3: up to 4 merged dims). Index arithmetic that
the common layouts don't need is compiled out: no division for unsharded or contiguous-block
shards, one for an equal-chunk shard, one bias column per group instead of a modulo per
element, and a mask per group (vector loads) whenever numel % 4 == 0.
"""

from __future__ import annotations

import os

import torch

from rng_tracker.errors import KernelUnavailableError
from rng_tracker.kernels._call import DropoutCall
from rng_tracker.kernels.reference import keep_scale_unchecked, keep_threshold_unchecked

TRITON_IMPORT_ERROR: str | None = None
try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = f"{type(error).__name__}: {error}"


HAS_TRITON = triton is not None
_GROUPS_PER_PROGRAM = 256  # 1024 elements per program
NUM_WARPS = 4  # Triton's default; scripts/tune_triton_launch.py measures the alternatives
MAX_DIVISIONS = 3  # index maps of up to 4 merged dims (one division per dim but the last)


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on ``device`` here."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


if HAS_TRITON:

    @triton.jit
    def _pick(lane, w0, w1, w2, w3):
        return tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))

    @triton.jit
    def _philox_at(key, counter, word2, word3):
        # Philox4x32-10's four words at int64 counters c: counter (lo32(c), hi32(c), word2, word3).
        zero = tl.zeros_like(counter).to(tl.uint32)
        return tl.philox(
            key, counter.to(tl.uint32), (counter >> 32).to(tl.uint32), zero + word2, zero + word3
        )

    @triton.jit
    def _to_bf16_rne(value):
        # fp32 → bf16, round to nearest even, spelled out for the interpreter, which truncates.
        bits = value.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        rounded = tl.where(value != value, 0x7FC0, rounded).to(tl.uint16)
        return rounded.to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _widen(value, BF16_IN_SOFTWARE: tl.constexpr):
        # x, bias or residual as fp32. bf16 → fp32 is exact (the bits, shifted); spelled out for
        # the interpreter, whose conversion loses bf16 subnormals.
        if BF16_IN_SOFTWARE:
            bits = value.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
            return bits.to(tl.float32, bitcast=True)
        return value.to(tl.float32)

    # the seed words as arguments change from call to call: no recompile for their values
    @triton.jit(do_not_specialize=["key_arg", "base_arg", "word2_arg", "word3_arg"])
    def _fused_dropout_kernel(
        x_ptr,
        bias_ptr,
        residual_ptr,
        out_ptr,
        seed_ptr,
        key_arg,
        base_arg,
        word2_arg,
        word3_arg,
        numel,
        bias_numel,
        threshold,
        scale,
        offset,
        last_stride,
        inner1,
        gap1,
        inner2,
        gap2,
        inner3,
        gap3,
        HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        DIVISIONS: tl.constexpr,
        ALIGNED: tl.constexpr,
        WHOLE_GROUPS: tl.constexpr,
        BIAS_BY_GROUP: tl.constexpr,
        BF16_IN_SOFTWARE: tl.constexpr,
        SEED_IN_ARGS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        if SEED_IN_ARGS:  # words read on the host (drawn from a generator)
            key = key_arg.to(tl.int64).to(tl.uint64, bitcast=True)
            base = base_arg.to(tl.int64)
            word2 = word2_arg.to(tl.int64).to(tl.uint32)
            word3 = word3_arg.to(tl.int64).to(tl.uint32)
        else:  # a seed tensor on the device (keyed calls, the op)
            key = tl.load(seed_ptr).to(tl.uint64, bitcast=True)
            base = tl.load(seed_ptr + 1)
            word2 = tl.load(seed_ptr + 2).to(tl.uint32)  # counter words 2, 3: their low 32 bits
            word3 = tl.load(seed_ptr + 3).to(tl.uint32)
        groups = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
        lane = tl.arange(0, 4)
        local = groups[:, None] * 4 + lane[None, :]  # (BLOCK, 4) local flat indices
        if WHOLE_GROUPS:
            # numel % 4 == 0: one mask bit per group, so a group's 4 elements load as one vector.
            inside = tl.broadcast_to((groups < numel // 4)[:, None], (BLOCK, 4))
        else:
            inside = local < numel
        if ALIGNED:
            first = groups * 4  # last_stride is 1 when aligned
            if DIVISIONS >= 1:
                first += (groups * 4 // inner1) * gap1
            if DIVISIONS >= 2:
                first += (groups * 4 // inner2) * gap2
            if DIVISIONS >= 3:
                first += (groups * 4 // inner3) * gap3
            w0, w1, w2, w3 = _philox_at(key, base + (first + offset) // 4, word2, word3)
            word = _pick(lane[None, :], w0[:, None], w1[:, None], w2[:, None], w3[:, None])
        else:
            g = local * last_stride + offset
            if DIVISIONS >= 1:
                g += (local // inner1) * gap1
            if DIVISIONS >= 2:
                g += (local // inner2) * gap2
            if DIVISIONS >= 3:
                g += (local // inner3) * gap3
            w0, w1, w2, w3 = _philox_at(key, base + g // 4, word2, word3)
            word = _pick(g % 4, w0, w1, w2, w3)
        keep = word.to(tl.int64) >= threshold
        value = _widen(tl.load(x_ptr + local, mask=inside, other=0.0), BF16_IN_SOFTWARE)
        if HAS_BIAS:
            if BIAS_BY_GROUP:
                # bias_numel % 4 == 0: a group's 4 columns are consecutive and in bounds.
                column = tl.multiple_of((groups * 4) % bias_numel, 4)
                value += _widen(
                    tl.load(bias_ptr + column[:, None] + lane[None, :]), BF16_IN_SOFTWARE
                )
            else:
                bias_at = local % bias_numel
                value += _widen(
                    tl.load(bias_ptr + bias_at, mask=inside, other=0.0), BF16_IN_SOFTWARE
                )
        value = tl.where(keep, value * scale, 0.0)
        if HAS_RESIDUAL:
            value += _widen(tl.load(residual_ptr + local, mask=inside, other=0.0), BF16_IN_SOFTWARE)
        if BF16_IN_SOFTWARE:
            tl.store(out_ptr + local, _to_bf16_rne(value), mask=inside)
        else:
            tl.store(out_ptr + local, value.to(out_ptr.dtype.element_ty), mask=inside)


def fused_dropout_triton(
    call: DropoutCall,
    seed: torch.Tensor | tuple[int, int, int, int],
    *,
    launch=None,
    in_place: bool = False,
) -> torch.Tensor:
    """Launch the kernel with the seed words in a tensor on x's device, or as four int64 values
    (no tensor to make and copy: a straight eager call); ``launch`` wraps the kernel
    (``torch.library.wrap_triton`` inside a triton_op). ``in_place``: the output is written over
    x (contiguous), which is returned; each element is read before it is written."""
    x, bias, residual, p, index_map = call
    last_stride, terms = index_map.divisions()
    if len(terms) > MAX_DIVISIONS:
        raise KernelUnavailableError(
            f"the Triton kernel places up to {MAX_DIVISIONS + 1} merged dims; this index_map has "
            f"{len(terms) + 1} ({index_map.dims}); use impl='torch' (impl='auto' does)"
        )
    # inner1, gap1, inner2, gap2, inner3, gap3: the unused divisions divide by 1 and add 0
    divisions = [v for term in terms + ((1, 0),) * (MAX_DIVISIONS - len(terms)) for v in term]
    x = x.contiguous()
    out = x if in_place else torch.empty_like(x)
    if x.numel() == 0:
        return out
    kernel = _fused_dropout_kernel if launch is None else launch(_fused_dropout_kernel)
    # plain ints: triton.cdiv is a jit function, and calling one from Python costs ~10 us
    grid = (-(-x.numel() // (4 * _GROUPS_PER_PROGRAM)),)
    in_args = isinstance(seed, tuple)  # else a seed tensor, which the kernel loads
    if not in_args:
        # The kernel reads words 1..3 at seed_ptr + 1..3: a strided view (a column of a seed
        # table, an expanded word) is copied; a contiguous seed is read in place (graph capture).
        seed = seed.contiguous()
    kernel[grid](
        x,
        x if bias is None else bias.contiguous(),
        x if residual is None else residual.contiguous(),
        out,
        x if in_args else seed,
        *(seed if in_args else (0, 0, 0, 0)),
        x.numel(),
        1 if bias is None else bias.numel(),
        keep_threshold_unchecked(p),
        keep_scale_unchecked(p),
        index_map.offset,
        last_stride,
        *divisions,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        DIVISIONS=len(terms),
        ALIGNED=index_map.aligned,
        WHOLE_GROUPS=x.numel() % 4 == 0,
        BIAS_BY_GROUP=bias is not None and bias.numel() % 4 == 0,
        # A GPU converts bf16 in one instruction each way; the interpreter needs both spelled out.
        BF16_IN_SOFTWARE=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        SEED_IN_ARGS=in_args,
        BLOCK=_GROUPS_PER_PROGRAM,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no FMA contraction: products round as in the reference
    )
    return out
