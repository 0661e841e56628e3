"""Dropout sites (rng_tracker.parallel.sites): one rule for which randomness a dropout call draws,
called by TinyGPT and by a model of the user's own alike.

Claims:
- On 2 real gloo ranks (one TP group of 2), a user's own block (not TinyGPT) that calls
  ``site_dropout`` at a head-sharded, a replicated and a sequence-sharded site draws, gathered
  over both ranks, bitwise the masks of the same calls on one device over the whole tensors in
  invariant and keyed modes (TP does not change them; keyed draws nothing from the generator);
  in megatron mode a sharded site is exactly a draw inside ``fork("model-parallel-rng")``
  (different per TP rank, the default generator untouched) and a replicated site a draw from
  the default generator (equal on both ranks).
- TinyGPT's keyed masks, at every site, are ``site_dropout``'s for the same site and layout.
- Bad options are typed errors that draw nothing; ``batch_position`` is per thread; the names
  that moved from ``rng_tracker.parallel.transformer`` still resolve there, warning.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from rng_tracker import get_keyed_rng, get_rng_tracker
from rng_tracker.errors import ParallelConfigError
from rng_tracker.kernels import dropout as kernel_dropout
from rng_tracker.parallel.sites import (
    BatchPosition,
    batch_position,
    current_batch_position,
    place_masks,
    record_masks,
    site_dropout,
)

_P = 0.4
_GLOBAL_BATCH = 8


def _logical() -> dict[str, torch.Tensor]:
    """The logical activations of one microbatch (4 of the global batch's 8 samples)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "probs": torch.rand(4, 4, 6, 6, generator=gen),  # (batch, heads, s, s)
        "out": torch.randn(6, 4, 8, generator=gen),  # (s, batch, hidden)
        "residual": torch.randn(6, 4, 8, generator=gen),
        "bias": torch.randn(8, generator=gen),
    }


