"""Checkpointing replays every RNG exactly: gradients and masks bitwise, in both modes."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from rng_tracker import (
    CheckpointRNGMismatchError,
    CheckpointWithoutOutput,
    RNGStatesTracker,
    RNGTrackerError,
    checkpoint,
    rng_context_fn,
)
from rng_tracker import megatron as mg
from rng_tracker.activation_checkpoint import is_checkpointing, reentrant_checkpoint
from rng_tracker.errors import (
    CheckpointConfigError,
    CheckpointTypeError,
    CheckpointUsageError,
    SeedReuseError,
    TrackerDeviceError,
)
from rng_tracker.megatron import checkpoint as megatron_checkpoint

MODES = {"non-reentrant": False, "reentrant": True}


def make_tracker() -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 101)
    tracker.add("data-parallel-rng", 202)
    return tracker


def dropout_block(x, w, tracker, masks):
    """Dropout in the default stream, in a fork, in a nested fork, and a raw CPU draw."""
    h = x @ w  # (batch, hidden)
    h = F.dropout(h, 0.3)
    masks.append(h != 0)
    with tracker.fork("model-parallel-rng"):
        h = F.dropout(h, 0.2)
        masks.append(h != 0)
        with tracker.fork("data-parallel-rng"):
            h = F.dropout(h, 0.1)
            masks.append(h != 0)
    noise = torch.rand(h.shape)
    masks.append(noise)
    return torch.tanh(h * noise)


def fixed_start() -> tuple[RNGStatesTracker, torch.Tensor, torch.Tensor]:
    """Seed 0, a fresh tracker, and the block's input and weight drawn from the default generator."""
    torch.manual_seed(0)
    tracker = make_tracker()
    return tracker, torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)


def run(mode: str | None, **options):
    """One forward+backward from fixed states; returns grads, masks and the final RNG states."""
    tracker, x, w = fixed_start()
    masks: list[torch.Tensor] = []
    if mode is None:
        out = dropout_block(x, w, tracker, masks)
    else:
        out = checkpoint(
            dropout_block,
            x,
            w,
            tracker,
            masks,
            use_reentrant=MODES[mode],
            tracker=tracker,
            **options,
        )
    (out * torch.linspace(-1, 1, 16)).sum().backward()
    end = (torch.get_rng_state(), tracker.get_states())
    return x.grad, w.grad, masks, end


