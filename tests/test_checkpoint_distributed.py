"""On 4 gloo ranks (tp=2, dp=2): a TP block checkpointed in every mode matches the plain run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rng_tracker import MODEL_PARALLEL_RNG, checkpoint, get_rng_tracker, model_parallel_seed
from rng_tracker.megatron import checkpoint as megatron_checkpoint
from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
from rng_tracker.parallel._tp_mappings import copy_to_tp, reduce_from_tp
from rng_tracker.parallel.testing import run_distributed

HIDDEN, FFN, BATCH = 16, 32, 6
VARIANTS = {
    "none": None,
    "non-reentrant": {"use_reentrant": False},
    "reentrant": {"use_reentrant": True},
    "non-reentrant+distribute": {"use_reentrant": False, "distribute_saved_activations": True},
    "reentrant+distribute": {"use_reentrant": True, "distribute_saved_activations": True},
    "megatron+distribute": "megatron",
}


def tp_block(x, w1_shard, w2_shard, group, masks):
    """Column-parallel → sharded dropout (model-parallel stream) → row-parallel → replicated dropout."""
    h = copy_to_tp(x, group) @ w1_shard  # (batch, ffn/tp), sharded
    with get_rng_tracker("cpu").fork(MODEL_PARALLEL_RNG):
        h = F.dropout(h, 0.25)
    masks.append(h != 0)
    out = reduce_from_tp(h @ w2_shard, group)  # (batch, hidden), replicated
    out = F.dropout(out, 0.25)
    masks.append(out != 0)
    return out


def _run_all_variants() -> dict:
    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    group, tp, dp = state.group("tp"), state.rank("tp"), state.rank("dp")
    weights = torch.Generator().manual_seed(0)
    w1 = torch.randn(HIDDEN, FFN, generator=weights).chunk(2, dim=1)[tp]
    w2 = torch.randn(FFN, HIDDEN, generator=weights).chunk(2, dim=0)[tp]
    data = torch.randn(BATCH, HIDDEN - 1, generator=torch.Generator().manual_seed(100 + dp))
    results = {}
    for name, options in VARIANTS.items():
        model_parallel_seed(7)
        x = F.pad(data, (0, 1)).requires_grad_()  # numel 96 + padding test: see split below
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        masks: list[torch.Tensor] = []
        if options is None:
            out = tp_block(x, a, b, group, masks)
        elif options == "megatron":
            out = megatron_checkpoint(tp_block, True, x, a, b, group, masks)
            assert x.shape == (BATCH * HIDDEN // 2,)  # the caller's x holds only its chunk now
        else:
            out = checkpoint(tp_block, x, a, b, group, masks, **options)
        (out * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        assert x.shape == (BATCH, HIDDEN)  # whole again after backward
        results[name] = {"grads": (x.grad, a.grad, b.grad), "masks": masks}
    destroy_model_parallel()
    return results


def _odd_sized_distribute() -> tuple:
    """A first input whose numel (7 * 5 = 35) does not divide by tp=2: padded, not truncated."""
    destroy_model_parallel()
    init_model_parallel(tensor=2)
    model_parallel_seed(3)
    outs = []
    for options in (None, {"use_reentrant": True}, {"use_reentrant": False}, "megatron"):
        x = torch.arange(35.0).reshape(7, 5).clone().requires_grad_()  # viewless
        f = lambda t: (t.sin() * t).sum()  # noqa: E731 - tiny local function
        if options is None:
            loss = f(x)
        elif options == "megatron":
            loss = megatron_checkpoint(f, True, x)
            assert x.shape == (18,)  # ceil(35 / 2): this rank's padded chunk
        else:
            loss = checkpoint(f, x, distribute_saved_activations=True, **options)
        loss.backward()
        assert x.shape == (7, 5) and torch.equal(x.detach(), torch.arange(35.0).reshape(7, 5))
        outs.append(x.grad)
    destroy_model_parallel()
    return tuple(outs)


def test_tp_block_checkpointed_in_every_mode_is_bitwise_exact():
    """Every rank: grads of each checkpoint variant equal the plain run's bitwise; replicated masks
    are equal across the TP group and sharded masks differ; recompute masks equal the forward's."""
    ranks = run_distributed(_run_all_variants, world_size=4, timeout=120)
    for rank, results in enumerate(ranks):
        plain = results["none"]
        for name, got in results.items():
            assert all(
                torch.equal(p, g) for p, g in zip(plain["grads"], got["grads"], strict=True)
            ), (rank, name)
            forward, recompute = got["masks"][:2], got["masks"][2:]
            assert all(torch.equal(p, f) for p, f in zip(plain["masks"], forward, strict=True)), (
                rank,
                name,
            )
            if (
                name != "none"
            ):  # non-reentrant early stop may end the recompute before the last mask
                assert recompute and all(torch.equal(f, r) for f, r in zip(forward, recompute)), (
                    rank,
                    name,
                )
    for a, b in ((0, 1), (2, 3)):  # TP groups (tp is the fastest-varying axis)
        sharded_a, replicated_a = ranks[a]["none"]["masks"]
        sharded_b, replicated_b = ranks[b]["none"]["masks"]
        assert torch.equal(replicated_a, replicated_b)
        assert not torch.equal(sharded_a, sharded_b)


def test_distributed_saved_input_of_odd_size_is_padded_not_truncated():
    for plain, *checkpointed in run_distributed(_odd_sized_distribute, world_size=2):
        assert all(torch.equal(plain, grad) for grad in checkpointed)


