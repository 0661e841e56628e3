"""Every torch.library registration: the fused dropout ops (reference, Triton and compiled
CPU) with their fake kernels and autograd, and ``keyed_seed``, the keyed words an exported
program reads when it runs.

The three ops share one schema (one function's annotations) and compute ``residual + keep * (x + bias) / (1 - p)`` (bias and
residual optional) with the mask of the seed tensor [key, base, c2, c3] and the index map as
:func:`~rng_tracker.kernels._index_map.to_op_args` passes it. Backward applies the same op to
the incoming gradient (same seed, no bias, no residual): the mask is regenerated, and the only
thing saved is the 32-byte seed tensor. Which op a call runs is the dispatcher's decision
(``_dispatch.route``); an op runs its kernel or raises.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rng_tracker._keyed import current_site_words
from rng_tracker.errors import KernelInputError, KernelUnavailableError
from rng_tracker.kernels._call import KERNEL_DTYPES, DropoutCall
from rng_tracker.kernels._cpu_kernel import fused_dropout_compiled
from rng_tracker.kernels._index_map import from_op_args, to_op_args
from rng_tracker.kernels._triton_kernel import HAS_TRITON, fused_dropout_triton, triton_runs_on
from rng_tracker.kernels.reference import (
    check_call_shapes,
    check_p,
    check_seed_shape,
    fused_dropout_reference_unchecked,
)


def save_for_dropout_backward(
    ctx: Any, bias: torch.Tensor | None, seed: torch.Tensor | None
) -> None:
    """Keep what ``dropout_backward`` reads: the seed tensor (None: the caller keeps the seed
    words itself), and the bias's dtype and size."""
    if seed is not None:
        ctx.save_for_backward(seed)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.bias_numel = None if bias is None else bias.numel()


def dropout_backward(
    ctx: Any,
    grad: torch.Tensor,
    regenerate: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of (x, bias, residual); ``regenerate(grad, seed)`` applies the forward's mask.

    ``ctx`` holds the seed (saved, if there was one), ``bias_dtype`` and ``bias_numel``
    (``save_for_dropout_backward``); ``regenerate`` gets the seed or None.
    """
    saved = ctx.saved_tensors
    seed = saved[0] if saved else None
    needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
    grad_x = grad_bias = None
    if needs_x or needs_bias:
        grad_x = regenerate(grad.contiguous(), seed)
    if needs_bias:
        rows = grad_x.reshape(-1, ctx.bias_numel) if ctx.bias_numel else grad_x.new_zeros(0, 0)
        # Accumulate in fp32 without materialising an fp32 copy of grad_x.
        grad_bias = rows.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_bias, grad if needs_residual else None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _x, bias, _residual, seed, p, offset, dims, logical_numel = inputs
    save_for_dropout_backward(ctx, bias, seed)
    ctx.params = (p, offset, dims, logical_numel)


@dataclass(frozen=True)
class _Takes:
    """What an op's kernel takes beyond the shared checks."""

    any_dtype: bool = False  # x of any dtype (the reference computes in fp32); else fp32/16, bf16
    seed_anywhere: bool = True  # else the seed on x's device (Triton loads it there)


def _check_op_call(call: DropoutCall, seed: torch.Tensor, takes: _Takes) -> None:
    """Refuse a call the op's kernel would read out of bounds or in the wrong type: the public
    functions check their calls, but ``torch.ops.rng_tracker.*`` may be called directly. From
    metadata alone (no value read, no sync), so fake tensors are checked at trace time too."""
    x, bias, residual, _, index_map = call
    check_call_shapes(x, bias, residual, index_map)
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise KernelInputError(
                f"{name} is {t.dtype} on {t.device} but x is {x.dtype} on {x.device}; the op "
                "takes them in one dtype on one device (rng_tracker.kernels converts them)"
            )
    if not takes.any_dtype and x.dtype not in KERNEL_DTYPES:
        raise KernelInputError(f"x has dtype {x.dtype}; the op computes in fp32, fp16 or bf16")
    check_seed_shape(seed)
    if not takes.seed_anywhere and seed.device != x.device:
        raise KernelInputError(
            f"seed is on {seed.device} but x is on {x.device}; the Triton op reads it there"
        )


# The one signature of the three ops (torch.library infers their schema from it); the index map
# goes in as _index_map.to_op_args gives it.
_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
        for name, annotation in (
            ("x", torch.Tensor),
            ("bias", torch.Tensor | None),
            ("residual", torch.Tensor | None),
            ("seed", torch.Tensor),
            ("p", float),
            ("offset", int),
            ("dims", list[int]),
            ("logical_numel", int),
        )
    ],
    return_annotation=torch.Tensor,
)


