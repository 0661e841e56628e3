"""CheckpointWithoutOutput keeps Megatron's contract and never frees storage another tensor uses.

Cases follow Megatron-LM's tests of ``CheckpointWithoutOutput`` (the fused residual norm
that returns its input, consumers that save views, the manager's unified recompute), run
on CPU with dropout forked from a tracker stream; grads are compared bitwise with the
plain run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rng_tracker import CheckpointWithoutOutput, RNGStatesTracker, RNGTrackerError
from rng_tracker.checkpoint_without_output import CheckpointWithoutOutputManager
from rng_tracker.errors import CheckpointConfigError, CheckpointTypeError, CheckpointUsageError

STREAM = "model-parallel-rng"


def make_tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add(STREAM, 31)
    return tracker


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


class _FusedResidualNorm(torch.autograd.Function):
    """Like TransformerEngine's fused residual RMSNorm: returns (norm(x) * weight, x), the
    second output sharing the input's storage."""

    @staticmethod
    def forward(ctx, x, weight):
        rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()  # (batch, 1)
        ctx.save_for_backward(x, weight, rms)
        return x * rms * weight, x

    @staticmethod
    def backward(ctx, grad_normed, grad_residual):
        x, weight, rms = ctx.saved_tensors
        normed = x * rms
        g = grad_normed * weight
        grad_x = g * rms - normed * (g * normed).mean(-1, keepdim=True) * rms
        return grad_x + grad_residual, (grad_normed * normed).sum(0)


@pytest.mark.parametrize("use_manager", [False, True], ids=["alone", "manager"])
@pytest.mark.parametrize("retain", [False, True], ids=["default", "retain_input_tensors"])
def test_an_output_that_aliases_the_input_keeps_the_callers_storage(use_manager, retain):
    """Megatron's fused-residual pattern: the residual output is the input's storage, so
    discarding must not free it (whatever retain_input_tensors says); the freshly computed
    output is freed; grads equal the plain run's bitwise."""
    torch.manual_seed(0)
    weight = torch.randn(16, requires_grad=True)
    data = torch.randn(4, 16)

    def norm(x):
        return _FusedResidualNorm.apply(x, weight)

    x1 = data.clone().requires_grad_()
    normed, residual = norm(x1)
    (normed * residual).sum().backward()
    ref = [x1.grad, weight.grad.clone()]

    weight.grad = None
    x2 = data.clone().requires_grad_()
    manager = CheckpointWithoutOutputManager() if use_manager else None
    ckpt = CheckpointWithoutOutput(ckpt_manager=manager, retain_input_tensors=retain)
    normed, residual = ckpt.checkpoint(norm, x2)
    y = normed * residual
    if manager is None:
        ckpt.discard_output_and_register_recompute(y)
    else:
        manager.discard_all_outputs_and_register_unified_recompute(y)
    assert normed.untyped_storage().nbytes() == 0  # the fresh output is freed
    assert torch.equal(x2.detach(), data) and torch.equal(residual.detach(), data)
    y.sum().backward()
    assert same(ref, [x2.grad, weight.grad])


@pytest.mark.parametrize(
    "function",
    [
        lambda x: x.view(-1),
        lambda x: x[1:],
        lambda x: (x.sin(), x.t()),
        lambda x: (_GLOBAL[0], x.cos()),
        lambda x: (_PLAIN[1:], x.cos()),
        lambda x: (x.exp(), _PLAIN.detach()),
    ],
    ids=[
        "view of input",
        "slice of input",
        "input transposed",
        "view of a view",
        "view of another tensor",
        "another tensor",
    ],
)
def test_outputs_sharing_storage_with_any_other_tensor_are_never_freed(function):
    """Views of inputs and views of tensors the caller holds keep their storage; the data
    the caller sees is untouched after discarding and backward works."""
    x = torch.randn(3, 4, requires_grad=True)
    before, global_before, plain_before = x.detach().clone(), _GLOBAL.clone(), _PLAIN.clone()
    ckpt = CheckpointWithoutOutput()
    out = ckpt.checkpoint(function, x)
    outs = out if isinstance(out, tuple) else (out,)
    y = sum((o * o).sum() for o in outs)
    ckpt.discard_output_and_register_recompute(y)
    assert torch.equal(x.detach(), before) and torch.equal(_GLOBAL, global_before)
    assert torch.equal(_PLAIN, plain_before)
    y.backward()
    plain = torch.randn(3, 4).copy_(before).requires_grad_()
    ref_outs = function(plain)
    sum(
        (o * o).sum() for o in (ref_outs if isinstance(ref_outs, tuple) else (ref_outs,))
    ).backward()
    assert torch.equal(x.grad, plain.grad)


