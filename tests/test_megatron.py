"""rng_tracker.megatron as a drop-in for megatron.core.tensor_parallel.random.

Part 1 ports Megatron-LM's own tests/unit_tests/tensor_parallel/test_random.py (core_r0.19.0,
the random.py megatron-core 0.19.2 ships) from CUDA to any device (the current device: CPU
here, CUDA where present), keeping its assertions. Each ported test runs twice, once per way a
user's code reaches these names (``source``):

- ``direct``: ``from rng_tracker.megatron import ...``, with rng_tracker's parallel state
  (``init_model_parallel``) where Megatron's ``Utils.initialize_model_parallel`` runs;
- ``installed``: ``rng_tracker.megatron.install()``, then Megatron's own module
  ``megatron.core.tensor_parallel.random`` (real megatron-core 0.19.2), with Megatron's
  ``parallel_state`` alone.

Where the port departs from Megatron's test, the test's docstring says how (``[port]``).
Part 2 checks the API surface against Megatron's signatures, written out here.
Part 3 checks the behaviours that Megatron's suite leaves out.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rng_tracker._tracker as tracker_module
from rng_tracker import megatron
from rng_tracker._device_rng import default_device, default_generator
from rng_tracker._tracker import get_rng_tracker
from rng_tracker.errors import (
    ParallelConfigError,
    ParallelConfigTypeError,
    ParallelStateError,
    RankError,
    RNGTrackerError,
    SeedReuseError,
    TrackerDeviceError,
    TrackerNotInitializedError,
    UnknownStreamError,
)
from rng_tracker.megatron import (
    CheckpointWithoutOutput,
    CheckpointWithoutOutputManager,
    CudaRNGStatesTracker,
    checkpoint,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from rng_tracker.parallel._mesh import destroy_model_parallel, init_model_parallel

DEVICE = default_device()
SOURCES = ("direct", "installed")
# the names Megatron's test module imports from its random module
_PORTED_NAMES = (
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_cuda_rng_tracker",
    "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
)


def device_generator() -> torch.Generator:
    return default_generator(DEVICE)


def seeded_state(seed: int) -> torch.Tensor:
    """The state a fresh generator of the current device has after manual_seed(seed)."""
    return torch.Generator(device=DEVICE).manual_seed(seed).get_state()


@pytest.fixture(autouse=True)
def _fresh_megatron_tracker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test starts without a Megatron tracker and leaves the process tracker as it was."""
    plain = {
        device: tracker
        for device, tracker in tracker_module._PROCESS_TRACKERS.items()
        if not isinstance(tracker, CudaRNGStatesTracker)
    }
    monkeypatch.setattr(tracker_module, "_PROCESS_TRACKERS", plain)
    state = device_generator().get_state()
    yield
    device_generator().set_state(state)


def _megatron_names(source: str) -> SimpleNamespace:
    """Megatron's names as ``source`` reaches them, and that path's parallel state."""
    if source == "direct":
        module: Any = megatron

        def init(tensor: int = 1, pipeline: int = 1) -> None:
            init_model_parallel(tensor=tensor, pipeline=pipeline)

        destroy = destroy_model_parallel
    else:
        megatron.install()
        import megatron.core.parallel_state as ps
        import megatron.core.tensor_parallel.random as module

        def init(tensor: int = 1, pipeline: int = 1) -> None:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor, pipeline)

        destroy = ps.destroy_model_parallel
    names = {name: getattr(module, name) for name in _PORTED_NAMES}
    return SimpleNamespace(**names, init_parallel=init, destroy_parallel=destroy)


@pytest.fixture(params=SOURCES)
def mg(request: pytest.FixtureRequest) -> Any:
    """Megatron's names in this process, from ``rng_tracker.megatron`` or, installed, from
    Megatron's own module (uninstalled again afterwards)."""
    was_installed = megatron.installed()
    yield _megatron_names(request.param)
    if request.param == "installed" and not was_installed:
        megatron.uninstall()


# ----------------------------------------------------------------------------------------
# Part 1: Megatron's test_random.py, ported
# ----------------------------------------------------------------------------------------
def test_cuda_rng_states_tracker(mg):
    """Port of test_cuda_rng_states_tracker. [port] Megatron's set_states stores anything (its
    test passes the int 1234); ours keeps only generator states, so the round trip uses a real
    state and 1234 gets a typed error (docs/migrating.md)."""
    rng_tracker = mg.CudaRNGStatesTracker()
    state = device_generator().get_state()
    rng_tracker.set_states({"state1": state})
    assert torch.equal(rng_tracker.get_states()["state1"], state)
    with pytest.raises(TrackerDeviceError, match=r"torch\.Tensor or a torch\.Generator"):
        rng_tracker.set_states({"state1": 1234})
    rng_tracker.reset()
    assert rng_tracker.get_states() == {}
    seed = 1111
    rng_tracker.add("state2", seed)
    with pytest.raises(SeedReuseError):
        rng_tracker.add("state3", seed)
    with pytest.raises(RNGTrackerError, match="already exists"):
        rng_tracker.add("state2", 111)
    assert rng_tracker.get_states()["state2"] is not None

    rng_tracker.fork("state2")  # not entered: changes nothing
    device_generator().manual_seed(seed)
    rng_state = device_generator().get_state()
    assert torch.equal(rng_tracker.get_states()["state2"], rng_state)


@pytest.mark.parametrize("use_cudagraphable_rng", [True, False])
def test_double_fork_cuda_rng_states_tracker(mg, use_cudagraphable_rng):
    """Port of test_double_fork_cuda_rng_states_tracker: nested forks of two streams draw
    what single forks draw, and leave the same states, in both state forms."""
    rng_tracker = mg.CudaRNGStatesTracker(use_cudagraphable_rng=use_cudagraphable_rng)
    rng_tracker.add("state1", 1234)
    rng_tracker.add("state2", 5678)
    double_1, double_2 = [], []
    with rng_tracker.fork("state1"):
        double_1.append(torch.randn(10, device=DEVICE))
        with rng_tracker.fork("state2"):
            double_2.append(torch.randn(10, device=DEVICE))
            with rng_tracker.fork("state1"):
                double_1.append(torch.randn(10, device=DEVICE))
            double_2.append(torch.randn(10, device=DEVICE))
        double_1.append(torch.randn(10, device=DEVICE))
    if use_cudagraphable_rng:
        double_state1 = rng_tracker.get_states()["state1"].get_state()
        double_state2 = rng_tracker.get_states()["state2"].get_state()
    else:
        double_state1 = rng_tracker.get_states()["state1"]
        double_state2 = rng_tracker.get_states()["state2"]

    rng_tracker.reset()
    rng_tracker.add("state1", 1234)
    rng_tracker.add("state2", 5678)
    single_1, single_2 = [], []
    with rng_tracker.fork("state1"):
        single_1.extend(torch.randn(10, device=DEVICE) for _ in range(3))
    with rng_tracker.fork("state2"):
        single_2.extend(torch.randn(10, device=DEVICE) for _ in range(2))
    if use_cudagraphable_rng:
        single_state1 = rng_tracker.get_states()["state1"].get_state()
        single_state2 = rng_tracker.get_states()["state2"].get_state()
    else:
        single_state1 = rng_tracker.get_states()["state1"]
        single_state2 = rng_tracker.get_states()["state2"]

    for double, single in zip(double_1 + double_2, single_1 + single_2, strict=True):
        assert torch.equal(double, single)
    assert torch.equal(double_state1, single_state1)
    assert torch.equal(double_state2, single_state2)


