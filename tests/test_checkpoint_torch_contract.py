"""torch.utils.checkpoint's documented contract, kept by ``checkpoint`` and ``rng_context_fn``.

The cases follow PyTorch's own checkpoint tests (repeated backward and ``autograd.grad``,
double backward, nesting, early stop, determinism check, debug mode, selective
checkpointing, ``preserve_rng_state``, reentrant refusals), run on CPU with dropout forked
from a tracker stream: every recompute, however many, must draw the forward's masks, so
masks and gradients are compared bitwise with the uncheckpointed run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from rng_tracker import RNGStatesTracker, RNGTrackerError, checkpoint, rng_context_fn
from rng_tracker.errors import CheckpointConfigError, CheckpointUsageError
from rng_tracker.megatron import checkpoint as megatron_checkpoint

STREAM = "model-parallel-rng"
OTHER = "data-parallel-rng"


def make_tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add(STREAM, 11)
    tracker.add(OTHER, 22)
    return tracker


def block(x, w, tracker, masks):
    """Tracker-forked dropout, then default-generator dropout; twice differentiable."""
    h = torch.tanh(x @ w)  # (batch, hidden)
    with tracker.fork(STREAM):
        h = F.dropout(h, 0.4)
    masks.append(h != 0)
    h = F.dropout(h * h, 0.2)
    masks.append(h != 0)
    return torch.sin(h) @ w  # (batch, hidden)


def start(seed: int = 0) -> tuple[RNGStatesTracker, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    tracker = make_tracker()
    return tracker, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def end_state(tracker: RNGStatesTracker) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *tracker.get_states().values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


Wrap = Callable[..., Any]


def plain(fn, x, w, tracker, masks):
    return fn(x, w, tracker, masks)


def ours(fn, x, w, tracker, masks, **options):
    return checkpoint(fn, x, w, tracker, masks, tracker=tracker, **options)


def ours_reentrant(fn, x, w, tracker, masks):
    return checkpoint(fn, x, w, tracker, masks, use_reentrant=True, tracker=tracker)


def torch_with_rng_context(fn, x, w, tracker, masks, **options):
    return torch_checkpoint.checkpoint(
        fn, x, w, tracker, masks, use_reentrant=False, context_fn=rng_context_fn(tracker), **options
    )


def megatron(fn, x, w, tracker, masks):
    return megatron_checkpoint(fn, False, x, w, tracker, masks)


NON_REENTRANT = {"ours": ours, "torch+rng_context_fn": torch_with_rng_context}
EVERY_MODE = {**NON_REENTRANT, "reentrant": ours_reentrant, "megatron": megatron}
WEIGHTS = torch.linspace(-1, 1, 8)


def assert_masks_replayed(reference: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
    """Every group of masks (the forward, then each recompute) equals the plain run's."""
    assert len(masks) > len(reference) and len(masks) % len(reference) == 0
    for i, mask in enumerate(masks):
        assert torch.equal(mask, reference[i % len(reference)]), i


@pytest.mark.parametrize("mode", EVERY_MODE)
def test_repeated_backward_with_retain_graph_replays_the_forward_masks_each_time(mode):
    """Three backward(retain_graph=True): three recomputes, each drawing the forward's masks;
    the accumulated grads and the final RNG states equal the plain run's bitwise."""

    def go(wrap: Wrap):
        tracker, x, w = start()
        masks: list[torch.Tensor] = []
        out = wrap(block, x, w, tracker, masks)
        grads = []
        for _ in range(3):
            (out * WEIGHTS).sum().backward(retain_graph=True)
            grads += [x.grad.clone(), w.grad.clone()]
        return masks, grads, end_state(tracker)

    ref_masks, ref_grads, ref_end = go(plain)
    masks, grads, end = go(EVERY_MODE[mode])
    assert len(masks) == 4 * len(ref_masks)
    assert_masks_replayed(ref_masks, masks)
    assert same(ref_grads, grads) and same(ref_end, end)