def assert_same_end_states(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize(
    "options",
    [{}, {"offload_to_cpu": True}, {"check_rng": True}],
    ids=["plain", "offload", "check"],
)
@pytest.mark.parametrize("mode", MODES)
def test_gradients_and_masks_are_bitwise_equal_to_no_checkpoint(mode, options):
    """Grads equal the uncheckpointed block's bitwise; the recompute redraws the forward's masks;
    every generator and stream ends where it would have without checkpointing."""
    gx, gw, masks, end = run(None)
    cx, cw, cmasks, cend = run(mode, **options)
    assert torch.equal(gx, cx) and torch.equal(gw, cw)
    assert len(cmasks) == 2 * len(masks)
    for first, forward, recompute in zip(masks, cmasks[:4], cmasks[4:], strict=True):
        assert torch.equal(first, forward) and torch.equal(forward, recompute)
    assert_same_end_states(end, cend)


def test_non_reentrant_supports_autograd_grad_kwargs_and_nesting():
    """torch.autograd.grad, keyword arguments and a nested checkpoint work as in torch."""
    tracker = make_tracker()
    torch.manual_seed(1)
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)

    def outer(x, *, w, masks):
        return checkpoint(dropout_block, x, w, tracker, masks, tracker=tracker).sum(dim=0)

    def go(use_checkpoint: bool):
        torch.manual_seed(2)
        tracker.set_states(start)
        masks: list[torch.Tensor] = []
        out = (
            checkpoint(outer, x, w=w, masks=masks, tracker=tracker)
            if use_checkpoint
            else outer(x, w=w, masks=masks)
        )
        return torch.autograd.grad(out.square().sum(), (x, w))

    start = tracker.get_states()
    expected = go(False)
    got = go(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_reentrant_refuses_autograd_grad_clearly():
    tracker = make_tracker()
    x = torch.randn(2, 16, requires_grad=True)
    out = checkpoint(
        dropout_block, x, torch.eye(16), tracker, [], use_reentrant=True, tracker=tracker
    )
    with pytest.raises(CheckpointUsageError, match="use_reentrant=False"):
        torch.autograd.grad(out.sum(), x)


def test_inputs_without_grad_and_outputs_without_grad_work_non_reentrant():
    """Non-reentrant: inputs and outputs that need no grad are fine, as in torch."""
    tracker = make_tracker()
    x = torch.randn(2, 16)
    out = checkpoint(dropout_block, x, torch.eye(16), tracker, [], tracker=tracker)
    assert out.shape == (2, 16) and not out.requires_grad
    w = torch.randn(16, 16, requires_grad=True)
    out = checkpoint(lambda a, b: (a @ b).detach(), x, w, tracker=tracker)
    assert not out.requires_grad and w.grad is None


def test_reentrant_warns_and_raises_where_torch_does():
    """Reentrant, as torch's: no input requiring grad warns; an output that needs grad whose
    recompute needs none raises torch's "none of output has requires_grad=True"."""
    tracker = make_tracker()
    x = torch.randn(2, 16)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        out = checkpoint(
            dropout_block, x, torch.eye(16), tracker, [], use_reentrant=True, tracker=tracker
        )
    assert out.shape == (2, 16) and not out.requires_grad
    w = torch.randn(16, 16, requires_grad=True)
    out = checkpoint(lambda a, b: (a @ b).detach(), x, w, use_reentrant=True, tracker=tracker)
    assert out.requires_grad  # a Function's output requires grad when an input does
    with pytest.raises(CheckpointUsageError, match="none of output has requires_grad=True"):
        out.sum().backward()
    assert w.grad is None


def test_megatron_positional_checkpoint_is_reentrant_and_exact():
    gx, gw, _masks, _ = run(None)
    tracker, x, w = fixed_start()
    cmasks: list[torch.Tensor] = []
    out = mg.checkpoint(lambda a, b: dropout_block(a, b, tracker, cmasks), False, x, w)
    (out * torch.linspace(-1, 1, 16)).sum().backward()
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)


def test_torch_checkpoint_with_rng_context_fn_replays_tracker_streams():
    """torch.utils.checkpoint + rng_context_fn(): tracker streams replay bitwise."""
    gx, gw, _masks, end = run(None)
    tracker, x, w = fixed_start()
    cmasks: list[torch.Tensor] = []
    out = torch_checkpoint.checkpoint(
        dropout_block,
        x,
        w,
        tracker,
        cmasks,
        use_reentrant=False,
        context_fn=rng_context_fn(tracker),
    )
    (out * torch.linspace(-1, 1, 16)).sum().backward()
    assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    for forward, recompute in zip(cmasks[:4], cmasks[4:], strict=True):
        assert torch.equal(forward, recompute)
    assert_same_end_states(end, (torch.get_rng_state(), tracker.get_states()))


def test_torch_checkpoint_without_context_fn_does_not_replay_streams():
    """The control: plain torch.utils.checkpoint replays the default generators but not the streams."""
    tracker = make_tracker()
    cmasks: list[torch.Tensor] = []
    x = torch.randn(8, 16, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        dropout_block, x, torch.eye(16), tracker, cmasks, use_reentrant=False
    )
    out.sum().backward()
    assert torch.equal(cmasks[0], cmasks[4])  # default stream: torch replays it
    assert not torch.equal(cmasks[1], cmasks[5])  # model-parallel stream: it does not


