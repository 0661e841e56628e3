"""torchtitan 0.3.0's own Llama3 debug model, parallelized by torchtitan's own function.

Claim: with one line (``enable_invariant_random()``, its default init mode: keyed, each rank
computing only its shard), the model initialised by torchtitan's
``init_weights`` and a dropout site on a TP-sharded activation draw, on 1, 2 and 4 gloo CPU
ranks (TP=1 with FSDP, TP=2, TP=4) and on TP=2 x FSDP=2 (each data-parallel rank running its
own samples inside ``rng_tracker.batch_position``), bitwise the parameters and masks of the
single-device model; and a DCP checkpoint of ``rng_tracker.dcp.RNGStateful`` saved at
TP=2 x FSDP=2 and loaded at TP=4 draws the next step's masks bitwise equal to the
uninterrupted single-device run.

The model is torchtitan's ``debugmodel`` flavor with its attention backend set to
torchtitan's own ``ScaledDotProductAttention`` (its FlexAttention has no CPU backward and
compiles for tens of seconds on CPU); torchtitan is installed by scripts/test.sh (--no-deps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchtitan  # noqa: F401  scripts/test.sh installs it (scripts/frameworks.txt): never skipped
from _torchtitan_model import build_llama3_debug

_BATCH, _SEQ, _P = 2, 16, 0.25


def _build(tp: int = 1, dp_shard: int = 1, *, parallel: bool = True) -> torch.nn.Module:
    """torchtitan's Llama3 debug model on meta, parallelized by torchtitan, then on CPU."""
    return build_llama3_debug(tp, dp_shard, parallel=parallel)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _add_dropout_site(model: torch.nn.Module, masks: list[torch.Tensor]) -> None:
    """Dropout on the first block's w1 output (TP: Shard(2) over the hidden dim)."""
    import torch.nn.functional as F

    def site(module: Any, inputs: Any, out: torch.Tensor) -> torch.Tensor:
        dropped = F.dropout(out, _P, training=True)
        masks.append(_full(dropped) != 0)
        return dropped

    model.layers["0"].feed_forward.w1.register_forward_hook(site)


def _steps(
    model: torch.nn.Module, masks: list[torch.Tensor], steps: int, dp: tuple[int, int] = (0, 1)
) -> None:
    """``steps`` forwards of the global batch; ``dp`` = (data-parallel rank, degree): this rank
    runs its own samples, in their batch position."""
    import rng_tracker

    rank, degree = dp
    local = _BATCH // degree
    tokens = torch.arange(_BATCH * _SEQ).reshape(_BATCH, _SEQ) * 37 % 2048
    tokens = tokens[rank * local : (rank + 1) * local]
    positions = torch.arange(_SEQ).repeat(local, 1)
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            with rng_tracker.batch_position(rank * local, _BATCH):
                model(tokens, positions=positions)


def _run(
    tp: int, dp_shard: int, *, parallel: bool = True, steps: int = 2
) -> tuple[dict, list[torch.Tensor], torch.Tensor]:
    """Params after torchtitan's init, each step's masks, the generator state after step 1."""
    from rng_tracker.parallel.invariant import disable_invariant_random, enable_invariant_random

    model = _build(tp, dp_shard, parallel=parallel)
    torch.manual_seed(0)  # the same on every rank, after the build (which may draw per rank)
    masks: list[torch.Tensor] = []
    _add_dropout_site(model, masks)
    enable_invariant_random()  # the one line
    try:
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        params = {n: _full(p) for n, p in model.named_parameters()}
        _steps(model, masks, 1)
        after_step_1 = torch.get_rng_state()
        _steps(model, masks, steps - 1)
    finally:
        disable_invariant_random()
    return params, masks, after_step_1


def _assert_equal_to_single_device(got: tuple, want: tuple, what: str) -> None:
    params, masks, _ = got
    want_params, want_masks, _ = want
    assert params.keys() == want_params.keys()
    differ = [n for n in params if not torch.equal(params[n], want_params[n])]
    assert not differ, f"{what}: {len(differ)} of {len(params)} parameters differ: {differ[:4]}"
    assert len(masks) == len(want_masks)
    for step, (a, b) in enumerate(zip(masks, want_masks, strict=True)):
        assert torch.equal(a, b), f"{what}: step {step} mask differs"


@pytest.mark.distributed(world_size=1, timeout=300)
def test_one_rank_equals_single_device() -> None:
    single = _run(1, 1, parallel=False)
    _assert_equal_to_single_device(_run(1, 1), single, "TP=1 (FSDP, 1 rank)")


@pytest.mark.distributed(world_size=2, timeout=300)
def test_tp2_equals_single_device() -> None:
    single = _run(1, 1, parallel=False)
    _assert_equal_to_single_device(_run(2, 1), single, "TP=2")


@pytest.mark.distributed(world_size=4, timeout=600)
def test_tp4_and_tp2_fsdp2_and_a_dcp_resume_across_layouts(rank: int, tmp_path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rng_tracker.dcp import RNGStateful
    from rng_tracker.parallel.invariant import disable_invariant_random, enable_invariant_random

    single = _run(1, 1, parallel=False)
    _assert_equal_to_single_device(_run(4, 1), single, "TP=4")

    # TP=2 x FSDP=2, each data-parallel rank on its own sample of the batch (torchtitan's mesh:
    # fsdp outer, tp inner): one step, then a DCP checkpoint of the RNG state
    model = _build(2, 2)
    torch.manual_seed(0)
    masks: list[torch.Tensor] = []
    _add_dropout_site(model, masks)
    enable_invariant_random()
    try:
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        params = {n: _full(p) for n, p in model.named_parameters()}
        _steps(model, masks, 1, dp=(rank // 2, 2))
        path = str(tmp_path / "ckpt")
        dcp.save({"rng": RNGStateful(layout={"tp": 2, "fsdp": 2})}, checkpoint_id=path)
    finally:
        disable_invariant_random()
    per_rank = [torch.empty_like(masks[0]) for _ in range(4)]
    dist.all_gather(per_rank, masks[0])
    masks = [torch.cat(per_rank[::2])]  # the two data-parallel ranks' samples, in batch order
    _assert_equal_to_single_device((params, masks, None), (single[0], single[1][:1], None), "2x2")

    # resume at TP=4 in a fresh model; the generator is elsewhere until the load
    resumed = _build(4, 1)
    torch.manual_seed(1234)
    resumed_masks: list[torch.Tensor] = []
    _add_dropout_site(resumed, resumed_masks)
    enable_invariant_random()
    try:
        with torch.no_grad():
            resumed.init_weights(buffer_device=None)
        dcp.load({"rng": RNGStateful(layout={"tp": 4, "fsdp": 1})}, checkpoint_id=path)
        assert torch.equal(torch.get_rng_state(), single[2])
        _steps(resumed, resumed_masks, 1)
    finally:
        disable_invariant_random()
    assert torch.equal(resumed_masks[0], single[1][1]), "resumed step 2 mask differs"