def test_convert_cuda_rng_state(mg):
    """Port of test_convert_cuda_rng_state. [port] Megatron's TE tracker is replaced by what
    ``initialize_rng_tracker(use_te_rng_tracker=True)`` gives here (a graph-safe tracker), so
    the TE legs run without TransformerEngine."""
    device_generator().manual_seed(999)
    torch.randn(10, device=DEVICE)
    rng_state = device_generator().get_state()

    # from non-graphable to graphable
    tracker = mg.CudaRNGStatesTracker(use_cudagraphable_rng=False)
    tracker.add("state1", 123)
    for _ in range(3):
        with tracker.fork("state1"):
            torch.randn(10, device=DEVICE)
    state = mg.convert_cuda_rng_state(tracker.states_["state1"], to_graphable=True)
    rand_tensors = []
    for _ in range(3):
        with tracker.fork("state1"):
            rand_tensors.append(torch.randn(10, device=DEVICE))

    graphable = mg.CudaRNGStatesTracker(use_cudagraphable_rng=True)
    graphable.set_states({"state1": state.clone_state()})
    for i in range(3):
        with graphable.fork("state1"):
            assert torch.equal(torch.randn(10, device=DEVICE), rand_tensors[i])

    mg.initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    te_tracker = mg.get_cuda_rng_tracker()
    te_tracker.set_states({"state1": state})
    for i in range(3):
        with te_tracker.fork("state1"):
            assert torch.equal(torch.randn(10, device=DEVICE), rand_tensors[i])

    # from graphable to non-graphable
    graphable = mg.CudaRNGStatesTracker(use_cudagraphable_rng=True)
    graphable.add("state2", 123)
    for _ in range(3):
        with graphable.fork("state2"):
            torch.randn(10, device=DEVICE)
    state = mg.convert_cuda_rng_state(graphable.states_["state2"], to_graphable=False)
    rand_tensors = []
    for _ in range(3):
        with graphable.fork("state2"):
            rand_tensors.append(torch.randn(10, device=DEVICE))
    tracker = mg.CudaRNGStatesTracker(use_cudagraphable_rng=False)
    tracker.set_states({"state2": state})
    for i in range(3):
        with tracker.fork("state2"):
            assert torch.equal(torch.randn(10, device=DEVICE), rand_tensors[i])

    # from the TE-role tracker to non-graphable
    te_tracker.add("state3", 123)
    for _ in range(3):
        with te_tracker.fork("state3"):
            torch.randn(10, device=DEVICE)
    state = mg.convert_cuda_rng_state(te_tracker.states_["state3"], to_graphable=False)
    rand_tensors = []
    for _ in range(3):
        with te_tracker.fork("state3"):
            rand_tensors.append(torch.randn(10, device=DEVICE))
    tracker = mg.CudaRNGStatesTracker(use_cudagraphable_rng=False)
    tracker.set_states({"state3": state})
    for i in range(3):
        with tracker.fork("state3"):
            assert torch.equal(torch.randn(10, device=DEVICE), rand_tensors[i])

    assert torch.equal(rng_state, device_generator().get_state())


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.distributed(world_size=4, timeout=120)
def test_model_parallel_cuda_manual_seed(rank, source):
    """Port of test_model_parallel_cuda_manual_seed. [port] Megatron runs tp=4, pp=2 on 8 GPUs;
    here tp=2, pp=2 on 4 gloo ranks (both axes above 1, half the processes on a 2-core CI
    machine). Also checks bitwise that the stream is seeded with seed + 2718 + tp_rank, with
    tp_rank = rank % 2 (Megatron's order puts tp fastest), not read back from the library."""
    mg = _megatron_names(source)
    mg.init_parallel(2, 2)
    try:
        mg.model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        rng_tracker = mg.get_cuda_rng_tracker()
        assert rng_tracker.get_states()["model-parallel-rng"] is not None
        tp_rank = rank % 2
        expected = seeded_state(2718 + tp_rank)
        assert torch.equal(rng_tracker.get_states()["model-parallel-rng"], expected)
    finally:
        mg.destroy_parallel()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.distributed(world_size=2, timeout=90)
def test_checkpoint(rank, source):
    """Port of test_checkpoint: Megatron's checkpoint, and with distribute_saved_activations
    the caller's input keeps only its 1/tp flat chunk until backward (tp=2 on 2 gloo ranks)."""
    mg = _megatron_names(source)

    def test_forward(*inputs):
        return inputs[0] + inputs[1]

    assert torch.equal(
        torch.ones(16) * 3, mg.checkpoint(test_forward, None, torch.ones(16), torch.ones(16) * 2)
    )

    mg.init_parallel(2, 1)
    try:
        input1 = torch.ones((4, 4), device=DEVICE)
        input1.requires_grad_(True)
        input2 = torch.ones((4, 4), device=DEVICE) * 2
        output = mg.checkpoint(test_forward, True, input1, input2)

        assert torch.equal(output, torch.ones((4, 4), device=DEVICE) * 3)
        assert input1.data.shape == (8,)

        output.sum().backward()
        assert input1.grad is not None
        assert torch.equal(input1.grad, torch.ones((4, 4), device=DEVICE))
    finally:
        mg.destroy_parallel()