def test_checkpoint_without_output_frees_the_output_and_recomputes_it_exactly():
    """The output's storage is empty between discard and backward; grads equal the plain run."""

    def go(selective: bool):
        torch.manual_seed(3)
        tracker = make_tracker()
        x = torch.randn(4, 16, requires_grad=True)
        w1 = torch.randn(16, 32, requires_grad=True)
        w2 = torch.randn(32, 8, requires_grad=True)

        def act(h):
            with tracker.fork("model-parallel-rng"):
                return F.dropout(F.gelu(h), 0.3)

        h = x @ w1
        if selective:
            cwo = CheckpointWithoutOutput(tracker=tracker)
            a = cwo.checkpoint(act, h)
            y = a @ w2
            cwo.discard_output_and_register_recompute(y)
            assert a.untyped_storage().nbytes() == 0
        else:
            y = act(h) @ w2
        (y * torch.linspace(-1, 1, 8)).sum().backward()
        return x.grad, w1.grad, w2.grad

    assert all(torch.equal(a, b) for a, b in zip(go(False), go(True), strict=True))


def _flaky_random(x, calls):
    calls.append(1)
    if len(calls) == 1:  # only in the first forward: a random op under data-dependent control flow
        torch.rand(3)
    return x.sin()  # saves x, so backward recomputes


_OUTSIDE = torch.Generator().manual_seed(0)


def _draws_outside_the_tracker(x):
    return x * torch.rand(x.shape, generator=_OUTSIDE)


@pytest.mark.parametrize("mode", MODES)
def test_check_rng_names_a_random_op_under_data_dependent_control_flow(mode):
    tracker = make_tracker()
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(
        _flaky_random, x, [], use_reentrant=MODES[mode], tracker=tracker, check_rng=True
    )
    before = (torch.get_rng_state(), tracker.get_states())
    with pytest.raises(CheckpointRNGMismatchError, match="the CPU generator") as info:
        out.sum().backward()
    assert "ran 1 random ops but the recompute ran 0" in str(info.value)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, RuntimeError)
    assert_same_end_states(before, (torch.get_rng_state(), tracker.get_states()))


@pytest.mark.parametrize("mode", MODES)
def test_check_rng_names_a_draw_from_a_generator_outside_the_tracker(mode):
    tracker = make_tracker()
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(
        _draws_outside_the_tracker, x, use_reentrant=MODES[mode], tracker=tracker, check_rng=True
    )
    with pytest.raises(
        CheckpointRNGMismatchError, match=r"explicit torch\.Generator outside the tracker"
    ):
        out.sum().backward()


def test_check_rng_names_a_stream_the_checkpoint_does_not_replay():
    tracker, other = make_tracker(), RNGStatesTracker("cpu")
    other.add("private", 5)

    def uses_other(x):
        with other.fork("private"):
            return F.dropout(x, 0.5)

    out = checkpoint(
        uses_other, torch.randn(16, requires_grad=True), tracker=tracker, check_rng=True
    )
    with pytest.raises(CheckpointRNGMismatchError, match="does not replay"):
        out.sum().backward()


def test_bad_input_is_typed_and_changes_nothing():
    tracker = make_tracker()
    before = (torch.get_rng_state(), tracker.get_states())
    with pytest.raises(CheckpointTypeError, match="callable"):
        checkpoint("not a function", torch.ones(1))
    with pytest.raises(TrackerDeviceError, match="meta"):
        checkpoint(torch.sin, torch.ones(1, device="meta"), tracker=tracker)
    with pytest.raises(CheckpointConfigError, match="tp_group"):
        checkpoint(torch.sin, torch.ones(1), distribute_saved_activations=True)
    assert_same_end_states(before, (torch.get_rng_state(), tracker.get_states()))


