"""CUDA-only claims: graph-safe forks, the Philox offset contract, Triton == reference on GPU.

Skipped (and reported as skipped) on machines without CUDA, such as CI.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _python_probe import run_python

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_in_place_on_gpu_allocates_nothing_and_gives_the_out_of_place_bits(dtype):
    """The Triton kernel writes x itself: the CUDA allocator's peak stays at what is held."""
    x = torch.randn(1024, 4096, device="cuda").to(dtype)
    want = dropout(x, 0.3, generator=torch.Generator("cuda").manual_seed(3), impl="triton")
    target = x.clone()
    generator = torch.Generator("cuda").manual_seed(3)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    assert dropout(target, 0.3, True, True, generator=generator, impl="triton") is target
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - held < x.nbytes // 16
    assert torch.equal(target.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_on_gpu_converts_every_16_bit_value_like_the_reference(dtype):
    """All 65536 bit patterns (zeros, subnormals, inf) as x, bias and residual; NaNs stay NaN
    (their payloads are outside the claim)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    every = every.view(dtype)
    x, bias, residual = every.view(2**8, 2**8), every[: 2**8].roll(1), every.flip(0).view(2**8, -1)
    ref, got = (
        bias_dropout_add(
            x, bias, residual, 0.3, generator=torch.Generator("cuda").manual_seed(3), impl=impl
        )
        for impl in ("torch", "triton")
    )
    nan = ref.isnan()
    assert torch.equal(nan, got.isnan())
    assert torch.equal(ref.view(torch.int16)[~nan], got.view(torch.int16)[~nan])


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


def _forked_draws(tracker: RNGStatesTracker, x: torch.Tensor, calls: int) -> list[torch.Tensor]:
    out = []
    for _ in range(calls):
        with tracker.fork("stream"):
            out.append(torch.nn.functional.dropout(x, 0.5))
    return out


def test_fork_in_a_captured_graph_draws_the_stream_on_each_replay_once_registered():
    x = torch.ones(1 << 12, device="cuda")
    eager = RNGStatesTracker("cuda")
    eager.add("stream", 99)
    expected = _forked_draws(eager, x, 4)

    graphed = RNGStatesTracker("cuda")
    graphed.add("stream", 99)
    _forked_draws(graphed, x, 1)  # the warm-up draws the first mask, as eager's first call did
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    graphed.register_graph(graph)
    outer = torch.cuda.get_rng_state()
    with torch.cuda.graph(graph), graphed.fork("stream"):
        y = torch.nn.functional.dropout(x, 0.5)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(y.clone())
    for i, (got, want) in enumerate(zip(replays, expected[1:], strict=True)):
        assert torch.equal(got, want), f"replay {i} is not the stream's draw {i + 1}"
    assert not torch.equal(replays[0], replays[1])
    # the stream advanced by the replays: the next eager fork continues after them
    assert torch.equal(_forked_draws(graphed, x, 1)[0], _forked_draws(eager, x, 1)[0])
    assert torch.equal(torch.cuda.get_rng_state(), outer)


def test_fork_in_a_capture_without_registering_is_refused_by_torch():
    tracker = RNGStatesTracker("cuda")
    tracker.add("stream", 99)
    x = torch.ones(64, device="cuda")
    with (
        pytest.raises(RuntimeError, match="capture"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
        tracker.fork("stream"),
    ):
        torch.nn.functional.dropout(x, 0.5)


def test_checkpoint_in_a_capture_refuses_to_keep_rng_and_runs_keyed_without_it():
    from rng_tracker import checkpoint
    from rng_tracker.errors import CheckpointUsageError

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64).cuda()
    seed = torch.tensor([5, 0, 0, 0], device="cuda")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)

    def body(h: torch.Tensor) -> torch.Tensor:
        return dropout(layer(h), 0.2, seed=seed, impl="triton")

    def step(**options) -> list[torch.Tensor]:
        for p in (*layer.parameters(), x):
            p.grad = None
        checkpoint(body, x, **options).square().sum().backward()
        return [t.grad for t in (*layer.parameters(), x)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(preserve_rng_state=False)
    torch.cuda.current_stream().wait_stream(side)
    offset = torch.cuda.default_generators[0].get_offset()
    with (
        pytest.raises(CheckpointUsageError, match="preserve_rng_state=False"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        step()
    assert torch.cuda.default_generators[0].get_offset() == offset

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step(preserve_rng_state=False)
    for word in range(3):
        seed[3].fill_(word)
        graph.replay()
        replayed = [g.clone() for g in grads]
        for i, (a, b) in enumerate(zip(replayed, step(preserve_rng_state=False), strict=True)):
            assert torch.equal(a, b), f"step {word}: gradient {i} differs from the eager step"


def _cuda_block(x, w, tracker, masks):
    """Dropout of the CUDA default generator, in a fork and a nested fork, a fused dropout drawn
    from the forked stream, and a CPU draw: every source a checkpoint must replay."""
    h = torch.nn.functional.dropout(x @ w, 0.3)
    masks.append(h != 0)
    with tracker.fork("model-parallel-rng"):
        h = torch.nn.functional.dropout(h, 0.2)
        masks.append(h != 0)
        with tracker.fork("data-parallel-rng"):
            h = dropout(h, 0.1, impl="triton")
            masks.append(h != 0)
    noise = torch.rand(h.shape).to("cuda")
    return torch.tanh(h * noise)


def _cuda_run(use_reentrant: bool | None):
    from rng_tracker import checkpoint

    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    tracker = RNGStatesTracker("cuda")
    tracker.add("model-parallel-rng", 101)
    tracker.add("data-parallel-rng", 202)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    masks: list[torch.Tensor] = []
    if use_reentrant is None:
        out = _cuda_block(x, w, tracker, masks)
    else:
        out = checkpoint(_cuda_block, x, w, tracker, masks, use_reentrant=use_reentrant)
    out.square().sum().backward()
    end = (torch.cuda.get_rng_state(), torch.get_rng_state(), tracker.get_states())
    return x.grad, w.grad, masks, end


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_on_cuda_recomputes_every_mask_and_gradient_bitwise(use_reentrant):
    gx, gw, masks, end = _cuda_run(None)
    cx, cw, cmasks, cend = _cuda_run(use_reentrant)
    assert torch.equal(gx, cx) and torch.equal(gw, cw)
    assert len(cmasks) == 2 * len(masks)
    for first, forward, recompute in zip(masks, cmasks[:3], cmasks[3:], strict=True):
        assert torch.equal(first, forward) and torch.equal(forward, recompute)
    assert torch.equal(end[0], cend[0]) and torch.equal(end[1], cend[1])
    assert all(torch.equal(end[2][k].get_state(), cend[2][k].get_state()) for k in end[2])


def test_megatron_facade_on_cuda_seeds_forks_and_recomputes_like_megatron():
    """model_parallel_cuda_manual_seed on a real CUDA device: the model-parallel stream is
    Megatron's seed + 2718 (+ TP rank), and megatron.checkpoint's recompute is exact."""
    from rng_tracker import megatron

    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    tracker = megatron.get_cuda_rng_tracker()
    with tracker.fork():
        got = torch.rand(16, device="cuda")
    expected = torch.rand(16, device="cuda", generator=torch.Generator("cuda").manual_seed(3952))
    assert torch.equal(got, expected)
    assert torch.cuda.initial_seed() == 1234

    def block(x):
        with megatron.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x, 0.5) * x

    grads = []
    for checkpointed in (False, True):
        megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        x = torch.randn(4096, device="cuda", requires_grad=True)
        out = megatron.checkpoint(block, False, x) if checkpointed else block(x)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_the_triton_op_passes_torch_library_opcheck():
    """torch.library.opcheck on the Triton op with CUDA tensors (the CPU ops run it in
    test_kernels_ops; Triton's interpreter cannot run its fake kernel on CPU)."""
    from rng_tracker.kernels._index_map import index_map_of, to_op_args
    from rng_tracker.kernels._ops import OPS

    x = torch.randn(6, 8, device="cuda", requires_grad=True)
    bias = torch.randn(8, device="cuda", requires_grad=True)
    seed = torch.tensor([1234, 5, 0, 0], device="cuda")
    for args in ((x, None, None), (x, bias, x.detach().clone().requires_grad_())):
        full = (*args, seed, 0.3, *to_op_args(index_map_of(x.shape, None)))
        result = torch.library.opcheck(OPS["triton"], full)
        assert set(result.values()) == {"SUCCESS"}, result


def test_a_trace_of_a_cuda_generator_draw_is_refused_and_a_seed_input_exports():
    """make_fx and torch.export would keep a CUDA generator's key and counter base as
    constants (one mask on every run): refused before drawing; a seed= input exports."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(6, 8, device="cuda")
    before = torch.cuda.get_rng_state()
    with pytest.raises(KernelUnavailableError, match="seed="):
        make_fx(lambda t: dropout(t, 0.3))(x)
    assert torch.equal(torch.cuda.get_rng_state(), before)

    class Seeded(torch.nn.Module):
        def forward(self, t, seed):
            return dropout(t, 0.3, seed=seed)

    seed = torch.tensor([7, 0, 0, 0], device="cuda")
    program = torch.export.export(Seeded(), (x, seed)).module()
    assert torch.equal(program(x, seed), dropout(x, 0.3, seed=seed))


def test_cpu_draw_in_a_decorated_fork_warns_at_each_call_site():
    """A function decorated with ``@tracker.fork()`` that draws on the CPU warns at the line
    that called it (once per call site), not at a line of rng_tracker."""
    import inspect

    tracker = RNGStatesTracker("cuda")
    tracker.add("a", 5)

    @tracker.fork("a")
    def draw() -> None:
        torch.rand(2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = inspect.currentframe().f_lineno + 1
        draw()
        for _ in range(2):
            draw()
    sites = [(w.filename, w.lineno) for w in caught if issubclass(w.category, CPURNGChangedWarning)]
    assert sites == [(__file__, first), (__file__, first + 2)]


def test_vmap_of_a_cuda_draw_follows_vmaps_randomness_rules():
    """A CUDA generator's draw reads its key and offset on the host, which vmap does not see:
    'error' did not refuse and 'different' gave every sample one mask. Under a functorch
    transform the key is drawn as a random op (as on the CPU), so vmap's rules hold: 'error'
    refuses, 'same' gives one mask, 'different' one per sample. Written without a GPU."""
    ones = torch.ones(3, 64, device="cuda")
    with pytest.raises(RuntimeError, match="randomness error mode"):
        torch.func.vmap(lambda t: dropout(t, 0.5))(ones)
    same = torch.func.vmap(lambda t: dropout(t, 0.5), randomness="same")(ones)
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
    different = torch.func.vmap(lambda t: dropout(t, 0.5), randomness="different")(ones)
    assert len({tuple((row != 0).tolist()) for row in different}) == 3


def test_checking_the_cuda_device_type_leaves_cuda_uninitialised():
    """init_model_parallel's device check must not start CUDA: DeviceMesh moves each rank to its
    own GPU only while CUDA is uninitialised (tests/test_mesh.py shows the same with a stand-in
    CUDA module, as CI has no GPU). Run in a fresh interpreter, where nothing has started it."""
    out = run_python(
        "import torch\n"
        "from rng_tracker.parallel._mesh import _check_device_type\n"
        "_check_device_type('cuda')\n"
        "print(torch.cuda.is_initialized())\n"
    )
    assert out.strip() == "False"