def test_checkpoint_without_output(mg):
    """Port of test_checkpoint_without_output: the discarded output is recomputed and the
    gradient equals the uncheckpointed one. [port] No parallel state: Megatron's test sets up
    tp=1, which this test does not read."""

    def normal_forward(x):
        return torch.nn.functional.gelu(x) * x

    def checkpoint_forward(x):
        ckpt = mg.CheckpointWithoutOutput()
        y = ckpt.checkpoint(torch.nn.functional.gelu, x) * x
        ckpt.discard_output_and_register_recompute(y)
        return y

    input1 = torch.ones((4, 4), requires_grad=True)
    output1 = normal_forward(input1)
    input2 = torch.ones((4, 4), requires_grad=True)
    output2 = checkpoint_forward(input2)
    assert torch.equal(output1, output2)

    output1.backward(torch.ones((4, 4)), retain_graph=True)
    output2.backward(torch.ones((4, 4)), retain_graph=True)
    assert torch.equal(input1.grad, input2.grad)


class _SplitSavingLinear(torch.autograd.Function):
    """A linear layer that saves views of its input (as TE's GroupedLinear does) and
    checks in backward that they still have storage."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (rows, in)
        ctx.save_for_backward(*torch.tensor_split(flat, 2, dim=0), weight)
        ctx.shape = x.shape
        return (flat @ weight.t()).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *parts, weight = ctx.saved_tensors
        for part in parts:
            if part.numel() > 0 and part.untyped_storage().size() == 0:
                raise RuntimeError("a saved view points to freed storage")
        flat = torch.cat(parts, dim=0)  # (rows, in)
        grad_flat = grad.reshape(-1, grad.shape[-1])  # (rows, out)
        return (grad_flat @ weight).reshape(ctx.shape), grad_flat.t() @ flat


def test_checkpoint_without_output_view_sharing_regression(mg):
    """Port of test_checkpoint_without_output_view_sharing_regression: views of the
    discarded output saved by the next op see the recomputed data. [port] No parallel state
    (Megatron's tp=1 is not read)."""

    def normal_forward(x, weight):
        return _SplitSavingLinear.apply(torch.nn.functional.gelu(x), weight)

    def checkpoint_forward(x, weight):
        ckpt = mg.CheckpointWithoutOutput()
        y = _SplitSavingLinear.apply(ckpt.checkpoint(torch.nn.functional.gelu, x), weight)
        ckpt.discard_output_and_register_recompute(y)
        return y

    torch.manual_seed(0)
    input1 = torch.randn((3, 2, 8), requires_grad=True)
    weight1 = torch.randn((6, 8), requires_grad=True)
    input2 = input1.detach().clone().requires_grad_(True)
    weight2 = weight1.detach().clone().requires_grad_(True)
    output1 = normal_forward(input1, weight1)
    output2 = checkpoint_forward(input2, weight2)
    assert torch.equal(output1, output2)  # [port] Megatron: allclose; the same ops here, bitwise

    grad = torch.randn_like(output1)
    output1.backward(grad, retain_graph=True)
    output2.backward(grad, retain_graph=True)
    assert torch.equal(input1.grad, input2.grad)
    assert torch.equal(weight1.grad, weight2.grad)


class _NormAndResidual(torch.autograd.Function):
    """RMS norm that also returns its input as the residual (TE's fused residual norm):
    the second output shares storage with the input."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rms = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()  # (rows, 1)
        ctx.save_for_backward(x, weight, rms)
        return (x.float() * rms).to(x.dtype) * weight, x

    @staticmethod
    def backward(ctx: Any, grad_normed: torch.Tensor, grad_residual: torch.Tensor) -> Any:
        x, weight, rms = ctx.saved_tensors
        normed = x.float() * rms  # (rows, hidden)
        g = (grad_normed * weight).float()
        grad_x = g * rms - normed * (g * normed).sum(-1, keepdim=True) / x.shape[-1]
        grad_weight = (grad_normed * normed.to(x.dtype)).sum(dim=tuple(range(grad_normed.ndim - 1)))
        return grad_x.to(x.dtype) + grad_residual, grad_weight


@pytest.mark.parametrize("use_manager", [False, True])
def test_checkpoint_without_output_retain_input_tensors(use_manager):
    """Port of test_checkpoint_without_output_retain_input_tensors: an output that aliases
    the input is not freed, with or without the manager. ``direct`` only: install() leaves
    megatron-core's own CheckpointWithoutOutputManager in place."""
    hidden = 32
    torch.manual_seed(0)
    weight = torch.randn(hidden, requires_grad=True)

    def fused_norm(x):
        return _NormAndResidual.apply(x, weight)

    def normal_forward(x):
        normed, residual = fused_norm(x)
        return normed + residual

    kept = {}

    def checkpoint_forward(x):
        manager = CheckpointWithoutOutputManager() if use_manager else None
        ckpt = CheckpointWithoutOutput(ckpt_manager=manager, retain_input_tensors=True)
        normed, residual = ckpt.checkpoint(fused_norm, x)
        kept["normed"], kept["residual"] = normed, residual
        y = normed + residual
        if manager is None:
            ckpt.discard_output_and_register_recompute(y)
        else:
            manager.discard_all_outputs_and_register_unified_recompute(y)
        return y

    input_ref = torch.randn((4, hidden), requires_grad=True)
    input1 = input_ref.detach().clone().requires_grad_(True)
    output1 = normal_forward(input1)
    input2 = input_ref.detach().clone().requires_grad_(True)
    weight.grad = None
    output2 = checkpoint_forward(input2)
    # the residual aliases the input: kept, with the input's values; the normed output freed
    assert kept["residual"].untyped_storage().nbytes() > 0
    assert torch.equal(kept["residual"], input_ref)
    assert kept["normed"].untyped_storage().nbytes() == 0
    assert torch.equal(output1, output2)  # [port] Megatron: allclose; the same ops here, bitwise

    grad = torch.randn_like(output1)
    output1.backward(grad)
    ref_input_grad, ref_weight_grad = input1.grad.clone(), weight.grad.clone()
    weight.grad = None
    output2.backward(grad)
    assert torch.equal(ref_input_grad, input2.grad)
    assert torch.equal(ref_weight_grad, weight.grad)


# ----------------------------------------------------------------------------------------
# Part 2: the API surface
# ----------------------------------------------------------------------------------------
# Megatron-LM's signatures (megatron/core/tensor_parallel/random.py at d98e8a6), as
# lambda parameter lists: every public name, and the private names other modules of
# Megatron (or its users) import from it.
MEGATRON_FUNCTIONS = {
    "_get_cuda_rng_state": "device='cuda', clone=False, graph_safe=False",
    "_set_cuda_rng_state": "new_state, device=-1, graph_safe=False",
    "convert_cuda_rng_state": "state, to_graphable=False",
    "get_expert_parallel_rng_tracker_name": "",
    "get_data_parallel_rng_tracker_name": "",
    "get_gtp_remat_rng_tracker_name": "is_expert=False",
    "initialize_rng_tracker": (
        "use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False, "
        "force_reset=False"
    ),
    "get_cuda_rng_tracker": (
        "use_te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False"
    ),
    "get_all_rng_states": "",
    "model_parallel_cuda_manual_seed": (
        "seed, te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False, "
        "tp_rank=None, ep_rank=None, etp_rank=None, gtp_remat_rank=None, egtp_remat_rank=None, "
        "force_reset_rng=False, gtp_remat_world_size=None, egtp_remat_world_size=None"
    ),
    "is_graph_safe_cuda_rng_tracker": "cuda_rng_tracker",
    "_get_all_rng_states": "",
    "_set_all_rng_states": "cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker",
    "_fork_rng": "",
    "is_checkpointing": "",
    "checkpoint": "function, distribute_saved_activations, *args",
}
MEGATRON_METHODS = {
    ("CudaRNGStatesTracker", "__init__"): (
        "self, use_cudagraphable_rng=False, is_inference_rng_tracker=False"
    ),
    ("CudaRNGStatesTracker", "is_initialized"): "self",
    ("CudaRNGStatesTracker", "reset"): "self",
    ("CudaRNGStatesTracker", "get_states"): "self",
    ("CudaRNGStatesTracker", "set_states"): "self, states",
    ("CudaRNGStatesTracker", "add"): "self, name, seed",
    ("CudaRNGStatesTracker", "fork"): "self, name='model-parallel-rng'",
    # Megatron's forward(ctx, ...) is reached through apply(...)
    ("CheckpointFunction", "apply"): "run_function, distribute_saved_activations, *args",
    ("CheckpointWithoutOutput", "__init__"): (
        "self, fp8=False, ckpt_manager=None, retain_input_tensors=False"
    ),
    ("CheckpointWithoutOutput", "checkpoint"): "self, run_function, *args",
    ("CheckpointWithoutOutput", "discard_output_and_register_recompute"): "self, hook_tensor",
    ("CheckpointWithoutOutputManager", "__init__"): "self",
    ("CheckpointWithoutOutputManager", "add_checkpoint"): "self, ckpt",
    (
        "CheckpointWithoutOutputManager",
        "discard_all_outputs_and_register_unified_recompute",
    ): "self, hook_tensor",
}
MEGATRON_CONSTANTS = {
    "_MODEL_PARALLEL_RNG_TRACKER_NAME": "model-parallel-rng",
    "_EXPERT_PARALLEL_RNG_TRACKER_NAME": "expert-parallel-rng",
    "_DATA_PARALLEL_RNG_TRACKER_NAME": "data-parallel-rng",
    "_GTP_REMAT_RNG_TRACKER_NAME": "gtp-remat-rng",
    "_EXPERT_GTP_REMAT_RNG_TRACKER_NAME": "egtp-remat-rng",
    "HAVE_TE": False,
    "IS_CHECKPOINTING": False,
}
# Defaults that differ on purpose (docs/migrating.md): the current device, not "cuda".
DIFFERENT_DEFAULTS = {("_get_cuda_rng_state", "device"): None}


def _compatible(where: str, ours: inspect.Signature, megatron_params: str) -> list[str]:
    """Megatron's parameters come first in ours, with the same names, kinds, order and
    defaults; any parameter we add after them is keyword-only with a default."""
    theirs = list(inspect.signature(eval(f"lambda {megatron_params}: None")).parameters.values())
    mine = list(ours.parameters.values())
    problems = []
    for index, expected in enumerate(theirs):
        if index >= len(mine):
            problems.append(f"{where}: missing parameter {expected.name!r}")
            continue
        got = mine[index]
        if (got.name, got.kind) != (expected.name, expected.kind):
            problems.append(f"{where}: parameter {index} is {got} but Megatron has {expected}")
            continue
        default = DIFFERENT_DEFAULTS.get((where, got.name), expected.default)
        if got.default != default:
            problems.append(
                f"{where}: {got.name} defaults to {got.default!r}, Megatron {default!r}"
            )
    for extra in mine[len(theirs) :]:
        if (
            extra.kind is not inspect.Parameter.KEYWORD_ONLY
            or extra.default is inspect.Parameter.empty
        ):
            problems.append(f"{where}: extra parameter {extra} is not keyword-only with a default")
    return problems


def test_every_megatron_name_exists_with_a_compatible_signature():
    """Each name of Megatron's random.py (public, and private ones imported elsewhere)
    exists here with Megatron's parameter names, kinds, order and defaults."""
    problems = []
    for name, params in MEGATRON_FUNCTIONS.items():
        if not callable(getattr(megatron, name, None)):
            problems.append(f"{name}: missing")
            continue
        problems += _compatible(name, inspect.signature(getattr(megatron, name)), params)
    for (cls_name, method), params in MEGATRON_METHODS.items():
        cls = getattr(megatron, cls_name, None)
        if not callable(getattr(cls, method, None)):
            problems.append(f"{cls_name}.{method}: missing")
            continue
        problems += _compatible(
            f"{cls_name}.{method}", inspect.signature(getattr(cls, method)), params
        )
    for name, value in MEGATRON_CONSTANTS.items():
        if getattr(megatron, name, object()) != value:
            problems.append(f"{name}: {getattr(megatron, name, 'missing')!r}, expected {value!r}")
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    for attr, kind in [
        ("states_", "mapping"),
        ("seeds_", set),
        ("use_cudagraphable_rng", bool),
        ("is_inference_rng_tracker", bool),
    ]:
        value = getattr(tracker, attr, None)
        ok = (
            "a" in value and value["a"] is not None
            if kind == "mapping"
            else isinstance(value, kind)
        )
        if not ok:
            problems.append(f"CudaRNGStatesTracker.{attr}: {value!r}")
    assert tracker.seeds_ == {1}
    assert set(megatron.__all__) >= {n for n in MEGATRON_FUNCTIONS if not n.startswith("_")}
    assert problems == []


# ----------------------------------------------------------------------------------------
# Part 3: behaviours Megatron's suite leaves out
# ----------------------------------------------------------------------------------------
def test_tracker_attributes_follow_megatron():
    """states_ is a read-only view of the stored states, seeds_ the seeds added since the
    last reset, is_initialized true after add or set_states (even of nothing)."""
    tracker = CudaRNGStatesTracker()
    assert not tracker.is_initialized() and tracker.seeds_ == set()
    tracker.add("a", 5)
    tracker.add("b", 6)
    assert tracker.is_initialized() and tracker.seeds_ == {5, 6}
    assert torch.equal(tracker.states_["a"], seeded_state(5))
    with pytest.raises(TypeError):
        tracker.states_["a"] = seeded_state(7)  # type: ignore[index]
    with tracker.fork("a"):
        torch.rand(2, device=DEVICE)
    assert not torch.equal(tracker.states_["a"], seeded_state(5))
    tracker.reset()
    assert not tracker.is_initialized() and dict(tracker.states_) == {}
    tracker.set_states({})
    assert tracker.is_initialized()


def test_manual_seed_takes_megatron_positional_order_and_arithmetic():
    """(seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, tp_rank,
    ep_rank, etp_rank) positionally; seeds are Megatron's, bitwise."""
    plan = model_parallel_cuda_manual_seed(7, False, False, True, 3, 2, 1)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    assert all(isinstance(s, torch.Generator) for s in states.values())
    expected = {
        "data-parallel-rng": 7,
        "model-parallel-rng": 7 + 2718 + 3,
        "expert-parallel-rng": 7 + 1024 + 100 * 2 + 1,
    }
    assert list(states) == list(expected)
    for name, seed in expected.items():
        assert torch.equal(states[name].get_state(), seeded_state(seed))
    assert torch.equal(device_generator().get_state(), seeded_state(7))
    assert plan.stream_seeds == expected and tracker.seeds_ == set(expected.values())


def test_manual_seed_plans_its_seeds_once(monkeypatch: pytest.MonkeyPatch):
    """model_parallel_cuda_manual_seed derives Megatron's seeds once and applies that plan: the
    seed derivation runs a single time per call (it ran twice, once to check and once more
    inside model_parallel_seed), and the streams hold the planned seeds."""
    import rng_tracker._seeds as seeds_module

    real = seeds_module.plan_seeds
    calls = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("scheme"))
        return real(*args, **kwargs)

    monkeypatch.setattr(seeds_module, "plan_seeds", counting)
    monkeypatch.setattr(megatron, "plan_seeds", counting)
    plan = model_parallel_cuda_manual_seed(21, tp_rank=1, ep_rank=1, etp_rank=0)
    assert calls == ["megatron"]
    states = get_cuda_rng_tracker().get_states()
    assert list(states) == list(plan.stream_seeds)
    for name, seed in plan.stream_seeds.items():
        assert torch.equal(states[name], seeded_state(seed)), name


