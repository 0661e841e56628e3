"""CUDA-only claims: graph-safe forks, the Philox offset contract, Triton == reference on GPU.

Skipped (and reported as skipped) on machines without CUDA, such as CI.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from rng_tracker import RNGStatesTracker
from rng_tracker.errors import CPURNGChangedWarning, KernelUnavailableError
from rng_tracker.kernels import Chunk, bias_dropout_add, dropout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_fork_draws_the_stream_and_restores_the_default_state():
    tracker = RNGStatesTracker("cuda")
    tracker.add("a", 5)
    torch.cuda.manual_seed(1)
    before = torch.cuda.get_rng_state()
    with tracker.fork("a"):
        got = torch.rand(8, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
    assert torch.equal(
        got, torch.rand(8, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    )
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(8, device="cuda")
    tracker.set_states(snapshot)  # snapshots never alias: this replays
    with tracker.fork("a"):
        again = torch.rand(8, device="cuda")
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(8, device="cuda"), again)


def test_cpu_draw_inside_a_device_fork_warns_once_per_site():
    tracker = RNGStatesTracker("cuda")
    tracker.add("a", 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with tracker.fork("a"):
                torch.rand(2)
    assert sum(issubclass(w.category, CPURNGChangedWarning) for w in caught) == 1


def test_kernel_key_is_the_seed_and_offset_advances_by_the_logical_count():
    g = torch.Generator("cuda").manual_seed(77)
    g.set_offset(8)
    dropout(
        torch.ones(10, device="cuda"),
        0.5,
        generator=g,
        shard=Chunk(0, 1, 3, extent=30),
        impl="triton",
    )
    assert g.get_offset() == 8 + 4 * ((30 + 3) // 4)


@pytest.mark.parametrize("columns", [1029, 1024], ids=["per-element", "per-group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_on_gpu_equals_reference_bitwise(dtype, columns):
    """Outputs and gradients, on the per-element path (odd columns) and the vector path."""
    results = []
    for impl in ("torch", "triton"):
        torch.manual_seed(0)
        x = torch.randn(37, columns, device="cuda").to(dtype).requires_grad_()
        bias = torch.randn(columns, device="cuda").to(dtype).requires_grad_()
        residual = torch.randn(37, columns, device="cuda").to(dtype).requires_grad_()
        g = torch.Generator("cuda").manual_seed(3)
        out = bias_dropout_add(x, bias, residual, 0.3, generator=g, impl=impl)
        out.backward(torch.randn_like(out))
        results.append((out, x.grad, bias.grad, residual.grad, g.get_offset()))
    for ours, reference in zip(*results):
        assert ours == reference if isinstance(ours, int) else torch.equal(ours, reference)


def test_capture_in_a_cuda_graph_is_refused_before_drawing():
    x = torch.ones(64, device="cuda")
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = generator.get_offset()
    with (
        pytest.raises(KernelUnavailableError, match="CUDA graph"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        dropout(x, 0.5)
    assert generator.get_offset() == offset


def test_capture_with_a_device_seed_replays_with_the_current_seed_words():
    """With seed= on the device nothing is read on the host, so capture is allowed and each
    replay uses the seed words as they are then (a device step counter in word 3)."""
    x = torch.ones(4096, device="cuda")
    seed = torch.tensor([7, 0, 0, 0], device="cuda")
    dropout(x, 0.5, seed=seed, impl="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dropout(x, 0.5, seed=seed, impl="triton")
    masks = []
    for step in range(3):
        seed[3].fill_(step)
        graph.replay()
        assert torch.equal(out, dropout(x, 0.5, seed=seed.clone(), impl="torch"))
        masks.append(out.clone())
    assert not torch.equal(masks[0], masks[1])