@pytest.mark.parametrize("mode", MODES)
def test_autocast_state_is_replayed_in_the_recompute(mode):
    """Under CPU autocast (bf16 matmul) the recompute runs in the same autocast state: grads equal
    the uncheckpointed autocast run bitwise, and differ from a run without autocast."""

    def go(ckpt: bool, autocast: bool):
        torch.manual_seed(4)
        tracker = make_tracker()
        x = torch.randn(8, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            masks: list[torch.Tensor] = []
            if ckpt:
                out = checkpoint(
                    dropout_block, x, w, tracker, masks, use_reentrant=MODES[mode], tracker=tracker
                )
            else:
                out = dropout_block(x, w, tracker, masks)
        out.float().sum().backward()
        return x.grad, w.grad

    expected = go(False, True)
    assert all(torch.equal(a, b) for a, b in zip(expected, go(True, True), strict=True))
    assert not torch.equal(expected[1], go(False, False)[1])


@pytest.mark.parametrize("mode", [*MODES, "megatron", "torch+rng_context_fn"])
def test_is_checkpointing_inside_forward_and_recompute_only(mode):
    """Megatron's is_checkpointing(): True in the checkpointed forward and in its recompute,
    False around them (also after the recompute restored the states)."""
    seen: list[bool] = []

    def f(x):
        seen.append(is_checkpointing())
        return x.sin().exp()

    x = torch.randn(4, requires_grad=True)
    assert not is_checkpointing()
    if mode == "megatron":
        out = megatron_checkpoint(f, False, x)
    elif mode == "torch+rng_context_fn":
        out = torch_checkpoint.checkpoint(f, x, use_reentrant=False, context_fn=rng_context_fn())
    else:
        out = checkpoint(f, x, use_reentrant=MODES[mode])
    assert seen == [True] and not is_checkpointing()
    out.sum().backward()
    assert seen == [True, True] and not is_checkpointing()


def test_megatron_checkpoint_refuses_what_it_cannot_split_without_touching_x():
    """distribute_saved_activations needs a viewless tensor first and an initialised parallel
    state (never a silent rank 0); refused before the function runs, x and RNG unchanged."""
    tracker = make_tracker()
    x = torch.randn(4, 4, requires_grad=True)
    before = (torch.get_rng_state(), tracker.get_states())
    calls: list[int] = []
    with pytest.raises(CheckpointConfigError, match="parallel state"):
        megatron_checkpoint(lambda t: calls.append(1), True, x)
    with pytest.raises(CheckpointConfigError, match="view"):
        megatron_checkpoint(lambda t: calls.append(1), True, x[1:])
    with pytest.raises(CheckpointConfigError, match="tensor as the first argument"):
        megatron_checkpoint(lambda *a: calls.append(1), True, 3, x)
    assert not calls and x.shape == (4, 4)
    assert_same_end_states(before, (torch.get_rng_state(), tracker.get_states()))


def test_a_tracker_that_is_not_one_is_refused_up_front_in_every_entry_point():
    """checkpoint, rng_context_fn and CheckpointWithoutOutput resolve tracker= one way: one
    tracker or several, each an RNGStatesTracker, else CheckpointTypeError before anything runs."""
    from rng_tracker import CheckpointWithoutOutput

    tracker = make_tracker()
    before = _states(tracker)
    for bad in ("model-parallel-rng", [tracker, 3], 5, 2.5, object()):
        with pytest.raises(CheckpointTypeError, match="must be an RNGStatesTracker") as info:
            checkpoint(torch.sin, torch.ones(1, requires_grad=True), tracker=bad)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
        with pytest.raises(CheckpointTypeError, match="must be an RNGStatesTracker"):
            rng_context_fn(bad)
        with pytest.raises(CheckpointTypeError, match="must be an RNGStatesTracker"):
            CheckpointWithoutOutput(tracker=bad)
    assert_same_end_states(before, _states(tracker))


class _LayoutOfNoGroups:
    """A layout whose group() answers a name, not a process group."""

    world_size = 2

    def rank(self, axis: str) -> int:
        return 0

    def size(self, axis: str) -> int:
        return 2

    def group(self, axis: str) -> str:
        return axis


_NOT_A_FLAG = ("no", 1, 0, None, torch.tensor(True))
_FLAGS = (
    "preserve_rng_state",
    "debug",
    "distribute_saved_activations",
    "offload_to_cpu",
    "check_rng",
)
_BAD_OPTIONS = [
    *[
        ({flag: bad}, CheckpointTypeError, f"{flag} must be a bool")
        for flag in _FLAGS
        for bad in _NOT_A_FLAG
    ],
    ({"early_stop": "yes"}, CheckpointTypeError, "early_stop must be a bool"),
    ({"tracker": 5}, CheckpointTypeError, "tracker must be an RNGStatesTracker, an iterable"),
    (
        {"tp_group": "tp"},
        CheckpointTypeError,
        r"tp_group must be a torch\.distributed\.ProcessGroup",
    ),
    (
        {"layout": object(), "distribute_saved_activations": True},
        CheckpointTypeError,
        r"layout must be a ParallelLayout, which provides group\(axis\)",
    ),
    ({"layout": "tp"}, CheckpointTypeError, "layout must be a ParallelLayout"),
    (
        {"layout": _LayoutOfNoGroups(), "distribute_saved_activations": True},
        CheckpointTypeError,
        r"layout\.group\('tp'\) must be a torch\.distributed\.ProcessGroup",
    ),
]
# (mode, options, error, match); reentrant mode ignores determinism_check, as torch's does.
_BAD_CALLS = [
    *[(mode, *case) for mode in MODES for case in _BAD_OPTIONS],
    *[
        (
            "non-reentrant",
            {"determinism_check": bad},
            CheckpointConfigError,
            "determinism_check should be one of",
        )
        for bad in ("bogus", 5)
    ],
    *[
        (None, {"use_reentrant": bad}, CheckpointTypeError, "use_reentrant must be a bool")
        for bad in ("no", 1, 0)
    ],
    # context_fn not callable, or not returning the pair: torch's bare TypeErrors before
    *[
        ("non-reentrant", {"context_fn": bad, **rng}, CheckpointTypeError, words)
        for bad, words in (
            (5, "context_fn must be callable"),
            (lambda: 5, "must return a pair"),
            (lambda: (contextlib.nullcontext(),), "must return a pair"),
        )
        for rng in ({}, {"preserve_rng_state": False})
    ],
]


def _states(tracker: RNGStatesTracker):
    return torch.get_rng_state(), tracker.get_states()


@pytest.mark.parametrize(("mode", "options", "error", "match"), _BAD_CALLS)
def test_bad_options_are_typed_and_refused_before_anything_runs(mode, options, error, match):
    """Every option of checkpoint is checked up front: a flag must be a bool (not a string,
    an int, None or a tensor), tracker/tp_group/layout/determinism_check of their type; the
    function never runs and no RNG state moves."""
    if mode is not None:
        options = {"use_reentrant": MODES[mode], **options}
    tracker = make_tracker()
    x = torch.randn(4, requires_grad=True)
    before = _states(tracker)
    calls: list[int] = []
    with pytest.raises(error, match=match) as info:
        checkpoint(lambda t: calls.append(1) or F.dropout(t, 0.5), x, **options)
    assert isinstance(info.value, RNGTrackerError)
    assert isinstance(info.value, ValueError if error is CheckpointConfigError else TypeError)
    assert not calls
    assert_same_end_states(before, _states(tracker))


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("non-reentrant", {"use_reentrant": None}),
        (
            "non-reentrant",
            {"use_reentrant": np.False_, "preserve_rng_state": np.True_, "check_rng": np.False_},
        ),
        # reentrant mode refuses debug=True: np.False_ must count as False there too
        ("reentrant", {"use_reentrant": np.True_, "debug": np.False_, "offload_to_cpu": np.False_}),
    ],
)
def test_flags_take_python_and_numpy_bools_and_use_reentrant_none_is_the_default(mode, options):
    """np.bool_ flags mean their bool; use_reentrant=None is non-reentrant (this library's
    default), as before: bitwise the same grads, masks and end states."""
    reference = run(mode)
    tracker, x, w = fixed_start()
    masks: list[torch.Tensor] = []
    out = checkpoint(dropout_block, x, w, tracker, masks, tracker=tracker, **options)
    reentrant = out.grad_fn.name() == "_ReentrantCheckpointBackward"
    assert reentrant == (mode == "reentrant")
    (out * torch.linspace(-1, 1, 16)).sum().backward()
    assert torch.equal(x.grad, reference[0]) and torch.equal(w.grad, reference[1])
    assert all(torch.equal(a, b) for a, b in zip(masks, reference[2], strict=True))
    assert_same_end_states(reference[3], (torch.get_rng_state(), tracker.get_states()))