def test_use_cudagraphable_rng_picks_the_state_form_and_force_reset_rng_applies_it():
    """Megatron creates its tracker once: later flags apply only with force_reset_rng.
    use_cudagraphable_rng=False keeps uint8 tensors, True torch.Generator objects; both
    draw the same values."""
    model_parallel_cuda_manual_seed(11)
    first = get_cuda_rng_tracker()
    assert not megatron.is_graph_safe_cuda_rng_tracker(first)
    assert all(isinstance(s, torch.Tensor) for s in first.get_states().values())
    with first.fork():
        plain = torch.rand(6, device=DEVICE)

    model_parallel_cuda_manual_seed(11, use_cudagraphable_rng=True)
    assert get_cuda_rng_tracker() is first

    model_parallel_cuda_manual_seed(11, use_cudagraphable_rng=True, force_reset_rng=True)
    second = get_cuda_rng_tracker()
    assert second is not first and megatron.is_graph_safe_cuda_rng_tracker(second)
    assert all(isinstance(s, torch.Generator) for s in second.get_states().values())
    with second.fork():
        assert torch.equal(torch.rand(6, device=DEVICE), plain)


def test_te_rng_tracker_gives_a_graph_safe_tracker_without_transformer_engine():
    """te_rng_tracker=True asks for what TE's tracker is (graph-safe states); TE is not used."""
    model_parallel_cuda_manual_seed(3, te_rng_tracker=True, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    assert megatron.HAVE_TE is False
    assert megatron.is_graph_safe_cuda_rng_tracker(tracker)
    assert isinstance(tracker.get_states()["model-parallel-rng"], torch.Generator)


def test_inference_tracker_keeps_no_streams_and_forks_the_default_generator():
    """inference_rng_tracker=True: add/set_states do nothing, fork draws from the default
    generator unchanged; the default generator is still seeded."""
    model_parallel_cuda_manual_seed(123, inference_rng_tracker=True, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    assert tracker.get_states() == {} and tracker.is_inference_rng_tracker
    before = device_generator().get_state()
    assert torch.equal(before, seeded_state(123))
    with tracker.fork("no-such-stream"):
        inside = torch.rand(5, device=DEVICE)
    device_generator().set_state(before)
    assert torch.equal(inside, torch.rand(5, device=DEVICE))


def test_an_inference_tracker_accepts_the_seeds_megatron_accepts():
    """Megatron's inference tracker adds no streams, so megatron-core never makes, and never
    refuses, their seeds: tp_rank 6 with ep_rank 17 (one seed for two streams) or seed 2**64-1
    (streams past 2**64-1). Only the default generator is seeded; a tracker that keeps streams
    still refuses them."""
    for seed, ranks in ((100, {"tp_rank": 6, "ep_rank": 17, "etp_rank": 0}), (2**64 - 1, {})):
        plan = model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True, **ranks
        )
        assert plan.stream_seeds == {} and plan.default_seed == seed
        assert get_cuda_rng_tracker().get_states() == {}
        assert torch.equal(device_generator().get_state(), seeded_state(seed))
        # the tracker stays an inference one without the flag, as in megatron-core
        model_parallel_cuda_manual_seed(seed, **ranks)
        assert get_cuda_rng_tracker().is_inference_rng_tracker
    with pytest.raises(SeedReuseError):
        model_parallel_cuda_manual_seed(100, tp_rank=6, ep_rank=17, force_reset_rng=True)
    with pytest.raises(RankError):  # the ranks are still checked
        model_parallel_cuda_manual_seed(1, inference_rng_tracker=True, tp_rank=-1)


def test_get_cuda_rng_tracker_is_the_process_tracker_and_checkpoint_replays_it():
    """The Megatron tracker is what get_rng_tracker() returns, and Megatron's checkpoint
    replays its streams: recomputed dropout masks match the forward's bitwise."""
    model_parallel_cuda_manual_seed(1234)
    tracker = get_cuda_rng_tracker()
    assert get_rng_tracker() is tracker
    weight = torch.randn(8, 8, device=DEVICE)

    def block(x):
        with tracker.fork():
            return torch.nn.functional.dropout(x @ weight, p=0.5)

    grads = []
    for use_checkpoint in (False, True):
        model_parallel_cuda_manual_seed(1234)
        x = torch.ones(4, 8, device=DEVICE, requires_grad=True)
        out = checkpoint(block, False, x) if use_checkpoint else block(x)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_megatrons_tracker_takes_over_the_streams_rng_tracker_seeded():
    """Seeded through rng_tracker's own names (model_parallel_seed), the first Megatron call
    (get_cuda_rng_tracker) put an empty tracker in the process tracker's place, hiding the
    streams from both. Megatron's tracker now holds them, states and seeds; force_reset and
    Megatron's own seeding start it empty as Megatron does."""
    from rng_tracker import model_parallel_seed

    tracker_module._PROCESS_TRACKERS.pop(default_device(), None)
    model_parallel_seed(77, tp_rank=0, pp_rank=0, dp_rank=0)
    plain = get_rng_tracker()
    with plain.fork():
        torch.rand(3)  # the stream moved on from its seed
    states, seeds = plain.get_states(), plain.seeds()
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, CudaRNGStatesTracker) and get_rng_tracker() is tracker
    assert tracker.seeds() == seeds
    assert all(torch.equal(tracker.get_states()[n], state) for n, state in states.items())
    megatron.initialize_rng_tracker(force_reset=True)
    assert get_cuda_rng_tracker().names() == []


