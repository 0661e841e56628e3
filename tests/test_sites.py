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
- Bad options are typed errors that draw nothing and change no state; a refused keyed call
  registers no site; ``batch_position`` is per thread; the names that moved from
  ``rng_tracker.parallel.transformer`` still resolve there, warning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from rng_tracker import (
    CheckpointWithoutOutput,
    _keyed,
    checkpoint,
    get_keyed_rng,
    get_rng_tracker,
    rng_context_fn,
)
from rng_tracker._keyed import KeyedRNG
from rng_tracker.errors import (
    ArgumentTypeError,
    KernelInputError,
    KernelInputTypeError,
    KeyedTypeError,
    KeyedUnseededError,
    ParallelConfigError,
    ParallelConfigTypeError,
    RNGTrackerError,
    SiteIdError,
)
from rng_tracker.kernels import Region
from rng_tracker.kernels import bias_dropout_add as kernel_bias_dropout_add
from rng_tracker.kernels import dropout as kernel_dropout
from rng_tracker.parallel import copy_to_tp
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


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_keyed_site_on_several_data_parallel_ranks_needs_the_batch_position(rank: int) -> None:
    """Two data-parallel ranks, no batch position: a keyed site took each rank's local batch for
    the whole global batch, so both ranks drew one mask for different samples (not the mask one
    device draws over the global batch), and nothing said so. It now raises
    MissingBatchPositionError, as invariant_random() and megatron's invariant sites do, before
    the site is registered; so does current_batch_position (what a model captures for its
    recompute). With the position, each rank draws its rows of the one-device mask. Megatron
    mode, which reads no position, still draws."""
    from rng_tracker.errors import MissingBatchPositionError
    from rng_tracker.parallel import destroy_model_parallel, init_model_parallel

    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(3)
    whole = site_dropout("one.device", torch.ones(4, 8), 0.5, rng_mode="keyed", batch_dim=0)
    init_model_parallel(tensor=1)  # data parallelism of 2
    try:
        x = torch.ones(2, 8)
        with pytest.raises(MissingBatchPositionError, match="batch_position"):
            site_dropout("dp.site", x, 0.5, rng_mode="keyed", batch_dim=0)
        assert "dp.site" not in keyed
        with pytest.raises(MissingBatchPositionError, match="batch_position"):
            current_batch_position(2)
        with batch_position(2 * rank, 4):
            mine = site_dropout("one.device", x, 0.5, rng_mode="keyed", batch_dim=0)
            assert current_batch_position(2) == BatchPosition(2 * rank, 4)
        assert torch.equal(mine, whole[2 * rank : 2 * rank + 2])
        site_dropout("dp.site", x, 0.5, rng_mode="megatron", batch_dim=0)
    finally:
        destroy_model_parallel()


@pytest.mark.distributed(world_size=2, timeout=120)
def test_tinygpt_asks_for_a_batch_position_only_where_a_keyed_mask_reads_it(rank: int) -> None:
    """Two data-parallel ranks, no batch position: a keyed TinyGPT with dropout refuses
    (MissingBatchPositionError), one whose every dropout rate is 0 draws nothing and trains, as
    site_dropout itself does (its layers asked for the position whenever keyed and training)."""
    from rng_tracker.errors import MissingBatchPositionError
    from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
    from rng_tracker.parallel.transformer import GPTConfig, TinyGPT

    get_keyed_rng("cpu").manual_seed(8)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    init_model_parallel(tensor=1)  # data parallelism of 2
    try:
        sizes = {"hidden": 16, "heads": 2, "ffn": 32, "seq_len": 8, "rng_mode": "keyed"}
        rates = dict.fromkeys(("attention_dropout", "hidden_dropout", "embedding_dropout"), 0.0)
        TinyGPT(GPTConfig(**sizes, **rates)).loss(tokens, tokens).backward()
        with pytest.raises(MissingBatchPositionError, match="batch_position"):
            TinyGPT(GPTConfig(**sizes)).loss(tokens, tokens)
    finally:
        destroy_model_parallel()


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