@pytest.mark.parametrize("group", ["tp", object(), 0])
def test_reentrant_checkpoint_refuses_a_split_group_that_is_no_group_before_the_forward(group):
    """split_group is checked before the forward runs (the forward draws from the CPU
    generator), with a typed error; the caller's tensor keeps its data."""
    tracker = make_tracker()
    x = torch.randn(16, requires_grad=True)
    data = x.detach().clone()
    before = _states(tracker)
    calls: list[int] = []
    with pytest.raises(
        CheckpointTypeError, match=r"split_group must be a torch\.distributed"
    ) as info:
        reentrant_checkpoint(lambda t: calls.append(1) or F.dropout(t, 0.5), x, split_group=group)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
    assert not calls and torch.equal(x.detach(), data)
    assert_same_end_states(before, _states(tracker))


def test_rng_context_fn_default_replays_trackers_created_after_it():
    """tracker=None means every tracker alive when the checkpointed forward runs."""
    context_fn = rng_context_fn()
    tracker = make_tracker()  # created after the context_fn

    def f(t):
        with tracker.fork("model-parallel-rng"):
            return F.dropout(t, 0.5)

    x = torch.ones(64, requires_grad=True)
    out = torch_checkpoint.checkpoint(f, x, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    assert torch.equal(x.grad, (out != 0).float() * 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_recompute_restores_its_snapshot_without_making_generators(mode, monkeypatch):
    """Replay installs the forward's saved states directly: a recompute makes no generator and
    converts no state (no DeviceRNG.fresh/from_bytes/convert, the path for foreign states),
    whatever the number of streams, and still draws the forward's masks bitwise."""
    from rng_tracker._device_rng import DeviceRNG

    made: list[str] = []
    for name in ("fresh", "from_bytes", "convert"):
        real = getattr(DeviceRNG, name)

        def spy(self, *args, _real=real, _name=name):
            made.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(DeviceRNG, name, spy)
    tracker, x, w = fixed_start()
    for i in range(6):  # more streams: a per-stream cost would show as more calls
        tracker.add(f"extra-{i}", 300 + i)
    forward_masks: list[torch.Tensor] = []
    out = checkpoint(
        dropout_block, x, w, tracker, forward_masks, use_reentrant=MODES[mode], tracker=tracker
    )
    first = list(forward_masks)
    forward_masks.clear()  # the recompute appends its masks here
    made.clear()
    out.sum().backward()
    assert made == []
    tracker.set_states(tracker.get_states())  # the converting path: the spies see it
    assert made
    assert len(forward_masks) == len(first) == 4
    for a, b in zip(first, forward_masks, strict=True):
        assert torch.equal(a, b)


def _cwo(fn, x):
    """CheckpointWithoutOutput around ``fn``, its output discarded once consumed."""
    act = CheckpointWithoutOutput()
    y = act.checkpoint(fn, x) * x
    act.discard_output_and_register_recompute(y)
    return y


_WRAPS = {
    "non-reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=False) * x,
    "reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=True) * x,
    "torch + rng_context_fn": lambda fn, x: (
        torch_checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=rng_context_fn()) * x
    ),
    "CheckpointWithoutOutput": _cwo,
}


@pytest.mark.parametrize("wrap", list(_WRAPS), ids=str)
@pytest.mark.parametrize("where", ["checkpoint in the fork", "backward in the fork"])
def test_a_recompute_runs_in_the_forks_of_its_forward_not_of_its_backward(wrap, where):
    """The function forks stream "s". Called inside fork("s"), its fork re-enters the open
    stream and continues it, and the dropout after it draws from "s" too; called outside, the
    fork swaps "s" in. The recompute ran in the forks open at backward instead: wrong masks,
    wrong gradients, and no error."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 1)

    def fork_if(case: str) -> contextlib.AbstractContextManager:
        return tracker.fork("s") if where == case else contextlib.nullcontext()

    def f(x):
        with tracker.fork("s"):
            x = F.dropout(x, 0.5)
        return F.dropout(x, 0.5)

    def run(call):
        torch.manual_seed(0)
        tracker.set_states({"s": torch.Generator().manual_seed(1).get_state()})
        x = torch.ones(4, 16, requires_grad=True)
        with fork_if("checkpoint in the fork"):
            y = call(f, x)
        with fork_if("backward in the fork"):
            y.sum().backward()
        return y.detach(), x.grad, torch.get_rng_state(), tracker.get_states()["s"]

    plain, checkpointed = run(lambda fn, x: fn(x) * x), run(_WRAPS[wrap])
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_check_rng_accepts_a_checkpoint_inside_a_fork(mode):
    """Megatron's pattern (checkpoint a dropout inside tracker.fork()) raised a false
    CheckpointRNGMismatchError: the recompute, outside the fork, advanced the generator but not
    the stream the forward's end state showed."""
    tracker = make_tracker()
    x = torch.ones(8, requires_grad=True)
    with tracker.fork("model-parallel-rng"):
        y = checkpoint(
            lambda t: F.dropout(t, 0.5), x, use_reentrant=mode, check_rng=True, tracker=tracker
        )
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, (y != 0) * 2.0)