def test_get_all_rng_states_needs_a_tracker_and_returns_the_stored_states():
    """Before any tracker exists it raises a typed error (Megatron asserts); then it
    returns the stored state objects of every stream (by reference, for CUDA graphs)."""
    with pytest.raises(TrackerNotInitializedError, match="not initialised") as info:
        megatron.get_all_rng_states()
    assert isinstance(info.value, RuntimeError)
    model_parallel_cuda_manual_seed(5, use_cudagraphable_rng=True)
    states = megatron.get_all_rng_states()
    stored = get_cuda_rng_tracker().states_
    assert list(states) == ["data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"]
    assert all(states[name] is stored[name] for name in states)


def test_is_checkpointing_is_true_inside_the_checkpointed_forward_and_recompute():
    """is_checkpointing() and the module flag IS_CHECKPOINTING read the live state."""
    seen = []

    def body(x):
        seen.append((megatron.is_checkpointing(), megatron.IS_CHECKPOINTING))
        return x * 2

    x = torch.ones(3, requires_grad=True)
    checkpoint(body, False, x).sum().backward()
    assert seen == [(True, True), (True, True)]
    assert (megatron.is_checkpointing(), megatron.IS_CHECKPOINTING) == (False, False)


def test_device_state_helpers_work_on_any_device_in_both_forms():
    """_get_cuda_rng_state/_set_cuda_rng_state read and write the current device's
    generator as tensors or generators; bad input is a typed error and changes nothing."""
    device_generator().manual_seed(42)
    as_tensor = megatron._get_cuda_rng_state()
    as_generator = megatron._get_cuda_rng_state(graph_safe=True, clone=True)
    assert torch.equal(as_tensor, seeded_state(42))
    assert torch.equal(as_generator.get_state(), seeded_state(42))
    first = torch.rand(4, device=DEVICE)
    megatron._set_cuda_rng_state(as_tensor)
    assert torch.equal(torch.rand(4, device=DEVICE), first)
    megatron._set_cuda_rng_state(as_generator, graph_safe=True)
    assert torch.equal(torch.rand(4, device=DEVICE), first)
    before = device_generator().get_state()
    # not a state's type (torch raises TypeError, and so Megatron): also a TypeError here
    bad_types = (1234, torch.zeros(5056))
    for bad in (*bad_types, torch.zeros(3, dtype=torch.uint8)):
        for call, kwargs in (
            (megatron._set_cuda_rng_state, {}),
            (convert_cuda_rng_state, {"to_graphable": True}),
        ):
            with pytest.raises(TrackerDeviceError) as info:
                call(bad, **kwargs)
            assert isinstance(info.value, ValueError)
            assert isinstance(info.value, TypeError) is any(bad is b for b in bad_types)
    assert torch.equal(device_generator().get_state(), before)