@pytest.mark.parametrize("mode", NON_REENTRANT)
def test_repeated_autograd_grad_replays_the_forward_masks_each_time(mode):
    """torch.autograd.grad three times over one graph: equal grads, forward masks each time."""

    def go(wrap: Wrap):
        tracker, x, w = start(1)
        masks: list[torch.Tensor] = []
        loss = (wrap(block, x, w, tracker, masks) * WEIGHTS).sum()
        grads = [g for _ in range(3) for g in torch.autograd.grad(loss, (x, w), retain_graph=True)]
        return masks, grads, end_state(tracker)

    ref_masks, ref_grads, ref_end = go(plain)
    masks, grads, end = go(NON_REENTRANT[mode])
    assert_masks_replayed(ref_masks, masks)
    assert same(ref_grads, grads) and same(ref_end, end)


@pytest.mark.parametrize("mode", NON_REENTRANT)
def test_double_backward_through_the_checkpoint_equals_the_plain_run(mode):
    """Grad of a grad (create_graph=True) through the recompute: bitwise the plain run's."""

    def go(wrap: Wrap):
        tracker, x, w = start(2)
        masks: list[torch.Tensor] = []
        loss = (wrap(block, x, w, tracker, masks) * WEIGHTS).sum()
        gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
        (gx.square().sum() + gw.square().sum()).backward()
        return masks, [gx.detach(), gw.detach(), x.grad, w.grad], end_state(tracker)

    ref_masks, ref_grads, ref_end = go(plain)
    masks, grads, end = go(NON_REENTRANT[mode])
    assert_masks_replayed(ref_masks, masks)
    assert same(ref_grads, grads) and same(ref_end, end)


def _outer(inner: Wrap):
    """A region holding an inner (maybe checkpointed) block and a dropout in another stream."""

    def outer(x, w, tracker, masks):
        h = inner(block, x, w, tracker, masks)
        with tracker.fork(OTHER):
            h = F.dropout(h, 0.3)
        masks.append(h != 0)
        return torch.tanh(h)

    return outer


NESTINGS = {
    "ours in ours": (ours, ours),
    "ours in torch's": (torch_with_rng_context, ours),
    "torch's in ours": (ours, torch_with_rng_context),
    "reentrant ours in ours": (ours, ours_reentrant),
}


@pytest.mark.parametrize("nesting", NESTINGS)
def test_nested_checkpoints_replay_every_stream(nesting):
    """Nested checkpoints (ours and torch's, either way round), backward twice and, where
    every level is non-reentrant, grad of grad: grads equal the plain run's bitwise, every
    mask drawn in any recompute is one of the forward's, and the RNG states end where the
    plain run's do."""
    outer_wrap, inner_wrap = NESTINGS[nesting]
    double = inner_wrap is not ours_reentrant

    def go(outer: Wrap, inner: Wrap):
        tracker, x, w = start(3)
        masks: list[torch.Tensor] = []
        loss = (outer(_outer(inner), x, w, tracker, masks) * WEIGHTS).sum()
        loss.backward(retain_graph=True)
        grads = [x.grad.clone(), w.grad.clone()]
        if double:
            gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
            (gx.square().sum() + gw.square().sum()).backward()
            grads += [gx.detach(), gw.detach()]
        else:
            loss.backward()
        return masks, [*grads, x.grad, w.grad], end_state(tracker)

    ref_masks, ref_grads, ref_end = go(plain, plain)
    masks, grads, end = go(outer_wrap, inner_wrap)
    assert same(ref_grads, grads) and same(ref_end, end)
    assert len(masks) > len(ref_masks)
    for mask in masks:  # each redraw is one of the forward's three masks
        assert any(mask.shape == r.shape and torch.equal(mask, r) for r in ref_masks)


def _marked_block(x, w, tracker, masks, ends):
    out = block(x, w, tracker, masks)
    ends.append(1)  # reached only by a recompute that runs to the end
    return out


@pytest.mark.parametrize("early_stop", [True, False, "global-off"])
def test_early_stop_ends_the_recompute_early_and_restores_the_states(early_stop):
    """torch's early stop ends the recompute at the last saved tensor (before the function's
    end), and the generators and streams are restored as after a full recompute."""

    def go(ckpt: bool):
        tracker, x, w = start(4)
        masks: list[torch.Tensor] = []
        ends: list[int] = []
        if not ckpt:
            out = _marked_block(x, w, tracker, masks, ends)
        elif early_stop == "global-off":
            with torch_checkpoint.set_checkpoint_early_stop(False):
                out = checkpoint(_marked_block, x, w, tracker, masks, ends, tracker=tracker)
        else:
            out = checkpoint(
                _marked_block, x, w, tracker, masks, ends, tracker=tracker, early_stop=early_stop
            )
        (out * WEIGHTS).sum().backward()
        return masks, ends, [x.grad, w.grad, torch.rand(3)], end_state(tracker)

    ref_masks, _, ref_grads, ref_end = go(False)
    masks, ends, grads, end = go(True)
    assert ends == ([1] if early_stop is True else [1, 1])
    assert_masks_replayed(ref_masks, masks)
    assert same(ref_grads, grads) and same(ref_end, end)