def test_check_rng_works_with_selective_checkpointing():
    """check_rng compared the states with torch.equal while selective checkpointing's recompute
    mode was still active; the forward had run no such op, so every backward failed with
    "aten.equal.default encountered during backward but not found in storage". The check is now
    unseen by the user's modes, as the snapshots are."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def block(x, w):
        return F.dropout(torch.tanh(x @ w), 0.3)

    def run(**options):
        torch.manual_seed(0)
        x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
        y = checkpoint(block, x, w, **options) if options else block(x, w)
        y.sum().backward()
        return x.grad, w.grad

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    plain = run()
    for check_rng in (False, True):
        got = run(context_fn=context_fn, check_rng=check_rng)
        assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_recompute_keeps_the_seeds_of_streams_added_after_its_forward(mode):
    """The replay put the forward's streams back and, with them, dropped the seed of a stream
    added later: after backward seeds() lost it and add() accepted its seed again."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)

    def f(x):
        with tracker.fork("a"):
            return F.dropout(x, 0.5)

    x = torch.ones(4, requires_grad=True)
    y = checkpoint(f, x, use_reentrant=mode, tracker=tracker)
    tracker.add("b", 2)
    y.sum().backward()
    assert tracker.seeds() == {"a": 1, "b": 2}
    assert tracker.state_dict()["streams"]["b"]["seed"] == 2
    with pytest.raises(SeedReuseError):
        tracker.add("c", 2)