def test_fork_rng_puts_every_state_back():
    """Megatron's _fork_rng: the CPU, device and tracker states after the body are those
    before it."""
    model_parallel_cuda_manual_seed(9)
    tracker = get_cuda_rng_tracker()
    before = megatron._get_all_rng_states()
    with megatron._fork_rng():
        torch.rand(3)
        torch.rand(3, device=DEVICE)
        with tracker.fork():
            torch.rand(3, device=DEVICE)
    after = megatron._get_all_rng_states()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert all(torch.equal(before[2][n], after[2][n]) for n in before[2])


def test_gtp_remat_streams_follow_megatron_and_refuse_a_missing_rank():
    """The GTP-remat streams exist only where their world size is above 1, with
    Megatron's seeds; without a rank (our parallel state has no GTP axis) it raises."""
    model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0)
    assert "gtp-remat-rng" not in get_cuda_rng_tracker()
    plan = model_parallel_cuda_manual_seed(
        5, tp_rank=1, ep_rank=0, etp_rank=0, gtp_remat_rank=1, gtp_remat_world_size=2,
        egtp_remat_rank=0, egtp_remat_world_size=2,
    )  # fmt: skip
    states = get_cuda_rng_tracker().get_states()
    assert torch.equal(states["gtp-remat-rng"], seeded_state(5 + 2718 + 1 + 65536 * 2))
    assert torch.equal(states["egtp-remat-rng"], seeded_state(5 + 1024 + 32768 + 65536))
    # the plan is every seed the call set (it left the GTP-remat ones out)
    assert plan.stream_seeds["gtp-remat-rng"] == 5 + 2718 + 1 + 65536 * 2
    assert plan.stream_seeds["egtp-remat-rng"] == 5 + 1024 + 32768 + 65536
    assert set(plan.stream_seeds) == set(get_cuda_rng_tracker().get_states())
    with pytest.raises(ParallelStateError, match="gtp_remat_rank"):
        model_parallel_cuda_manual_seed(5, gtp_remat_world_size=4)