def _changes_dtype(x, calls):
    calls.append(1)
    if len(calls) > 1:  # the recompute differs from the forward: exp saves a float64 result
        x = x.double()
    return (x * 2).exp().float()


def test_determinism_check_is_torchs():
    """ "default" catches a recompute that saves other metadata (torch's CheckpointError),
    "none" lets it pass, anything else is torch's ValueError (typed, raised before the function
    runs); reentrant mode ignores it, as torch's does."""
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(torch_checkpoint.CheckpointError, match="different metadata"):
        checkpoint(_changes_dtype, x, []).sum().backward()
    checkpoint(_changes_dtype, x, [], determinism_check="none").sum().backward()
    assert torch.equal(x.grad, (2 * (2 * x.detach().double()).exp()).float())
    tracker = make_tracker()
    before = end_state(tracker)
    calls: list[int] = []
    with pytest.raises(ValueError, match="determinism_check should be one of") as info:
        checkpoint(_changes_dtype, x, calls, determinism_check="strict")
    assert isinstance(info.value, CheckpointConfigError)
    assert isinstance(info.value, RNGTrackerError)
    assert same(before, end_state(tracker)) and not calls
    checkpoint(_changes_dtype, x, calls, use_reentrant=True, determinism_check="strict")


def test_debug_mode_works_and_logs_only_the_users_ops():
    """debug=True and set_checkpoint_debug_enabled(True): exact grads and masks; on a mismatch,
    torch's op log names the user's ops and none of the replay's own bookkeeping. (A debug-mode
    run leaves torch's logger in a state that breaks the next one under pytest's log capture:
    conftest's _restore_torch_debug_logger undoes it after each test.)"""
    tracker, x, w = start(5)
    masks: list[torch.Tensor] = []
    (block(x, w, tracker, masks) * WEIGHTS).sum().backward()
    ref = [x.grad, w.grad, *end_state(tracker)]
    for how in ("debug=True", "set_checkpoint_debug_enabled"):
        tracker, x, w = start(5)
        cmasks: list[torch.Tensor] = []
        debug = how == "debug=True"
        with torch_checkpoint.set_checkpoint_debug_enabled(None if debug else True):
            out = checkpoint(block, x, w, tracker, cmasks, tracker=tracker, debug=debug)
        (out * WEIGHTS).sum().backward()
        assert same(ref, [x.grad, w.grad, *end_state(tracker)]), how
        assert_masks_replayed(masks, cmasks)

    y = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(torch_checkpoint.CheckpointError) as info:
        checkpoint(_changes_dtype, y, [], debug=True).sum().backward()
    message = str(info.value)
    assert "Operations executed during the original forward" in message
    assert "aten.exp" in message
    assert "aten.clone" not in message  # the snapshots are taken with the modes off


def test_debug_with_a_context_fn_is_refused_as_torch_does():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
        checkpoint(torch.sin, x, debug=True, context_fn=rng_context_fn())


def _sac_context_fn():
    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op is torch.ops.aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return create_selective_checkpoint_contexts(policy)


@pytest.mark.parametrize("policy", ["policy function", "op list"])
def test_selective_checkpointing_composes_and_still_replays_every_stream(policy):
    """A user context_fn (torch's selective checkpointing: matmuls saved, the rest recomputed)
    composed with ours: the recomputed dropouts draw the forward's masks, grads are exact."""
    context_fn = (
        _sac_context_fn
        if policy == "policy function"
        else functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    )
    tracker, x, w = start(6)
    ref_masks: list[torch.Tensor] = []
    (block(x, w, tracker, ref_masks) * WEIGHTS).sum().backward()
    ref = [x.grad, w.grad, *end_state(tracker)]

    tracker, x, w = start(6)
    masks: list[torch.Tensor] = []
    (ours(block, x, w, tracker, masks, context_fn=context_fn) * WEIGHTS).sum().backward()
    assert_masks_replayed(ref_masks, masks)
    assert same(ref, [x.grad, w.grad, *end_state(tracker)])

    # The control: torch's selective checkpointing alone does not replay the tracker stream.
    tracker, x, w = start(6)
    masks = []
    torch_checkpoint.checkpoint(
        block, x, w, tracker, masks, use_reentrant=False, context_fn=context_fn
    ).sum().backward()
    assert not torch.equal(masks[0], masks[2])


