"""Keyed trunc_normal_: one inverse-CDF draw per element, so no rank needs another's answer.

Claims: inside ``invariant_random(model, init="keyed")``, ``nn.init.trunc_normal_`` on a
parameter (also through a ``partial`` bound before the block, as torchtitan binds it) is
bitwise the keyed kernel's values, a shard is bitwise the slice of the full tensor, the values
follow the truncated normal; everything else (tensors of no model, ``generator=``, other
threads, after the block) runs torch's own ``trunc_normal_``; and one rank initialises its
shard without any other rank taking part (torch's resampling loop would need a collective).
"""

from __future__ import annotations

import math
import threading
from functools import partial

import pytest
import torch
import torch.distributed as dist

from rng_tracker._torch_private import trunc_normal_impl
from rng_tracker.errors import KernelInputError
from rng_tracker.kernels._keyed_fill import keyed_trunc_normal_
from rng_tracker.parallel.dtensor import invariant_random


def _truncated_moments(mean: float, std: float, a: float, b: float) -> tuple[float, float]:
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    mass = 0.5 * (math.erf(beta / math.sqrt(2)) - math.erf(alpha / math.sqrt(2)))
    shift = (pdf(alpha) - pdf(beta)) / mass
    var = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / mass - shift**2
    return mean + std * shift, std * math.sqrt(var)


def test_trunc_normal_of_a_parameter_is_the_keyed_kernel() -> None:
    model = torch.nn.Linear(300, 200)
    bound = partial(torch.nn.init.trunc_normal_, std=0.02, a=-0.06, b=0.06)  # as torchtitan
    state = torch.get_rng_state()
    with torch.no_grad(), invariant_random(model, init="keyed", seed=11):
        bound(model.weight)
        torch.nn.init.trunc_normal_(model.bias, mean=1.0, std=2.0, a=0.5, b=9.0)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from the generator
    weight = keyed_trunc_normal_(
        torch.empty(200, 300), 0.0, 0.02, -0.06, 0.06, seed=11, name="weight"
    )
    bias = keyed_trunc_normal_(torch.empty(200), 1.0, 2.0, 0.5, 9.0, seed=11, name="bias")
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)
    rows, cols = [0, 1, 2, 150, 199], [5, 6, 7, 299]
    part = keyed_trunc_normal_(
        torch.empty(5, 4), 0.0, 0.02, -0.06, 0.06, seed=11, name="weight", global_shape=(200, 300),
        indices=[rows, cols],
    )  # fmt: skip
    assert torch.equal(part, weight[rows][:, cols])


@pytest.mark.parametrize(
    "mean, std, a, b", [(0.0, 0.02, -0.06, 0.06), (1.0, 2.0, 0.5, 9.0), (0.0, 1.0, -2.0, 2.0)]
)
def test_values_follow_the_truncated_normal(mean: float, std: float, a: float, b: float) -> None:
    values = keyed_trunc_normal_(torch.empty(1 << 20), mean, std, a, b, seed=3, name="w")
    assert values.min().item() >= a and values.max().item() <= b
    expected_mean, expected_std = _truncated_moments(mean, std, a, b)
    # 2**20 samples: the standard error of the mean is std / 1024
    assert abs(values.double().mean().item() - expected_mean) < 5 * expected_std / 1024
    assert abs(values.double().std().item() / expected_std - 1) < 5e-3
    with pytest.raises(KernelInputError, match="std > 0"):
        keyed_trunc_normal_(torch.empty(4), mean, 0.0, a, b, seed=3, name="w")


def test_everything_else_runs_torchs_trunc_normal() -> None:
    original = trunc_normal_impl()
    model = torch.nn.Linear(8, 8)

    def torch_values(generator: torch.Generator | None = None) -> torch.Tensor:
        torch.manual_seed(5)
        return torch.nn.init.trunc_normal_(
            torch.empty(64, 64), std=0.5, a=-0.6, b=0.6, generator=generator
        )

    expected = torch_values()
    seen: dict[str, torch.Tensor] = {}
    with invariant_random(model, init="keyed", seed=1):
        assert trunc_normal_impl() is not original  # routed while the block is open
        other = threading.Thread(target=lambda: seen.update(thread=torch_values()))
        other.start()
        other.join()
        seen["generator"] = torch_values(torch.Generator().manual_seed(5))
    assert torch.equal(seen["thread"], expected)  # another thread: torch's own
    assert torch.equal(seen["generator"], torch_values(torch.Generator().manual_seed(5)))
    assert trunc_normal_impl() is original
    with pytest.raises(RuntimeError, match="inside"), invariant_random(model, init="keyed", seed=1):
        raise RuntimeError("inside")
    assert trunc_normal_impl() is original  # restored when the block raises too
    assert torch.equal(torch_values(), expected)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_rank_initialises_its_shard_without_the_others(rank: int) -> None:
    """Rank 0 initialises its shard of a Shard(0) parameter while rank 1 waits in a barrier:
    with torch's resampling loop the global any() would hang rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]))
    if rank == 0:
        with torch.no_grad(), invariant_random(model, init="keyed", seed=4):
            torch.nn.init.trunc_normal_(model.w, std=0.5, a=-0.6, b=0.6)
        full = keyed_trunc_normal_(torch.empty(10, 6), 0.0, 0.5, -0.6, 0.6, seed=4, name="w")
        assert torch.equal(model.w.to_local(), full[:5])
    dist.barrier()