def test_a_refused_seed_changes_nothing():
    """Megatron's arithmetic gives tp_rank 6 and ep_rank 17 one seed: the call raises
    before touching the tracker (even with force_reset_rng) or any generator."""
    model_parallel_cuda_manual_seed(100)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    cpu, device = torch.get_rng_state(), device_generator().get_state()
    with pytest.raises(SeedReuseError):
        model_parallel_cuda_manual_seed(
            100, tp_rank=6, ep_rank=17, etp_rank=0, force_reset_rng=True
        )
    assert get_cuda_rng_tracker() is tracker
    if DEVICE.type == "cpu":  # seeds 2**32 apart: one seed to torch's CPU generator
        with pytest.raises(SeedReuseError, match=r"modulo 2\*\*32"):
            model_parallel_cuda_manual_seed(100, etp_rank=2**32 + 1694, force_reset_rng=True)
        assert get_cuda_rng_tracker() is tracker  # refused before the tracker was replaced
    after = tracker.get_states()
    assert after.keys() == states.keys()
    assert all(torch.equal(states[n], s) for n, s in after.items())
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(device_generator().get_state(), device)
    with pytest.raises(UnknownStreamError), tracker.fork("gtp-remat-rng"):
        pass


_NOT_A_BOOL = "no"  # truthy: read by truthiness it would say yes


@pytest.mark.parametrize(
    "call",
    [
        lambda: megatron.initialize_rng_tracker(force_reset=_NOT_A_BOOL),
        lambda: megatron.initialize_rng_tracker(inference_rng_tracker=_NOT_A_BOOL),
        lambda: megatron.initialize_rng_tracker(use_te_rng_tracker=1),
        lambda: megatron.get_cuda_rng_tracker(use_cudagraphable_rng=_NOT_A_BOOL),
        lambda: model_parallel_cuda_manual_seed(6, force_reset_rng=_NOT_A_BOOL),
        lambda: model_parallel_cuda_manual_seed(
            6, inference_rng_tracker=_NOT_A_BOOL, force_reset_rng=True
        ),
        lambda: model_parallel_cuda_manual_seed(6, True, False, 1),
        lambda: CudaRNGStatesTracker(use_cudagraphable_rng=_NOT_A_BOOL),
        lambda: CudaRNGStatesTracker(is_inference_rng_tracker=_NOT_A_BOOL),
        lambda: convert_cuda_rng_state(torch.get_rng_state(), to_graphable=_NOT_A_BOOL),
        lambda: megatron.get_gtp_remat_rng_tracker_name(_NOT_A_BOOL),
        lambda: checkpoint(lambda t: t * 2, torch.ones(1), torch.ones(1)),
    ],
    ids=[
        "initialize-force_reset",
        "initialize-inference",
        "initialize-te-int",
        "get_cuda_rng_tracker",
        "manual_seed-force_reset_rng",
        "manual_seed-inference",
        "manual_seed-cudagraphable-int",
        "tracker-cudagraphable",
        "tracker-inference",
        "convert-to_graphable",
        "gtp_remat_name",
        "checkpoint-flag-left-out",
    ],
)
def test_megatron_flags_must_be_bools_and_a_refused_one_changes_nothing(call):
    """Each flag of the facade is a bool: read by truthiness, ``force_reset="no"`` dropped every
    stream, ``inference_rng_tracker="no"`` installed the no-op tracker and a checkpoint called
    without its flag took the first tensor as it. Refused (``ArgumentTypeError``, a
    ``TypeError``), with the tracker, its streams and the generators as they were. None stays
    False, as Megatron's own test_checkpoint passes it."""
    from rng_tracker.errors import ArgumentTypeError

    model_parallel_cuda_manual_seed(100)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    cpu, device = torch.get_rng_state(), device_generator().get_state()
    with pytest.raises(ArgumentTypeError, match="must be a bool") as info:
        call()
    assert isinstance(info.value, TypeError)
    assert get_cuda_rng_tracker() is tracker
    after = tracker.get_states()
    assert after.keys() == states.keys()
    assert all(torch.equal(states[n], s) for n, s in after.items())
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(device_generator().get_state(), device)


@pytest.mark.distributed(world_size=2, timeout=90)
def test_ranks_come_from_the_parallel_state_and_are_never_guessed(rank):
    """With 2 ranks and no parallel state the call raises and changes nothing; explicit
    ranks work; with init_model_parallel the ranks come from it (tp differs per rank)."""
    destroy_model_parallel()
    cpu = torch.get_rng_state()
    with pytest.raises(ParallelStateError, match="tp_rank, ep_rank, etp_rank"):
        model_parallel_cuda_manual_seed(10)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert not isinstance(tracker_module.process_tracker(), CudaRNGStatesTracker)

    model_parallel_cuda_manual_seed(10, tp_rank=1, ep_rank=0, etp_rank=0)
    assert torch.equal(
        get_cuda_rng_tracker().get_states()["model-parallel-rng"], seeded_state(2729)
    )

    state = init_model_parallel(tensor=2)
    try:
        model_parallel_cuda_manual_seed(10)
        mine = get_cuda_rng_tracker().get_states()["model-parallel-rng"]
        assert torch.equal(mine, seeded_state(10 + 2718 + state.rank("tp")))
        wire = mine.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        gathered = [torch.empty_like(wire) for _ in range(2)]
        dist.all_gather(gathered, wire)
        assert not torch.equal(gathered[0], gathered[1])
    finally:
        destroy_model_parallel()


def _every_state() -> tuple:
    """The CPU, device and Megatron tracker states, with the stream names, to compare bitwise."""
    tracker = get_cuda_rng_tracker()
    streams = {name: tracker._rng.to_bytes(state) for name, state in tracker.get_states().items()}
    return torch.get_rng_state(), device_generator().get_state(), streams


def _unchanged(before: tuple) -> bool:
    after = _every_state()
    return (
        torch.equal(before[0], after[0])
        and torch.equal(before[1], after[1])
        and before[2].keys() == after[2].keys()
        and all(torch.equal(before[2][name], after[2][name]) for name in before[2])
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "builtin", "words"),
    [
        ({"gtp_remat_world_size": 0}, ParallelConfigError, ValueError, "positive int, got 0"),
        ({"egtp_remat_world_size": -2}, ParallelConfigError, ValueError, "positive int, got -2"),
        ({"gtp_remat_world_size": "2"}, ParallelConfigTypeError, TypeError, "must be an int"),
        ({"egtp_remat_world_size": True}, ParallelConfigTypeError, TypeError, "the bool True"),
        ({"gtp_remat_rank": -7}, RankError, ValueError, "gtp_remat_rank must be >= 0, got -7"),
        ({"egtp_remat_rank": 1.0}, RankError, ValueError, "egtp_remat_rank must be an int"),
        (
            {"gtp_remat_world_size": 2, "gtp_remat_rank": 2},
            RankError,
            ValueError,
            "gtp_remat_rank must be below gtp_remat_world_size=2, got 2",
        ),
        (
            {"egtp_remat_world_size": 1, "egtp_remat_rank": 1},
            RankError,
            ValueError,
            "below egtp_remat_world_size=1",
        ),
    ],
)
def test_gtp_remat_arguments_are_checked_before_seeding(kwargs, error, builtin, words):
    """A GTP-remat world size of 0 was taken as 'off', a rank of -7 was ignored, and rank 2 of
    a world of 2 seeded a stream no rank should have; each is a typed error that changes
    nothing."""
    model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0)
    before = _every_state()
    with pytest.raises(error, match=words) as info:
        model_parallel_cuda_manual_seed(
            7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True, **kwargs
        )
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert _unchanged(before)