_GLOBAL = torch.arange(12.0).reshape(3, 4)  # a view of its arange
_PLAIN = torch.linspace(0, 1, 12).view(3, 4).clone()  # owns its storage


class _ViewSavingLinear(torch.autograd.Function):
    """A consumer that saves views of its input (as TransformerEngine's GroupedLinear does)."""

    @staticmethod
    def forward(ctx, inp, weight):
        flat = inp.reshape(-1, inp.shape[-1])  # (batch*seq, hidden), a view
        ctx.save_for_backward(*torch.tensor_split(flat, 2, dim=0), weight)
        ctx.shape = inp.shape
        return (flat @ weight.t()).reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        *parts, weight = ctx.saved_tensors
        flat = torch.cat(parts)
        grad_flat = grad.reshape(-1, grad.shape[-1])
        return (grad_flat @ weight).reshape(ctx.shape), grad_flat.t() @ flat


def test_views_saved_by_the_consumer_see_the_recomputed_output():
    """The consumer saved views of the discarded output: the refill lands in the same storage,
    so they read the recomputed values (with the forward's tracker-forked dropout mask)."""

    def go(selective: bool):
        torch.manual_seed(1)
        tracker = make_tracker()
        x = torch.randn(3, 2, 8, requires_grad=True)
        w = torch.randn(6, 8, requires_grad=True)

        def act(t):
            with tracker.fork(STREAM):
                return F.dropout(F.gelu(t), 0.3)

        if selective:
            ckpt = CheckpointWithoutOutput(tracker=tracker)
            h = ckpt.checkpoint(act, x)
            y = _ViewSavingLinear.apply(h, w)
            ckpt.discard_output_and_register_recompute(y)
            assert h.untyped_storage().nbytes() == 0
        else:
            y = _ViewSavingLinear.apply(act(x), w)
        (y * torch.linspace(-1, 1, 6)).sum().backward()
        return [x.grad, w.grad, *tracker.get_states().values(), torch.get_rng_state()]

    assert same(go(False), go(True))


def test_outputs_sharing_one_fresh_storage_are_freed_and_refilled():
    """Two outputs that are views of one fresh tensor: freed together, refilled together."""

    def go(selective: bool):
        torch.manual_seed(2)
        x = torch.randn(4, 6, requires_grad=True)
        split = lambda t: F.dropout(t.exp(), 0.5).chunk(2, dim=1)  # noqa: E731
        if selective:
            ckpt = CheckpointWithoutOutput()
            a, b = ckpt.checkpoint(split, x)
            y = (a * b).sum()
            ckpt.discard_output_and_register_recompute(y)
            assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0
        else:
            a, b = split(x)
            y = (a * b).sum()
        y.backward()
        return [x.grad, torch.get_rng_state()]

    assert same(go(False), go(True))


def test_manager_recomputes_a_chain_in_forward_order():
    """Megatron's manager: two chained checkpoints (the second consumes the first's output),
    discarded together and recomputed from one hook; grads equal the plain run's bitwise."""

    def go(selective: bool):
        torch.manual_seed(3)
        tracker = make_tracker()
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 8, requires_grad=True)

        def act(t):
            with tracker.fork(STREAM):
                return F.dropout(torch.tanh(t), 0.25)

        if selective:
            manager = CheckpointWithoutOutputManager()
            first = CheckpointWithoutOutput(ckpt_manager=manager, tracker=tracker)
            second = CheckpointWithoutOutput(ckpt_manager=manager, tracker=tracker)
            h = first.checkpoint(act, x @ w)
            g = second.checkpoint(act, h * 2)
            y = g @ w
            first.discard_output_and_register_recompute(y)  # a no-op under a manager
            assert h.untyped_storage().nbytes() > 0
            manager.discard_all_outputs_and_register_unified_recompute(y)
            assert manager.checkpoints == [first, second]
            assert h.untyped_storage().nbytes() == 0 and g.untyped_storage().nbytes() == 0
        else:
            y = act(act(x @ w) * 2) @ w
        (y * torch.linspace(-1, 1, 8)).sum().backward()
        return [x.grad, w.grad, *tracker.get_states().values()]

    assert same(go(False), go(True))


