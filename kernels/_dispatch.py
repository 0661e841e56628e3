"""Which kernel runs a fused dropout call, and running it.

:func:`route` is the one decision: the Triton kernel or the compiled CPU kernel (each through
its registered op, or, for an eager call that nothing traces or intercepts, straight: about 50 us
less per call on CPU, 60–80 us on a GPU), or the plain-torch reference. :func:`run` takes the
call's seed (given, or drawn from the generator in the form the route needs: ints for a straight
call, a tensor for an op) and runs the route's kernel.

``RNG_TRACKER_CPU_KERNEL=reference`` (read when rng_tracker.kernels is imported) makes
``impl="auto"`` take the reference on CPU for the whole process: debugging, timing against it.
"""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

import torch
from torch.autograd import forward_ad

from rng_tracker._torch_private import (
    dispatch_mode_depth,
    forward_ad_active,
    functorch_transforms_active,
    profiler_enabled,
    tracing_mode_active,
    unchecked_apply,
)
from rng_tracker.errors import KernelInputError, KernelUnavailableError
from rng_tracker.kernels import _cpu_kernel
from rng_tracker.kernels._call import DropoutCall, dropout_call
from rng_tracker.kernels._memory_format import in_memory_order, memory_order
from rng_tracker.kernels._ops import (
    OPS,
    call_op,
    dropout_backward,
    save_for_dropout_backward,
)
from rng_tracker.kernels._rng_source import (
    Words,
    draw_fresh_words,
    draw_seed,
    draw_words,
    refuse_capture,
    seed_tensor,
)
from rng_tracker.kernels._triton_kernel import (
    MAX_DIVISIONS,
    TRITON_IMPORT_ERROR,
    fused_dropout_triton,
    triton_runs_on,
)

Impl = Literal["auto", "triton", "cpu", "torch"]
IMPLS: tuple[str, ...] = get_args(Impl)
# "cpu_direct", "triton_direct": the kernel called straight from Python; "cpu", "triton": its op
Route = Literal["triton", "triton_direct", "cpu", "cpu_direct", "reference"]
# each op that has a straight route -> that route
_STRAIGHT: dict[str, Route] = {"cpu": "cpu_direct", "triton": "triton_direct"}
_OP_OF_STRAIGHT: dict[str, Route] = {straight: op for op, straight in _STRAIGHT.items()}

CPU_KERNEL_ENV = "RNG_TRACKER_CPU_KERNEL"


def _auto_cpu_choice() -> str:
    choice = os.environ.get(CPU_KERNEL_ENV, "compiled")
    if choice not in ("compiled", "reference"):
        raise KernelInputError(
            f"{CPU_KERNEL_ENV}={choice!r}; set it to 'compiled' (the default) or 'reference'"
        )
    return choice


_AUTO_CPU_COMPILED = _auto_cpu_choice() == "compiled"  # read once, at import


@torch.compiler.assume_constant_result
def _compiled_cpu_runs() -> bool:
    # A fact of the process: under torch.compile it is taken once, at trace time, as a constant.
    return _cpu_kernel.available()