def _user_block(
    t: dict[str, torch.Tensor], rng_mode: str, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """A user's model: its own tensors, its own site names; ``t`` holds this rank's parts."""
    position = current_batch_position(t["probs"].shape[0])  # what a layer captures in forward
    common = {"rng_mode": rng_mode, "group": group, "position": position}
    return [
        site_dropout("block.attention", t["probs"], _P, sharded_dim=1, batch_dim=0, **common),
        site_dropout(
            "block.output", t["out"], _P, bias=t["bias"], residual=t["residual"], **common
        ),
        site_dropout("block.output_sp", t["out_sp"], _P, sharded_dim=0, **common),
    ]


def _parts(t: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's parts: heads sharded, the output replicated, and sequence-sharded (SP)."""
    return {
        "probs": t["probs"].chunk(tp, dim=1)[rank],
        "out": t["out"],
        "residual": t["residual"],
        "bias": t["bias"],
        "out_sp": t["out"].chunk(tp, dim=0)[rank],
    }


def _gathered(records: list) -> dict[str, torch.Tensor]:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(records))
    return place_masks(r for rank_records in everyone for r in rank_records)


def _layout_free_modes(rank: int) -> None:
    """invariant and keyed: TP=2 gathered == one device, bitwise, every element covered."""
    logical = _logical()
    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(21)
    keyed.set_step(5)
    for rng_mode in ("invariant", "keyed"):
        placed = {}
        for name, group, tp, at in (("tp2", dist.group.WORLD, 2, rank), ("one", None, 1, 0)):
            torch.manual_seed(7)  # the replicated stream: the same state on every rank
            before = torch.get_rng_state()
            with record_masks() as records, batch_position(4, _GLOBAL_BATCH):
                _user_block(_parts(logical, at, tp), rng_mode, group)
            if rng_mode == "keyed":
                assert torch.equal(torch.get_rng_state(), before)  # nothing drawn
            placed[name] = _gathered(records) if group is not None else place_masks(records)
        assert list(placed["tp2"]) == list(placed["one"]), rng_mode
        for site, mask in placed["one"].items():
            ours = mask[4:] if site == "block.attention" else mask[:, 4:]  # samples 4..7
            assert bool((ours >= 0).all()), (rng_mode, site)
            assert torch.equal(placed["tp2"][site], mask), (rng_mode, site)


def _megatron_mode(rank: int) -> None:
    from rng_tracker import MODEL_PARALLEL_RNG, model_parallel_seed

    ranks = {"pp_rank": 0, "dp_rank": 0, "cp_rank": 0, "ep_rank": 0, "etp_rank": 0}
    model_parallel_seed(1234, tp_rank=rank, **ranks)  # model-parallel-rng differs per TP rank
    tracker = get_rng_tracker("cpu")
    t = _parts(_logical(), rank, 2)
    streams, default = tracker.get_states(), torch.get_rng_state()
    with record_masks() as records:
        _user_block(t, "megatron", dist.group.WORLD)
    masks = {record.site: record.mask for record in records}
    tracker.set_states(streams)
    torch.set_rng_state(default)
    with tracker.fork(MODEL_PARALLEL_RNG):
        attention = kernel_dropout(torch.ones_like(t["probs"]), _P) != 0
    assert torch.equal(torch.get_rng_state(), default)  # a sharded site leaves it alone
    output = kernel_dropout(torch.ones_like(t["out"]), _P) != 0
    with tracker.fork(MODEL_PARALLEL_RNG):
        output_sp = kernel_dropout(torch.ones_like(t["out_sp"]), _P) != 0
    assert torch.equal(masks["block.attention"], attention)
    assert torch.equal(masks["block.output"], output)
    assert torch.equal(masks["block.output_sp"], output_sp)
    everyone: list = [None] * 2
    dist.all_gather_object(everyone, masks)
    assert torch.equal(everyone[0]["block.output"], everyone[1]["block.output"])  # replicated
    assert not torch.equal(everyone[0]["block.attention"], everyone[1]["block.attention"])


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_users_model_places_its_sites_by_the_rule(rank: int) -> None:
    """See the module docstring's first claim (all three rng modes in one run of 2 ranks)."""
    _layout_free_modes(rank)
    _megatron_mode(rank)


def test_tinygpt_keyed_masks_are_site_dropouts() -> None:
    """Every mask TinyGPT records in keyed mode is site_dropout's for that site, layout and
    batch position (keyed masks are pure functions of them, so a direct call reproduces it)."""
    from rng_tracker.parallel.transformer import GPTConfig, TinyGPT

    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(8)
    model = TinyGPT(GPTConfig(hidden=16, heads=2, ffn=32, seq_len=8, rng_mode="keyed"))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with record_masks() as records, batch_position(2, 4):
        model.loss(tokens, tokens)
    assert [r.site for r in records] == list(model.sites)
    for record in records:
        attention = record.site.endswith(".attention")
        p = 0.1  # GPTConfig's default rate at every site
        again = site_dropout(
            record.site,
            torch.ones(record.mask.shape),
            p,
            rng_mode="keyed",
            batch_dim=0 if attention else 1,
            position=BatchPosition(2, 4),
        )
        assert torch.equal(again != 0, record.mask), record.site


def test_bad_options_are_typed_errors_that_draw_nothing() -> None:
    x = torch.ones(4, 3)
    state = torch.get_rng_state()
    for options, words in (
        ({"rng_mode": "stream"}, "rng_mode must be"),
        ({"rng_mode": "invariant", "sharded_dim": 2}, "sharded_dim=2 is not a dim"),
        ({"rng_mode": "keyed", "batch_dim": -3}, "batch_dim=-3 is not a dim"),
        ({"rng_mode": "megatron", "bias": torch.ones(3)}, "needs residual="),
    ):
        with pytest.raises(ParallelConfigError, match=words):
            site_dropout("s", x, 0.5, **options)
    with pytest.raises(ParallelConfigError, match="does not fit"), batch_position(3, 4):
        site_dropout("s", x, 0.5, rng_mode="invariant", batch_dim=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_batch_position_is_per_thread() -> None:
    """A position entered in one thread is not another thread's: that thread's local batch is
    its whole batch."""
    seen = {}
    with batch_position(4, 8):
        worker = threading.Thread(target=lambda: seen.update(other=current_batch_position(2)))
        worker.start()
        worker.join()
        assert current_batch_position(2) == BatchPosition(4, 8)
    assert seen["other"] == BatchPosition(0, 2)
    assert current_batch_position(3) == BatchPosition(0, 3)