@pytest.mark.parametrize(
    ("cpu_state", "words"),
    [
        (torch.zeros(3, dtype=torch.uint8), "3 elements; a cpu state is a CPU uint8 tensor"),
        (torch.zeros(5056), "dtype torch.float32"),
        ("x", "got str"),
        (torch.Generator(), "got Generator"),
    ],
)
def test_set_all_rng_states_checks_the_cpu_state_before_installing_anything(cpu_state, words):
    """_set_all_rng_states(bad_cpu, ...) installed the tracker streams and the device state,
    then failed on the CPU state with a bare RuntimeError: a partial change."""
    model_parallel_cuda_manual_seed(123)
    tracker = get_cuda_rng_tracker()
    other = {name: seeded_state(999 + i) for i, name in enumerate(tracker.names())}
    before = _every_state()
    with pytest.raises(TrackerDeviceError, match=words) as info:
        megatron._set_all_rng_states(cpu_state, seeded_state(5), other)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    assert _unchanged(before)
    with pytest.raises(TrackerDeviceError, match="not a"):
        megatron._set_all_rng_states(torch.get_rng_state(), torch.zeros(3), other)
    assert _unchanged(before)


def test_set_all_rng_states_installs_state_views_at_a_storage_offset():
    """torch's set_state misreads a state tensor that is a view at a storage offset ("Invalid
    mt19937 state", other bytes, or a crash); the CPU state and the streams' are installed by
    their values."""

    def view(state: Any) -> Any:
        if not isinstance(state, torch.Tensor):
            return state
        return torch.cat([torch.zeros(7, dtype=torch.uint8), state.cpu()])[7:]

    model_parallel_cuda_manual_seed(123)
    cpu, device, streams = megatron._get_all_rng_states()
    torch.rand(3)
    with get_cuda_rng_tracker().fork():
        torch.rand(3)
    rng = get_cuda_rng_tracker()._rng
    expected = {n: rng.to_bytes(s) for n, s in streams.items()}
    megatron._set_all_rng_states(view(cpu), device, {n: view(s) for n, s in streams.items()})
    assert torch.equal(torch.get_rng_state(), cpu)
    assert _every_state()[2].keys() == expected.keys()
    assert all(torch.equal(_every_state()[2][n], expected[n]) for n in expected)


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (torch.zeros(3), "dtype torch.float32"),
        (torch.zeros(3, dtype=torch.uint8), "3 elements"),
        (torch.zeros(2, 3, dtype=torch.int64), "dtype torch.int64"),
    ],
)
def test_convert_cuda_rng_state_refuses_a_tensor_that_is_no_state(state, words):
    """convert_cuda_rng_state(torch.zeros(3)) returned the float tensor as if it were a state."""
    before = _every_state()
    for to_graphable in (False, True):
        with pytest.raises(TrackerDeviceError, match="is not a") as info:
            convert_cuda_rng_state(state, to_graphable=to_graphable)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    with pytest.raises(TrackerDeviceError, match=words):
        convert_cuda_rng_state(state)
    assert _unchanged(before)
    good = device_generator().get_state()
    assert convert_cuda_rng_state(good) is good


@pytest.mark.parametrize("device", [-5, 2**70])
def test_device_state_helpers_refuse_a_bad_device_index(device):
    """_get_cuda_rng_state(-5) raised torch's bare RuntimeError."""
    before = _every_state()
    with pytest.raises(TrackerDeviceError, match="device index must be in") as info:
        megatron._get_cuda_rng_state(device)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    with pytest.raises(TrackerDeviceError, match="device index must be in"):
        megatron._set_cuda_rng_state(torch.get_rng_state(), device=device)
    assert _unchanged(before)


def test_checkpoints_run_plainly_while_megatrons_cuda_graphs_warm_up(mg):
    """Megatron's checkpoint runs the function plainly during its CUDA graphs' warmup and
    capture, and its CheckpointWithoutOutput checkpoints and discards nothing during warmup (a
    recompute cannot run inside a captured graph); installed, ours checkpointed and freed the
    output there."""
    import megatron.core.transformer.cuda_graphs as graphs

    from rng_tracker.activation_checkpoint import is_checkpointing

    seen = []

    def body(a: torch.Tensor) -> torch.Tensor:
        seen.append(is_checkpointing())
        return a * 2

    x = torch.ones(3, requires_grad=True)
    graphs._set_warmup_start()
    try:
        out = mg.checkpoint(body, False, x)
        act = mg.CheckpointWithoutOutput()
        h = act.checkpoint(torch.nn.functional.gelu, x)
        act.discard_output_and_register_recompute(h * 3)
    finally:
        graphs._set_warmup_end()
    assert seen == [False] and type(out.grad_fn).__name__ == "MulBackward0"
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    out = mg.checkpoint(body, False, x)  # after the warmup: checkpointed again
    assert seen == [False, True] and type(out.grad_fn).__name__ != "MulBackward0"


@pytest.mark.parametrize(
    ("x_dtype", "bias_dtype", "residual_dtype"),
    [
        (torch.bfloat16, torch.bfloat16, torch.float32),
        (torch.float16, None, torch.float32),
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16, torch.bfloat16),
    ],
    ids=str,
)
def test_kernel_bias_dropout_add_equals_megatrons_in_mixed_dtypes(
    x_dtype, bias_dtype, residual_dtype
) -> None:
    """rng_tracker.kernels.bias_dropout_add takes mixed dtypes as megatron-core's does (x and bias
    in an fp32 residual's dtype; else promotion): outside training the two are bitwise equal,
    dtype included (megatron's own function, inputs that require grad as in training)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from rng_tracker.kernels import bias_dropout_add

    x = torch.randn(6, 8).to(x_dtype).requires_grad_()
    bias = None if bias_dtype is None else torch.randn(8).to(bias_dtype)
    residual = torch.randn(6, 8).to(residual_dtype)
    theirs = get_bias_dropout_add(False, False)((x, bias), residual, 0.3)
    ours = bias_dropout_add(x, bias, residual, 0.3, training=False)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