def test_megatron_signature_and_typed_errors():
    """Megatron's positional signature; the manager refuses what Megatron's refuses (a
    TypeError and a ValueError, typed); .grad() is refused in Megatron's words."""
    ckpt = CheckpointWithoutOutput(True, None, True)
    assert ckpt.fp8 is True and ckpt.retain_input_tensors is True and ckpt.outputs is None
    manager = CheckpointWithoutOutputManager()
    with pytest.raises(CheckpointTypeError):
        manager.add_checkpoint("not a checkpoint")
    with pytest.raises(CheckpointConfigError, match="before"):
        manager.add_checkpoint(ckpt)
    with pytest.raises(CheckpointUsageError, match="before"):
        ckpt.discard_output_and_register_recompute(torch.ones(1, requires_grad=True))

    x = torch.randn(5, requires_grad=True)
    h = ckpt.checkpoint(torch.exp, x)
    y = h * x
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(CheckpointUsageError, match=r"not compatible with \.grad\(\)"):
        torch.autograd.grad(y.sum(), x)


def test_checkpoint_again_before_the_last_outputs_are_recomputed_is_refused():
    """A second checkpoint() while the first call's outputs are discarded and their recompute
    hook waits: the object then recomputed the second function, and backward failed inside torch
    ("setStorage ... out of bounds") with the first outputs left empty. Refused up front, with
    the first call's backward still right; after it, the object may checkpoint again."""
    ckpt = CheckpointWithoutOutput()
    x = torch.randn(5, requires_grad=True)
    h = ckpt.checkpoint(torch.exp, x)
    y = h * x
    ckpt.discard_output_and_register_recompute(y)
    with pytest.raises(CheckpointUsageError, match="one CheckpointWithoutOutput per call"):
        ckpt.checkpoint(torch.sin, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.exp(x) * x + torch.exp(x))
    for _ in range(2):  # recomputed: free to checkpoint again, and again under no_grad
        with torch.no_grad():
            h = ckpt.checkpoint(torch.sin, x)
            ckpt.discard_output_and_register_recompute(h * 2)  # no backward comes: no hook


def test_checkpoint_again_after_the_last_graph_was_dropped_without_backward():
    """The refusal above lasts while the recompute hook can still run: a forward whose graph is
    dropped without backward (an evaluation with grad on, a step given up after an error) took
    its hook with it, and the object was refused for good. Now it may checkpoint again, and
    that call's backward is right."""
    ckpt = CheckpointWithoutOutput()
    x = torch.randn(5, requires_grad=True)
    h = ckpt.checkpoint(torch.exp, x)
    ckpt.discard_output_and_register_recompute(h * x)  # the graph is dropped: no backward comes
    del h
    h = ckpt.checkpoint(torch.sin, x)
    y = h * x
    ckpt.discard_output_and_register_recompute(y)
    y.sum().backward()
    assert torch.equal(x.grad, torch.sin(x) + torch.cos(x) * x)


def test_discard_under_no_grad_registers_nothing_and_raises_nothing():
    """In inference (no grad) Megatron discards and registers no hook; so do we."""
    ckpt = CheckpointWithoutOutput()
    with torch.no_grad():
        h = ckpt.checkpoint(torch.exp, torch.randn(3))
        y = h * 2
        ckpt.discard_output_and_register_recompute(y)
    assert h.untyped_storage().nbytes() == 0
    assert not y._backward_hooks  # no recompute hook: no backward will come