def test_megatron_checkpoint_of_inputs_without_grad_gives_no_warning():
    """Megatron's own test_checkpoint call: its CheckpointFunction warns of nothing, so under
    -W error the facade must not either (torch's reentrant checkpoint, our use_reentrant=True,
    does warn: test_reentrant_warns_and_raises_where_torch_does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = mg.checkpoint(lambda a, b: a + b, None, torch.ones(16), torch.ones(16) * 2)
    assert torch.equal(out, torch.full((16,), 3.0))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoint_of_meta_tensors_runs_as_torchs_does(use_reentrant):
    """Meta tensors (shape checks, deferred init) have no generator to snapshot: the checkpoint
    runs forward and backward on them, as torch.utils.checkpoint does, where it refused meta as
    an unavailable device."""
    x = torch.empty(4, 4, device="meta", requires_grad=True)
    weight = torch.empty(4, 4, device="meta")

    def block(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(t @ weight, 0.5)

    out = checkpoint(block, x, use_reentrant=use_reentrant)
    out.sum().backward()
    assert out.is_meta and x.grad is not None and x.grad.shape == (4, 4)


@pytest.mark.parametrize("preserve", [True, False])
def test_a_context_fn_may_return_its_pair_as_any_two_item_iterable(preserve) -> None:
    """torch unpacks what context_fn returns, so a list of two contexts works there; the check
    that refuses what is no pair took only a tuple. Both forms give the same gradients."""

    def run(make: object) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(4, requires_grad=True)
        y = checkpoint(
            lambda t: F.dropout(t, 0.5) * 2, x, context_fn=make, preserve_rng_state=preserve
        )
        y.sum().backward()
        return x.grad

    as_tuple = run(lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
    as_list = run(lambda: [contextlib.nullcontext(), contextlib.nullcontext()])
    assert torch.equal(as_tuple, as_list)