def _register(
    name: str,
    kernel: Callable[[DropoutCall, torch.Tensor], torch.Tensor],
    register: Callable[..., Any] = torch.library.custom_op,
    takes: _Takes = _Takes(),
    **options: Any,
) -> Any:
    """Register ``rng_tracker::<name>`` running ``kernel(call, seed)``, with its fake and autograd."""

    def checked_call(x, bias, residual, seed, p, offset, dims, logical_numel) -> DropoutCall:
        call = DropoutCall(x, bias, residual, check_p(p), from_op_args(offset, dims, logical_numel))
        _check_op_call(call, seed, takes)
        return call

    def body(x, bias, residual, seed, p, offset, dims, logical_numel):
        return kernel(checked_call(x, bias, residual, seed, p, offset, dims, logical_numel), seed)

    def fake(x, bias, residual, seed, p, offset, dims, logical_numel):
        checked_call(x, bias, residual, seed, p, offset, dims, logical_numel)
        return torch.empty_like(x, memory_format=torch.contiguous_format)  # x's metadata alone

    body.__signature__ = fake.__signature__ = _SIGNATURE
    op = register(f"rng_tracker::{name}", body, mutates_args=(), **options)
    if register is torch.library.custom_op:
        op.register_fake(fake)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grads = dropout_backward(ctx, grad, lambda g, seed: op(g, None, None, seed, *ctx.params))
        return *grads, None, None, None, None, None

    op.register_autograd(backward, setup_context=_setup_context)
    return op


def _reference(call: DropoutCall, seed: torch.Tensor) -> torch.Tensor:
    # row-major in, row-major out, as the other kernels (torch's ops would follow the residual)
    residual = None if call.residual is None else call.residual.contiguous()
    return fused_dropout_reference_unchecked(
        call._replace(x=call.x.contiguous(), residual=residual), seed
    )


def _compiled(call: DropoutCall, seed: torch.Tensor) -> torch.Tensor:
    return fused_dropout_compiled(call, tuple(seed.tolist()))


def _triton(call: DropoutCall, seed: torch.Tensor) -> torch.Tensor:
    if not triton_runs_on(call.x.device):  # the op called directly, as dispatch never calls it
        raise KernelUnavailableError(
            f"rng_tracker::fused_dropout_triton cannot run for a tensor on {call.x.device} here: "
            "Triton needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors); call "
            "rng_tracker.kernels.dropout(..., impl='auto'), or the op rng_tracker::fused_dropout"
        )
    # traceable by torch.compile: the launch goes through wrap_triton
    return fused_dropout_triton(call, seed, launch=torch.library.wrap_triton)


# route name (``_dispatch.route``) -> the op that runs it
OPS = {
    "reference": _register("fused_dropout", _reference, takes=_Takes(any_dtype=True)),
    "cpu": _register("fused_dropout_cpu", _compiled, device_types="cpu"),
}
if HAS_TRITON:
    OPS["triton"] = _register(
        "fused_dropout_triton", _triton, torch.library.triton_op, _Takes(seed_anywhere=False)
    )


def call_op(route: str, call: DropoutCall, seed: torch.Tensor) -> torch.Tensor:
    """``call`` through the op of ``route`` (the index map goes in as the op's int arguments)."""
    x, bias, residual, p, index_map = call
    return OPS[route](x, bias, residual, seed, p, *to_op_args(index_map))


@torch.library.custom_op(
    "rng_tracker::keyed_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def keyed_seed(device: torch.device, site_id: int) -> torch.Tensor:
    """The words [key, 0, site_id, step] of ``get_keyed_rng(device)`` when the op runs.

    What ``KeyedRNG.seed_tensor`` becomes under torch.export: the seed and step are read from
    the running process (a loaded program follows its ``set_step``), the site id is the
    program's. Tagged ``nondeterministic_seeded`` so no pass folds it into a constant.
    """
    return current_site_words(device, site_id)


@keyed_seed.register_fake
def _keyed_seed_fake(device: torch.device, site_id: int) -> torch.Tensor:
    return torch.empty(4, dtype=torch.int64, device=device)