@pytest.mark.parametrize("use_manager", [False, True], ids=["alone", "manager"])
@pytest.mark.parametrize("hook_tensor", [None, 3.0, "y"], ids=["None", "float", "str"])
def test_a_hook_tensor_that_is_no_tensor_is_refused_before_anything_is_freed(
    use_manager, hook_tensor
):
    """Discarding with no tensor to hook would free outputs nothing could refill (a later read
    touches freed storage): refused typed, nothing freed, and the right call still works."""
    tracker = make_tracker()
    manager = CheckpointWithoutOutputManager() if use_manager else None
    ckpt = CheckpointWithoutOutput(ckpt_manager=manager, tracker=tracker)
    w = torch.randn(4, 4, requires_grad=True)
    w2 = torch.randn(4, 4, requires_grad=True)

    def gelu_dropout(t):
        with tracker.fork(STREAM):
            return F.dropout(F.gelu(t), 0.5)

    start = [torch.get_rng_state(), *tracker.get_states().values()]
    h = ckpt.checkpoint(gelu_dropout, w)
    y = h @ w2
    nbytes, data = h.untyped_storage().nbytes(), h.detach().clone()
    before = [torch.get_rng_state(), *tracker.get_states().values()]
    names = set(tracker.get_states())
    discard = (
        manager.discard_all_outputs_and_register_unified_recompute
        if use_manager
        else ckpt.discard_output_and_register_recompute
    )
    with pytest.raises(CheckpointTypeError, match=r"needs the tensor .*nothing was freed") as info:
        discard(hook_tensor)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert h.untyped_storage().nbytes() == nbytes  # checked before h is read: no crash
    assert torch.equal(h.detach(), data)
    assert same(before, [torch.get_rng_state(), *tracker.get_states().values()])
    assert set(tracker.get_states()) == names

    discard(y)
    assert h.untyped_storage().nbytes() == 0
    y.sum().backward()
    assert torch.equal(h.detach(), data)  # recomputed with the forward's mask
    expected = torch.autograd.grad((gelu_dropout_replayed(w, start, tracker) @ w2).sum(), w)[0]
    assert torch.equal(w.grad, expected)


def gelu_dropout_replayed(w, states, tracker):
    """The checkpointed block again from the states it started from (a plain, saved run)."""
    cpu, *streams = states
    torch.set_rng_state(cpu)
    tracker.set_states(dict(zip(tracker.get_states(), streams, strict=True)))
    with tracker.fork(STREAM):
        return F.dropout(F.gelu(w), 0.5)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_retain_input_tensors_must_be_a_bool(bad):
    with pytest.raises(CheckpointTypeError, match="retain_input_tensors must be a bool") as info:
        CheckpointWithoutOutput(retain_input_tensors=bad)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert CheckpointWithoutOutput(retain_input_tensors=np.True_).retain_input_tensors is True


@pytest.mark.parametrize("use_manager", [False, True], ids=["alone", "manager"])
def test_an_input_without_grad_before_a_trainable_consumer_is_recomputed(use_manager):
    """A frozen fc1 before a trainable fc2: no input of the checkpointed activation needs grad,
    so autograd keeps neither a node nor the input, but fc2's weight gradient needs the freed
    output. It raised "no output of checkpoint() requires grad"; now the inputs are kept for
    the recompute and the gradient equals the plain run's, bitwise."""
    torch.manual_seed(0)
    fc2 = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)  # the frozen layer's output: needs no grad
    tracker = make_tracker()

    def act(t):
        with tracker.fork(STREAM):
            return F.dropout(F.gelu(t), 0.5)

    def weight_grad(checkpointed: bool) -> torch.Tensor:
        fc2.weight.grad = None
        tracker.set_states({STREAM: torch.Generator().manual_seed(5).get_state()})
        if not checkpointed:
            fc2(act(x)).sum().backward()
            return fc2.weight.grad
        manager = CheckpointWithoutOutputManager() if use_manager else None
        ckpt = CheckpointWithoutOutput(ckpt_manager=manager)
        h = ckpt.checkpoint(act, x)
        y = fc2(h)
        if manager is None:
            ckpt.discard_output_and_register_recompute(y)
        else:
            manager.discard_all_outputs_and_register_unified_recompute(y)
        assert h.untyped_storage().nbytes() == 0
        y.sum().backward()
        assert ckpt._held_inputs is None  # let go once recomputed
        return fc2.weight.grad

    assert torch.equal(weight_grad(checkpointed=True), weight_grad(checkpointed=False))


def test_an_input_without_grad_modified_in_place_before_the_recompute_is_refused():
    """Autograd refuses it for the inputs it keeps; the inputs kept without it are checked too."""
    fc2 = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ckpt = CheckpointWithoutOutput()
    y = fc2(ckpt.checkpoint(torch.exp, x))
    ckpt.discard_output_and_register_recompute(y)
    x.add_(1)
    with pytest.raises(
        CheckpointUsageError, match=r"input 0 of checkpoint\(\) was modified in place"
    ):
        y.sum().backward()