class _Draws(contextlib.AbstractContextManager):
    """A user context that draws on entry: from the default generator and a tracker stream."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> None:
        torch.rand(5)
        with self.tracker.fork(STREAM):
            torch.rand(3)

    def __exit__(self, *exc_info: object) -> None:
        return None


def test_a_recompute_contexts_draws_leave_the_generators_as_torchs_do():
    """torch runs the whole recompute, the user's recompute context included, inside fork_rng;
    ours snapshot and restored inside the user's contexts, so a context that draws moved the
    generators on every backward (the next draws differed from torch's). Masks and gradients
    were and are the plain run's."""

    def after_backward(fn: Wrap, **options: Any) -> list[torch.Tensor]:
        tracker, x, w = start(3)
        masks: list[torch.Tensor] = []
        context_fn = lambda: (_Draws(tracker), _Draws(tracker))  # noqa: E731
        out = fn(block, x, w, tracker, masks, context_fn=context_fn, **options)
        before = end_state(tracker)
        (out * WEIGHTS).sum().backward()
        return [x.grad, w.grad, *before], end_state(tracker), masks

    def theirs(fn, x, w, tracker, masks, context_fn):
        return torch_checkpoint.checkpoint(
            fn, x, w, tracker, masks, use_reentrant=False, context_fn=context_fn
        )

    tracker, x, w = start(3)
    with _Draws(tracker):
        pass
    plain_masks: list[torch.Tensor] = []
    (block(x, w, tracker, plain_masks) * WEIGHTS).sum().backward()
    want = [x.grad, w.grad, *end_state(tracker)]
    for options in ({}, {"check_rng": True}):
        got, after, masks = after_backward(ours, **options)
        assert same(got, want) and same(after, want[2:])  # backward moved no generator
        assert_masks_replayed(plain_masks, masks)
    got, after, _ = after_backward(theirs)  # torch keeps the CPU generator (not tracker streams)
    assert torch.equal(after[0], want[2]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_preserve_rng_state_false_means_what_it_means_in_torch(reentrant):
    """preserve_rng_state=False replays nothing: masks, grads and end states are bitwise those
    of torch's checkpoint with preserve_rng_state=False (and the recompute's masks differ)."""

    def go(fn):
        tracker, x, w = start(7)
        masks: list[torch.Tensor] = []
        out = fn(block, x, w, tracker, masks, use_reentrant=reentrant, preserve_rng_state=False)
        (out * WEIGHTS).sum().backward()
        return masks, [x.grad, w.grad], end_state(tracker)

    theirs = go(torch_checkpoint.checkpoint)
    mine = go(checkpoint)
    assert same(theirs[0], mine[0]) and same(theirs[1], mine[1]) and same(theirs[2], mine[2])
    assert len(mine[0]) == 4 and not torch.equal(mine[0][0], mine[0][2])


def _sees_keywords(seen, x, **kwargs):
    seen.append(kwargs)
    return x.sin().exp()


def test_reentrant_takes_torchs_keywords_and_never_passes_them_to_the_function():
    """preserve_rng_state, determinism_check and early_stop are checkpoint's keywords in
    reentrant mode (as in torch): the function gets none of them, forward or recompute."""
    seen: list[dict] = []
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(
        _sees_keywords,
        seen,
        x,
        use_reentrant=True,
        preserve_rng_state=True,
        determinism_check="none",
        early_stop=False,
    )
    out.sum().backward()
    assert seen == [{}, {}]
    assert torch.equal(x.grad, (x.cos() * x.sin().exp()).detach())


@pytest.mark.parametrize(
    "options",
    [{"context_fn": rng_context_fn()}, {"debug": True}, {"scale": 2.0}, {"scale": 2, "bias": 1}],
    ids=["context_fn", "debug", "kwarg", "kwargs"],
)
def test_reentrant_refuses_what_torch_refuses_in_torchs_words(options):
    """Typed (CheckpointConfigError is a ValueError, like torch's), with torch's message, before
    the function runs and without touching any RNG state."""
    tracker = make_tracker()
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError) as theirs:
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=True, **options)
    before = end_state(tracker)
    calls: list[int] = []
    with pytest.raises(CheckpointConfigError) as mine:
        checkpoint(lambda t, **kw: calls.append(1), x, use_reentrant=True, **options)
    assert str(theirs.value) in str(mine.value) and not calls
    assert same(before, end_state(tracker))


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=...)", "no output needs grad"])
def test_reentrant_backward_raises_where_torch_raises_in_torchs_words(how):
    def detached(t):
        return t.sin().detach()

    def message(fn) -> str:
        x = torch.randn(3, requires_grad=True)
        if how == "no output needs grad":
            out = fn(detached, x, use_reentrant=True)
        else:
            out = fn(torch.sin, x, use_reentrant=True)
        with pytest.raises(RuntimeError) as info:
            if how == "autograd.grad":
                torch.autograd.grad(out.sum(), x)
            else:
                out.sum().backward(inputs=[x] if how != "no output needs grad" else None)
        return str(info.value)

    theirs, mine = message(torch_checkpoint.checkpoint), message(checkpoint)
    first_sentence = theirs.split(". ")[0]
    assert first_sentence in mine
    with pytest.raises(CheckpointUsageError):
        x = torch.randn(3, requires_grad=True)
        torch.autograd.grad(checkpoint(torch.sin, x, use_reentrant=True).sum(), x)


