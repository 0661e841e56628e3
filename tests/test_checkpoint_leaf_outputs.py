"""Reentrant checkpoints whose function returns a tensor made outside it (Megatron's MLP
returns ``(out, linear_fc2.bias)``): backward terminates and every tensor gets its gradient
once, bitwise as without the checkpoint.

Before the fix backward recursed into the checkpoint without end, so these run on harness
ranks, whose timeout turns a hang into a failure instead of a stuck suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import rng_tracker
import rng_tracker.megatron as megatron
from rng_tracker.parallel._mesh import destroy_model_parallel, init_model_parallel


class _MLP(torch.nn.Module):
    """Megatron's MLP shape: returns the output without its last bias, and that bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)
        self.fc2_bias = torch.nn.Parameter(torch.randn(8))
        self.scale = torch.randn(8).requires_grad_()  # a tensor leaf with grad, not a parameter

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with megatron.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(torch.nn.functional.gelu(self.fc1(x)), 0.3)
        return self.fc2(h), self.fc2_bias, self.scale


def _grads(mlp: _MLP, x: torch.Tensor, run: Callable[..., Any]) -> list[torch.Tensor]:
    """Gradients of x and every leaf after a forward (as ``run`` calls it) and backward."""
    leaves = [x, *mlp.parameters(), mlp.scale]
    for leaf in leaves:
        leaf.grad = None
    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    out, bias, scale = run(mlp, x)
    ((out + bias) * scale * torch.arange(8.0)).sum().backward()
    return [leaf.grad.clone() for leaf in leaves]


def _check_bitwise(runs: dict[str, Callable[..., Any]], x: torch.Tensor) -> None:
    torch.manual_seed(0)
    mlp = _MLP()
    expected = _grads(mlp, x, lambda m, t: m(t))
    for name, run in runs.items():
        got = _grads(mlp, x, run)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), name


def _leaf_outputs_single_process() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    _check_bitwise(
        {
            "rng_tracker.megatron.checkpoint": lambda m, t: megatron.checkpoint(m, False, t),
            "CheckpointFunction.apply": lambda m, t: megatron.CheckpointFunction.apply(m, False, t),
            "checkpoint(use_reentrant=True)": lambda m, t: rng_tracker.checkpoint(
                m, t, use_reentrant=True
            ),
            "checkpoint(use_reentrant=False)": lambda m, t: rng_tracker.checkpoint(m, t),
        },
        x,
    )
    # the reproduction, verbatim
    lin, bias = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.zeros(4))
    x = torch.randn(2, 4, requires_grad=True)
    out, b = megatron.checkpoint(lambda t: (lin(t), bias), False, x)
    (out + b).sum().backward()
    assert torch.equal(bias.grad, torch.full((4,), 2.0))


@pytest.mark.distributed(world_size=1, timeout=60)
def test_reentrant_checkpoint_returns_outer_leaves_with_exact_gradients_once():
    _leaf_outputs_single_process()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_leaf_outputs_with_distribute_saved_activations_on_tp_ranks(rank):
    init_model_parallel(tensor=2)
    try:
        x = torch.randn(4, 8, requires_grad=True)
        _check_bitwise(
            {"distributed": lambda m, t: megatron.checkpoint(m, True, t)},
            x,
        )
    finally:
        destroy_model_parallel()