def test_input_saver_says_packing_and_keeps_active_as_a_deprecated_alias():
    from rng_tracker._saved_inputs import InputSaver

    assert not InputSaver().packing and InputSaver(offload=True).packing
    kept = torch.ones(3)
    assert InputSaver(distribute=kept, group=None).packing
    with pytest.warns(DeprecationWarning, match=r"InputSaver\.active is deprecated.*packing"):
        assert InputSaver(offload=True).active is True


class _GivenLayout:
    """A ParallelState-like layout built by hand: tp over both ranks, on a group of its own."""

    def __init__(self) -> None:
        self.tp_group = torch.distributed.new_group([0, 1])
        self.asked: list[str] = []

    def rank(self, axis: str) -> int:
        return torch.distributed.get_rank() if axis == "tp" else 0

    def group(self, axis: str) -> torch.distributed.ProcessGroup:
        self.asked.append(axis)
        return self.tp_group


def _distribute_with_a_given_layout() -> dict:
    """No process-wide parallel state: checkpoint(layout=...) splits over its TP group."""
    import torch.distributed as dist

    from rng_tracker.parallel._megatron_state import current_layout

    destroy_model_parallel()
    assert current_layout() is None
    layout = _GivenLayout()
    model_parallel_seed(5, layout=layout)
    gathered_over: list[bool] = []
    all_gather = dist.all_gather

    def recording_all_gather(*args, group=None, **kwargs):
        gathered_over.append(group is layout.tp_group)
        return all_gather(*args, group=group, **kwargs)

    dist.all_gather = recording_all_gather
    try:
        grads = []
        for options in (None, {"use_reentrant": True}, {"use_reentrant": False}):
            x = torch.arange(35.0).reshape(7, 5).clone().requires_grad_()
            f = lambda t: (F.dropout(t, 0.5).sin() * t).sum()  # noqa: E731 - tiny local function
            state = torch.get_rng_state()
            if options is None:
                loss = f(x)
            else:
                loss = checkpoint(f, x, distribute_saved_activations=True, layout=layout, **options)
            loss.backward()
            torch.set_rng_state(state)
            grads.append(x.grad)
    finally:
        dist.all_gather = all_gather
    return {"grads": grads, "asked": layout.asked, "gathered_over": gathered_over}


def test_distribute_saved_activations_takes_the_layout_as_an_argument():
    """checkpoint(..., layout=layout) splits over layout.group('tp') with no global
    parallel state initialised, and recomputes bitwise what the plain run computes."""
    for result in run_distributed(_distribute_with_a_given_layout, world_size=2):
        plain, *checkpointed = result["grads"]
        assert all(torch.equal(plain, grad) for grad in checkpointed)
        assert result["asked"] == ["tp", "tp"]
        assert result["gathered_over"] == [True, True]


def _tanh_of_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _backward_twice_with_a_split_input() -> dict:
    from rng_tracker.activation_checkpoint import reentrant_checkpoint

    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    group = state.group("tp")
    grads = {}
    try:
        for name in ("plain", "split_group", "megatron"):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
            w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
            if name == "plain":
                y = _tanh_of_product(x, w)
            elif name == "split_group":
                y = reentrant_checkpoint(_tanh_of_product, x, w, split_group=group)
            else:
                y = megatron_checkpoint(_tanh_of_product, True, x, w)
            loss = y.sum()
            loss.backward(retain_graph=True)
            loss.backward()
            grads[name] = (x.grad, w.grad, x.shape)
    finally:
        destroy_model_parallel()
    return grads


def test_a_split_input_survives_a_second_backward():
    """backward(retain_graph=True) then backward again: the second all-gathered the input the
    first had made whole, and failed ("shape '[3, 4]' is invalid for input of size 24"); a 1-D
    input silently kept rank 0's copy. Both backwards now give the plain run's gradients."""
    for grads in run_distributed(_backward_twice_with_a_split_input, world_size=2):
        for name in ("split_group", "megatron"):
            assert grads[name][2] == (3, 4)
            assert torch.equal(grads[name][0], grads["plain"][0]), name
            assert torch.equal(grads[name][1], grads["plain"][1]), name


def _change_another_input_in_place(use_reentrant: bool) -> str:
    from rng_tracker.errors import CheckpointUsageError

    destroy_model_parallel()
    state = init_model_parallel(tensor=2)
    try:
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = checkpoint(
            _tanh_of_product,
            x,
            w,
            use_reentrant=use_reentrant,
            distribute_saved_activations=True,
            tp_group=state.group("tp"),
        )
        with torch.no_grad():
            w.add_(1)
        try:
            y.sum().backward()
        except CheckpointUsageError as error:
            assert isinstance(error, RuntimeError)
            return str(error)
        return "no error"
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_an_input_changed_in_place_after_forward_is_refused_when_another_is_distributed(
    use_reentrant,
):
    """The inputs that are not split were kept by reference, without autograd's version check:
    w.add_(1) after forward went unnoticed, and the recompute used the new w, giving x another
    gradient than the forward's. As without distribute_saved_activations, it is refused."""
    for message in run_distributed(
        _change_another_input_in_place, world_size=2, args=(use_reentrant,)
    ):
        assert "modified by an inplace operation" in message
        assert "shape (4, 4)" in message and "expected 0" in message