def _nothing_intercepts(x: torch.Tensor) -> bool:
    """Whether the op would only forward to its kernel: nothing traces or intercepts ops
    (torch.compile, export, make_fx, torch.jit.trace, fake tensors, dispatch modes, functorch
    transforms)."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and dispatch_mode_depth() == 0
        and functorch_transforms_active() is False
    )


def _only_user_modes_intercept(x: torch.Tensor) -> bool:
    """Whether what intercepts an eager call on x is only dispatch modes of the user's (a
    profiler's, a FLOP counter's, checkpointing's ``check_rng``, ``debug`` and selective
    recompute): nothing traces it, x is a plain tensor, no functorch transform runs."""
    return (
        type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and functorch_transforms_active() is False
        and not tracing_mode_active()
    )


def unknown_impl(impl: object) -> KernelInputError:
    """The error of an ``impl`` that is none of :data:`IMPLS`."""
    names = ", ".join(map(repr, IMPLS[:-1])) + f" or {IMPLS[-1]!r}"
    return KernelInputError(f"impl must be {names}, got {impl!r}")


def route(x: torch.Tensor, impl: object, index_map: Any) -> Route:
    """The kernel of a call on x placed by ``index_map``, for ``impl``: the one place that decides.

    On CPU, "cpu" and "auto" run the compiled kernel where it runs here and places the map (up to
    64 merged dims), else the reference ("auto" also where ``RNG_TRACKER_CPU_KERNEL=reference``);
    Triton runs CPU tensors only when asked (the interpreter). Elsewhere "auto" runs Triton on a
    GPU where it places the map, else the reference. An impl that cannot run raises
    :class:`KernelUnavailableError` before anything is drawn.
    """
    if impl == "auto" or impl == "cpu":  # the usual calls first: this runs on every call
        if x.is_cpu:  # not x.device: it builds a device object (most of a microsecond)
            if (
                (impl == "cpu" or _AUTO_CPU_COMPILED)
                and len(index_map.dims) <= _cpu_kernel.MAX_DIMS
                and _compiled_cpu_runs()  # else warned once: the reference runs instead
            ):
                return _reached("cpu", x)
            return "reference"
        if impl == "cpu":
            raise KernelUnavailableError(
                f"impl='cpu' runs the compiled CPU kernel, but x is on {x.device}; use impl='auto'"
            )
    elif impl == "torch":
        return "reference"
    elif impl != "triton":
        raise unknown_impl(impl)
    runs = triton_runs_on(x.device) and "triton" in OPS
    placeable = len(index_map.dims) <= MAX_DIVISIONS + 1
    # off CPU, "auto": Triton on a GPU, the reference elsewhere and for maps it cannot place
    if impl == "auto":
        if runs and x.device.type == "cuda" and placeable:
            return _reached("triton", x)
        return "reference"
    if not runs:
        why = f" (importing triton failed: {TRITON_IMPORT_ERROR})" if TRITON_IMPORT_ERROR else ""
        raise KernelUnavailableError(
            f"impl='triton' cannot run for a tensor on {x.device} here{why}: it needs triton and a "
            "CUDA device (or TRITON_INTERPRET=1 for CPU tensors); use impl='torch' or 'auto'"
        )
    if not placeable:
        raise KernelUnavailableError(
            f"impl='triton' places index maps of up to {MAX_DIVISIONS + 1} merged dims; this "
            f"shard has {len(index_map.dims)} ({index_map.dims}); use impl='torch' or 'auto'"
        )
    return _reached("triton", x)


def _reached(op: Route, x: torch.Tensor) -> Route:
    """How a call on x reaches the kernel of ``op``: straight when nothing traces or intercepts
    it, else through the op."""
    return _STRAIGHT[op] if _nothing_intercepts(x) else op


def run(
    call: DropoutCall,
    impl: object,
    generator: object,
    seed: torch.Tensor | None,
    words: Words | None,
    in_place: bool = False,
) -> torch.Tensor:
    """The output of ``call`` on the route's kernel. ``seed`` (with its ``words`` where they were
    read) is a keyed call's; without it the words are drawn from ``generator`` (or x's device's).
    The output has x's memory format where x is dense (``_memory_format``), else row-major.

    ``in_place``: the output is written over x, which is returned. A kernel called straight
    (eager, nothing intercepts) on a contiguous x writes x itself, so no output tensor is made;
    elsewhere (an op, the reference, a strided x, forward AD) it is made and copied in."""
    if in_place and (not call.x.is_contiguous() or forward_ad_active()):
        return call.x.copy_(run(call, impl, generator, seed, words))
    if not call.x.is_contiguous():
        order = memory_order(call.x)
        if order is not None:
            in_order = in_memory_order(call, order)
            if in_order is not None:
                call, back = in_order
                return run(call, impl, generator, seed, words).permute(back)
            out = run(call._replace(x=call.x.contiguous()), impl, generator, seed, words)
            return torch.empty_like(call.x).copy_(out)
    if forward_ad_active():
        dual = _run_dual(call, impl, generator, seed, words)
        if dual is not None:
            return dual
    kernel = route(call.x, impl, call.index_map)
    if in_place and kernel not in _OP_OF_STRAIGHT:
        return call.x.copy_(run(call, impl, generator, seed, words))
    x, logical_numel = call.x, call.index_map.logical_numel
    if kernel == "cpu_direct":
        if seed is None:
            words = draw_words(x, call.p, logical_numel, generator)
        elif words is None:  # a seed on another device: brought here and read once
            seed = seed.to(x.device)
            words = tuple(seed.tolist())
    elif seed is None:
        if kernel == "triton_direct":  # the words go to the kernel as arguments: no tensor made
            refuse_capture(x)
            words = draw_words(x, call.p, logical_numel, generator)
        elif kernel in _STRAIGHT and _only_user_modes_intercept(x):
            # The op runs, seen by the modes, but keeps its words as a straight call does: what
            # autograd saves must not depend on which modes are active, since
            # torch.utils.checkpoint compares it between a forward and its recompute.
            words = draw_fresh_words(x, call.p, logical_numel, generator)
        else:  # an op's seed lives on x's device only for Triton
            device = x.device if kernel == "triton" else torch.device("cpu")
            seed = draw_seed(x, call.p, logical_numel, generator, device)
    else:  # keyed: nothing is drawn or read on the host, so a CUDA graph may capture the call
        seed, words = seed.to(x.device, non_blocking=True), None
    return _execute(kernel, call, seed, words, in_place)


def _run_dual(
    call: DropoutCall,
    impl: object,
    generator: object,
    seed: torch.Tensor | None,
    words: Words | None,
) -> torch.Tensor | None:
    """Forward-mode AD: ``call`` on the primals, with the tangent ``keep * (tx + tbias) / (1 - p)
    + tresidual`` (the same mask); None where no input carries a tangent."""
    unpacked = [
        None if t is None else forward_ad.unpack_dual(t) for t in (call.x, call.bias, call.residual)
    ]
    if all(u is None or u.tangent is None for u in unpacked):
        return None
    x, bias, residual = (None if u is None else u.primal for u in unpacked)
    tx, tbias, tresidual = (None if u is None else u.tangent for u in unpacked)
    if seed is None:  # drawn once: the tangent takes the primal's mask
        words = draw_words(x, call.p, call.index_map.logical_numel, generator)
        seed = seed_tensor(words, torch.device("cpu"))
    out = run(call._replace(x=x, bias=bias, residual=residual), impl, None, seed, words)
    tangent = tresidual
    if tx is not None or tbias is not None:
        t = torch.zeros_like(x) if tx is None else tx
        t = t if tbias is None else t + tbias
        dropped = run(dropout_call(t, None, None, call.p, call.index_map), impl, None, seed, words)
        tangent = dropped if tresidual is None else dropped + tresidual
    return forward_ad.make_dual(out, tangent)


def _execute(
    kernel: Route, call: DropoutCall, seed: torch.Tensor | None, words: Words | None, in_place: bool
) -> torch.Tensor:
    """Run ``kernel``: an op takes the seed tensor (made from drawn words where a straight call's
    autograd keeps them); a straight route takes the words where they are known (drawn, or read
    for the CPU), else the seed tensor, and may write x ``in_place``."""
    if kernel == "reference" or (kernel in _STRAIGHT and seed is not None):
        return call_op(kernel, call, seed)
    x, bias, residual = call.x, call.bias, call.residual
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):
        # A drawn call saves no seed tensor: its words ride on the autograd context as ints (no
        # one else holds them, so nothing can change them before backward); a keyed call saves
        # the caller's seed tensor, so an in-place change of it is reported.
        # p and the index map as plain arguments: apply walks a NamedTuple's fields (slower).
        # A straight route means no functorch transform is active (_nothing_intercepts), the
        # check Function.apply makes in Python before this call.
        return _direct_dropout_apply(
            x, bias, residual, seed, call.p, call.index_map, words, kernel, in_place
        )
    out = _direct(kernel, call, seed, words, in_place)
    if in_place:  # the kernel wrote x's memory: what autograd saved of x is now stale
        torch.autograd.graph.increment_version(x)
    return out


def _op_seed(kernel: Route, words: Words, x: torch.Tensor) -> torch.Tensor:
    """An op's seed tensor of drawn ``words``: on x's device for Triton, else on the CPU."""
    return seed_tensor(words, x.device if kernel == "triton" else torch.device("cpu"))


def _direct(
    kernel: Route, call: DropoutCall, seed: torch.Tensor | None, words: Words | None, in_place: bool
) -> torch.Tensor:
    """A kernel called straight, named as the op it stands in for in a profiler's trace (only
    while a profiler runs: the name costs microseconds); an op with drawn words, through the op
    (never in place: only straight routes are)."""
    if kernel in _STRAIGHT:
        return call_op(kernel, call, _op_seed(kernel, words, call.x))
    if profiler_enabled():  # the op's name as _ops registers it
        with torch.profiler.record_function(
            f"rng_tracker::fused_dropout_{_OP_OF_STRAIGHT[kernel]}"
        ):
            return _direct_kernel(kernel, call, seed, words, in_place)
    return _direct_kernel(kernel, call, seed, words, in_place)


def _direct_kernel(
    kernel: Route, call: DropoutCall, seed: torch.Tensor | None, words: Words | None, in_place: bool
) -> torch.Tensor:
    if kernel == "cpu_direct":
        return _cpu_kernel.fused_dropout_compiled(call, words, in_place)
    return fused_dropout_triton(call, seed if words is None else words, in_place=in_place)


class _DirectDropout(torch.autograd.Function):
    """Autograd of a straight call, and of an op's drawn call under a user's dispatch mode: the
    op's (mask regenerated), with a drawn call's words kept as ints instead of a saved seed."""

    @staticmethod
    def forward(
        ctx: Any, x, bias, residual, seed, p: float, index_map: Any, words, kernel, in_place: bool
    ):
        save_for_dropout_backward(ctx, bias, seed)
        ctx.p, ctx.index_map, ctx.words, ctx.kernel = p, index_map, words, kernel  # no tensor
        out = _direct(kernel, dropout_call(x, bias, residual, p, index_map), seed, words, in_place)
        if in_place:  # backward needs only the mask, never x's values
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        def regenerate(g: torch.Tensor, seed: torch.Tensor | None) -> torch.Tensor:
            # a saved seed is checked unchanged (ctx.saved_tensors); under a mode, the op runs
            call = dropout_call(g, None, None, ctx.p, ctx.index_map)
            kernel = _reached(_OP_OF_STRAIGHT.get(ctx.kernel, ctx.kernel), g)
            if ctx.words is not None:  # a drawn call: its words, kept as ints (no tensor saved)
                return _execute(kernel, call, None, ctx.words, False)
            return _execute(kernel, call, seed, None, False)

        return *dropout_backward(ctx, grad, regenerate), None, None, None, None, None, None


_direct_dropout_apply = unchecked_apply(_DirectDropout)