def _scaled_site(how: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``block(x) * weight``, where ``block``'s keyed site reads the batch position inside the
    checkpointed function (as ``checkpoint_wrapper(block, checkpoint_fn=rng_tracker.checkpoint)``
    runs it); ``how``: not checkpointed, or which checkpoint."""

    def block(x: torch.Tensor) -> torch.Tensor:
        dropped = site_dropout("wrapped.site", x * 2, _P, rng_mode="keyed", batch_dim=0)
        return dropped * dropped  # saves the mask's output: a recompute redraws it

    def run(x: torch.Tensor) -> torch.Tensor:
        if how == "none":
            return block(x) * weight
        if how == "without_output":
            manager = CheckpointWithoutOutput()
            out = manager.checkpoint(block, x)
            scaled = out * weight  # weight's gradient reads out: refilled by the recompute
            manager.discard_output_and_register_recompute(scaled)
            return scaled
        if how == "torch_with_rng_context_fn":
            out = torch_checkpoint(block, x, use_reentrant=False, context_fn=rng_context_fn())
            return out * weight
        reentrant, preserve = how.startswith("reentrant"), not how.endswith("_no_preserve")
        out = checkpoint(block, x, use_reentrant=reentrant, preserve_rng_state=preserve)
        return out * weight

    return run


@pytest.mark.parametrize(
    "how",
    [
        "non_reentrant",
        "reentrant",
        "non_reentrant_no_preserve",
        "reentrant_no_preserve",
        "without_output",
        "torch_with_rng_context_fn",
    ],
)
def test_a_recompute_draws_at_its_forwards_batch_position(keyed: KeyedRNG, how: str) -> None:
    """A site inside a checkpointed function reads the batch position in the recompute too,
    which runs after batch_position was left (a pipeline schedule: after later microbatches
    entered theirs): the checkpoint carries its forward's position (with or without
    preserve_rng_state, which keyed sites do not need), so the gradients equal the run without
    a checkpoint, bitwise."""
    keyed.manual_seed(21)
    grads = {}
    for mode in ("none", how):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
        weight = torch.linspace(1, 2, 64).view(4, 16).requires_grad_()
        with batch_position(4, 8):
            out = _scaled_site(mode, weight)(x)
        with batch_position(0, 8):  # the next microbatch's forward, before this backward
            out.sum().backward()
        grads[mode] = (x.grad, weight.grad)
    for want, got in zip(grads["none"], grads[how], strict=True):
        assert torch.equal(want, got)


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> KeyedRNG:
    """A fresh, unseeded keyed RNG as the process's CPU one, for this test alone."""
    rng = KeyedRNG("cpu")
    monkeypatch.setitem(_keyed._KEYED_RNGS, torch.device("cpu"), rng)
    return rng


def _states(rng: KeyedRNG) -> tuple:
    """Every state a site call may touch: the CPU generator, the tracker's streams, the keyed
    seed, step and sites."""
    streams = get_rng_tracker("cpu").get_states()
    return torch.get_rng_state(), streams, rng.seed, rng.step, rng.sites