@pytest.mark.parametrize(
    "make, view",
    [
        (lambda: torch.randn(3, 4, requires_grad=True) * 1.0, lambda t: t[0]),
        (lambda: torch.ones(4, requires_grad=True), lambda t: t.view(2, 2)),
        (lambda: torch.randn(3, 4, requires_grad=True)[1:], lambda t: t.t()),
    ],
    ids=["view of a non-leaf", "view of a leaf", "view of an input view"],
)
def test_a_reentrant_output_that_views_an_input_refuses_in_place_changes_as_torchs(make, view):
    """Reentrant outputs that need grad under the forward's no_grad were all taken for tensors
    made outside and returned as detached aliases; a view of an input is one too, so an in-place
    change wrote into the caller's tensor unrefused (a leaf's too). It stays a view now."""

    def change_in_place(fn) -> tuple[str, torch.Tensor]:
        x = make()
        before = x.detach().clone()
        out = fn(view, x, use_reentrant=True)
        with pytest.raises(RuntimeError) as info:
            out.mul_(100.0)
        return str(info.value), torch.equal(x.detach(), before)

    theirs, mine = change_in_place(torch_checkpoint.checkpoint), change_in_place(checkpoint)
    assert "is a view and is being modified inplace" in theirs[0]
    assert theirs[0].replace("CheckpointFunction", "_ReentrantCheckpoint") == mine[0]
    assert theirs[1] and mine[1]  # nothing written


def _mixed(x, scale, tag, tracker):
    with tracker.fork(STREAM):
        y = F.dropout(x * scale, 0.5)
    return y.exp(), tag, None, y.sum()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_non_tensor_inputs_and_outputs_pass_through(reentrant):
    """As torch's tests of non-tensor inputs and outputs: they pass through unchanged, and the
    tensor outputs' grads equal the plain run's bitwise."""

    def go(ckpt: bool):
        tracker, x, _ = start(8)
        args = (x, 3.0, "tag", tracker)
        if ckpt:
            out = checkpoint(_mixed, *args, use_reentrant=reentrant, tracker=tracker)
        else:
            out = _mixed(*args)
        assert out[1:3] == ("tag", None)
        (out[0].sum() + out[3]).backward()
        return [x.grad, *end_state(tracker)]

    assert same(go(False), go(True))


@pytest.mark.parametrize(
    "options",
    [{"early_stop": True}, {"preserve_rng_state": False}],
    ids=["early_stop", "preserve_rng_state"],
)
def test_check_rng_with_options_that_defeat_it_is_refused_before_anything_runs(options):
    tracker = make_tracker()
    before = end_state(tracker)
    calls: list[int] = []
    with pytest.raises(CheckpointConfigError, match=next(iter(options))):
        checkpoint(lambda t: calls.append(1), torch.ones(2), check_rng=True, **options)
    assert same(before, end_state(tracker)) and not calls