def _assert_same(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys()
    for name, state in before[1].items():
        assert torch.equal(state, after[1][name]), name
    assert before[2:] == after[2:]


def _enter_batch_position(sample_offset: object, global_batch: object) -> None:
    with batch_position(sample_offset, global_batch):  # type: ignore[arg-type]
        pass


_X = torch.ones(2, 4, 8)  # (s, batch, hidden)
_BAD_INPUTS: list[tuple[str, Callable[[], object], type, type, str]] = [
    ("site=5", lambda: site_dropout(5, _X, 0.1, rng_mode="megatron"), KeyedTypeError,
     TypeError, "site must be a str"),
    ("site=''", lambda: site_dropout("", _X, 0.1, rng_mode="keyed"), SiteIdError, ValueError,
     "must not be empty"),
    ("x a list", lambda: site_dropout("s", [1.0], 0.1, rng_mode="keyed"), KernelInputTypeError,
     TypeError, "x must be a tensor"),
    ("p='0.1'", lambda: site_dropout("s", _X, "0.1", rng_mode="keyed"), KernelInputTypeError,
     TypeError, "p must be a float, got str"),
    ("p=None", lambda: site_dropout("s", _X, None, rng_mode="invariant"), KernelInputTypeError,
     TypeError, "p must be a float, got NoneType"),
    ("p=1.5", lambda: site_dropout("s", _X, 1.5, rng_mode="megatron"), KernelInputError,
     ValueError, r"must be in \[0, 1\], got 1.5"),
    ("batch_dim=1.0", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", batch_dim=1.0),
     ParallelConfigTypeError, TypeError, "batch_dim must be an int, got float"),
    ("batch_dim='1'", lambda: site_dropout("s", _X, 0.1, rng_mode="megatron", batch_dim="1"),
     ParallelConfigTypeError, TypeError, "batch_dim must be an int, got str"),
    ("sharded_dim=True", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", sharded_dim=True),
     ParallelConfigTypeError, TypeError, "sharded_dim must be an int, got the bool"),
    ("training='yes'", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", training="yes"),
     ArgumentTypeError, TypeError, "training must be a bool"),
    ("position=(0, 2)", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", position=(0, 2)),
     ParallelConfigTypeError, TypeError, "position must be a BatchPosition .*got tuple"),
    ("position past the batch",
     lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", position=BatchPosition(3, 6)),
     ParallelConfigError, ValueError, "4 samples at offset 3 does not fit a global batch of 6"),
    ("current_batch_position(-3)", lambda: current_batch_position(-3), ParallelConfigError,
     ValueError, "local_batch must be >= 0, got -3"),
    ("current_batch_position('2')", lambda: current_batch_position("2"),
     ParallelConfigTypeError, TypeError, "local_batch must be an int, got str"),
    ("batch_position(0.5, 4)", lambda: _enter_batch_position(0.5, 4), ParallelConfigTypeError,
     TypeError, "sample_offset must be an int, got float"),
    ("place_masks([1])", lambda: place_masks([1]), ArgumentTypeError, TypeError,
     "records must be MaskRecords .*got int"),
    ("place_masks(5)", lambda: place_masks(5), ArgumentTypeError, TypeError,
     "records must be an iterable of MaskRecords .*got int"),
    # a TP shard along the sample dim: keyed mode took the batch offset for the TP one, so both
    # TP ranks drew one mask (also through a negative alias of the same dim)
    ("sharded_dim == batch_dim",
     lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", sharded_dim=1, batch_dim=1),
     ParallelConfigError, ValueError, "sharded_dim=1 and batch_dim=1 are the same dim"),
    ("sharded_dim=-2, batch_dim=1",
     lambda: site_dropout("s", _X, 0.1, rng_mode="invariant", sharded_dim=-2, batch_dim=1),
     ParallelConfigError, ValueError, "sharded_dim=-2 and batch_dim=1 are the same dim"),
    ("batch_dim=None", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", batch_dim=None),
     ParallelConfigTypeError, TypeError, "batch_dim must be an int"),
    ("group='tp'", lambda: site_dropout("s", _X, 0.1, rng_mode="keyed", group="tp"),
     ParallelConfigTypeError, TypeError, "group must be a torch.distributed ProcessGroup"),
    ("copy_to_tp(x, 'tp')", lambda: copy_to_tp(_X, "tp"), ParallelConfigTypeError, TypeError,
     "group must be a torch.distributed ProcessGroup"),
    ("BatchPosition(-1, 2)", lambda: BatchPosition(-1, 2), ParallelConfigError, ValueError,
     "sample_offset must be >= 0"),
    ("BatchPosition(True, 4)", lambda: BatchPosition(True, 4), ParallelConfigTypeError,
     TypeError, "sample_offset must be an int"),
]  # fmt: skip


@pytest.mark.parametrize(
    "call, error, builtin, words",
    [case[1:] for case in _BAD_INPUTS],
    ids=[c[0] for c in _BAD_INPUTS],
)
def test_bad_inputs_are_typed_errors_that_change_no_state(
    keyed: KeyedRNG, call: Callable[[], object], error: type, builtin: type, words: str
) -> None:
    keyed.manual_seed(7)
    before = _states(keyed)
    with pytest.raises(error, match=words) as info:
        call()
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    _assert_same(before, _states(keyed))
    assert keyed.sites == {}


def test_a_refused_keyed_call_registers_no_site(keyed: KeyedRNG) -> None:
    """Every refusal of a keyed site's first call comes before the site registers: before
    manual_seed, a bad p, x, position, bias or residual; then a valid call registers it and
    draws the kernel's keyed mask."""
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    before = _states(keyed)
    with pytest.raises(KeyedUnseededError, match="no seed") as info:
        site_dropout("s", x, 0.1, rng_mode="keyed")
    assert isinstance(info.value, RuntimeError)
    _assert_same(before, _states(keyed))
    keyed.manual_seed(7)
    before = _states(keyed)
    for options, error, builtin, words in (
        ({"p": 1.5}, KernelInputError, ValueError, r"must be in \[0, 1\]"),
        ({"x": x.long()}, KernelInputError, ValueError, "x has dtype torch.int64"),
        ({"position": (0, 2)}, ParallelConfigTypeError, TypeError, "must be a BatchPosition"),
        ({"residual": x.double()}, KernelInputError, ValueError, "residual has dtype"),
        ({"residual": x[:1]}, KernelInputError, ValueError, "residual has shape"),
        ({"bias": torch.ones(3), "residual": x}, KernelInputError, ValueError, "bias must have"),
    ):
        call = {"x": x, "p": 0.1, **options}
        with pytest.raises(error, match=words) as info:
            site_dropout("s", call.pop("x"), call.pop("p"), rng_mode="keyed", **call)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
        _assert_same(before, _states(keyed))
    got = site_dropout("s", x, 0.1, rng_mode="keyed")
    assert keyed.sites == {"s": _keyed.site_id_of("s")}
    region = Region((2, 4, 8), (0, 0, 0))
    assert torch.equal(got, kernel_dropout(x, 0.1, shard=region, seed=keyed.seed_tensor("s")))
    fused = site_dropout("t", x, 0.1, rng_mode="keyed", bias=x[0, 0], residual=x)
    want = kernel_bias_dropout_add(x, x[0, 0], x, 0.1, shard=region, seed=keyed.seed_tensor("t"))
    assert torch.equal(fused, want)
