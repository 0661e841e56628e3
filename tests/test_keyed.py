"""Keyed randomness: site ids, steps, seeds and logical state dicts (rng_tracker._keyed), and
keyed dropout sites in TinyGPT that draw the same masks on every layout and under recompute."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from _python_probe import run_python
from gpt_training.corpus import Corpus
from torch.utils._python_dispatch import TorchDispatchMode

import rng_tracker._keyed as keyed_module
from rng_tracker import (
    KeyedRNG,
    RNGSnapshot,
    RNGStatesTracker,
    RNGTrackerError,
    get_keyed_rng,
    kernels,
)
from rng_tracker._device_rng import DeviceRNG
from rng_tracker._keyed import STEP_LIMIT, _philox_key, site_id_of
from rng_tracker.errors import (
    InvalidSeedError,
    InvalidSeedTypeError,
    KeyedTypeError,
    KeyedUnseededError,
    ParallelConfigError,
    SiteCollisionError,
    SiteIdError,
    StateDictError,
    StateDictTypeError,
    StepRangeError,
    TrackerDeviceError,
    UnknownSiteError,
)
from rng_tracker.kernels import _rng_source
from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
from rng_tracker.parallel.sites import batch_position, place_masks, record_masks
from rng_tracker.parallel.testing import run_distributed
from rng_tracker.parallel.transformer import GPTConfig, TinyGPT

# Two names whose BLAKE2b-derived 32-bit ids collide (found by a birthday search; the test
# below first checks that they really do).
COLLIDING = ("layer.41911.attention", "layer.69264.attention")


def _snapshot(rng: KeyedRNG) -> tuple:
    """Everything observable of a keyed RNG, to check that a failed call changed nothing."""
    words = {n: rng.seed_tensor(n).tolist() for n in rng.sites} if rng.seed is not None else {}
    return rng.seed, rng.step, rng.sites, words


def _seeded(*names: str, seed: int = 1234) -> KeyedRNG:
    rng = KeyedRNG("cpu", seed=seed)
    for name in names:
        rng.register(name)
    return rng


# -- site ids ------------------------------------------------------------------------------
def test_site_ids_are_stable_nonzero_and_registration_is_idempotent():
    """A site's id is a pure function of its name (BLAKE2b), never 0 (reserved for
    generator-driven draws), and registering the same name again returns the same id."""
    rng = KeyedRNG("cpu")
    first = rng.register("layer.3.attention")
    assert first == site_id_of("layer.3.attention") == rng.register("layer.3.attention")
    digest = hashlib.blake2b(b"layer.3.attention", digest_size=4, person=b"rng_tracker.site")
    assert first == int.from_bytes(digest.digest(), "little") % (2**32 - 1) + 1  # docs/keyed.md
    assert 1 <= first < 2**32
    assert KeyedRNG("cpu").register("layer.3.attention") == first
    assert rng.register("layer.4.attention") != first
    assert rng.sites == {
        "layer.3.attention": first,
        "layer.4.attention": site_id_of("layer.4.attention"),
    }
    # membership asks the table itself: registered names only, and no error for a non-str
    assert "layer.3.attention" in rng and "layer.4.attention" in rng
    assert "layer.5.attention" not in rng and 5 not in rng and ["x"] not in rng


def test_colliding_site_names_are_refused_and_an_explicit_id_resolves_them():
    """Two names whose hashed ids collide: the second registration raises SiteCollisionError
    naming both and registers nothing; an explicit unused site_id= resolves it."""
    a, b = COLLIDING
    assert site_id_of(a) == site_id_of(b)
    rng = _seeded(a)
    before = _snapshot(rng)
    with pytest.raises(SiteCollisionError, match="both map to id") as info:
        rng.register(b)
    assert a in str(info.value) and b in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RNGTrackerError)
    assert _snapshot(rng) == before
    assert rng.register(b, site_id=7) == 7
    assert rng.site_id(b) == 7


def test_explicit_site_ids_collide_and_names_cannot_change_their_id():
    rng = _seeded()
    rng.register("a", site_id=5)
    with pytest.raises(SiteCollisionError):
        rng.register("b", site_id=5)
    with pytest.raises(SiteCollisionError, match="cannot change"):
        rng.register("a", site_id=6)
    assert rng.register("a") == 5  # re-registering without an id keeps the id it has
    assert rng.sites == {"a": 5}


@pytest.mark.parametrize(
    ("name", "site_id", "error"),
    [
        (3, None, KeyedTypeError),
        ("", None, SiteIdError),
        ("x", 0, SiteIdError),
        ("x", 2**32, SiteIdError),
        ("x", -1, SiteIdError),
        ("x", True, KeyedTypeError),
        ("x", 1.0, KeyedTypeError),
        ("kept", 1.0, KeyedTypeError),  # checked before the re-registration shortcut
        ("x", torch.tensor(True), KeyedTypeError),
    ],
)
def test_bad_site_names_and_ids_are_typed_errors(name, site_id, error):
    rng = _seeded("kept")
    before = _snapshot(rng)
    with pytest.raises(error):
        rng.register(name, site_id=site_id)
    assert _snapshot(rng) == before


def test_unknown_sites_and_unseeded_use_are_typed_errors():
    rng = KeyedRNG("cpu")
    rng.register("a")
    with pytest.raises(KeyedUnseededError, match="manual_seed"):
        rng.seed_tensor("a")
    rng.manual_seed(1)
    with pytest.raises(UnknownSiteError, match="register") as info:
        rng.seed_tensor("b")
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownSiteError):
        rng.site_id("b")


@pytest.mark.parametrize("name", [["a"], {}, ("a",), 7, None, b"a"])
def test_site_names_that_are_not_str_are_keyed_type_errors(name):
    """site_id(['a']) and seed_tensor({}) raised a bare 'unhashable type' TypeError."""
    rng = _seeded("a")
    before = _snapshot(rng)
    for call in (lambda: rng.site_id(name), lambda: rng.seed_tensor(name)):
        with pytest.raises(KeyedTypeError, match="a keyed site name must be a str, got") as info:
            call()
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, TypeError)
        assert "registered under" in str(info.value)
    assert _snapshot(rng) == before


@pytest.mark.parametrize("index", [-1, 2**70])
def test_a_keyed_rng_of_a_bad_device_index_is_a_typed_error(index):
    """KeyedRNG(-1) and get_keyed_rng(-1) raised torch's bare RuntimeError."""
    registered = set(keyed_module._KEYED_RNGS)
    for call in (lambda: KeyedRNG(index), lambda: get_keyed_rng(index)):
        with pytest.raises(TrackerDeviceError, match="device index must be in") as info:
            call()
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    assert set(keyed_module._KEYED_RNGS) == registered


# -- the words, steps and seeds ----------------------------------------------------------
def test_seed_tensor_words_are_key_zero_site_step_and_do_not_alias_the_step():
    """seed_tensor = [key(seed), 0, site id, step]; advancing later does not change a tensor
    already handed out (the backward of a call regenerates that call's mask)."""
    rng = _seeded("a", seed=99)
    rng.set_step(41)
    words = rng.seed_tensor("a")
    key = _philox_key(99)
    assert words.dtype == torch.int64 and words.shape == (4,)
    assert words.tolist() == [key - 2**64 if key >= 2**63 else key, 0, site_id_of("a"), 41]
    rng.advance()
    assert words[3] == 41 and rng.seed_tensor("a")[3] == 42 and rng.step == 42
    rng.step_tensor.add_(3)  # the device tensor is the step (how a captured graph advances it)
    assert rng.step == 45 and rng.seed_tensor("a")[3] == 45


def test_distinct_site_step_pairs_never_share_counter_words():
    """The counter words (site id, step) of distinct (site, step) pairs are distinct, so no
    two keyed draws of one seed share a Philox counter; and the site word is never 0, so
    none shares one with a generator-driven call (whose words 2, 3 are 0)."""
    names = [f"layer.{i}.{s}" for i in range(64) for s in ("attention", "attention_out", "mlp_out")]
    rng = _seeded(*names, "embedding")
    seen = set()
    for step in (0, 1, 2, STEP_LIMIT - 1):
        rng.set_step(step)
        for name in rng.sites:
            words = tuple(rng.seed_tensor(name)[2:].tolist())
            assert words[0] != 0
            seen.add(words)
    assert len(seen) == 4 * len(rng.sites)


def test_keys_are_a_bijection_of_seeds_and_differ_from_the_seed():
    seeds = sorted({0, 1, 2**32, 2**63, 2**64 - 1, *range(2, 2000)})
    keys = [_philox_key(s) for s in seeds]
    assert len(set(keys)) == len(seeds)
    assert all(0 <= k < 2**64 and k != s for k, s in zip(keys, seeds, strict=True))


@pytest.mark.parametrize(
    ("start", "call", "error"),
    [
        (5, lambda r: r.set_step(STEP_LIMIT), StepRangeError),
        (5, lambda r: r.set_step(-1), StepRangeError),
        (5, lambda r: r.set_step(True), KeyedTypeError),
        (5, lambda r: r.set_step(2.0), KeyedTypeError),
        (5, lambda r: r.set_step(torch.tensor(True)), KeyedTypeError),
        (5, lambda r: r.advance(torch.tensor(True)), KeyedTypeError),
        (5, lambda r: r.advance(-1), StepRangeError),
        (STEP_LIMIT - 1, lambda r: r.advance(), StepRangeError),
        (5, lambda r: r.manual_seed(-1), InvalidSeedError),
        (5, lambda r: r.manual_seed(2**64), InvalidSeedError),
        (5, lambda r: r.manual_seed(1.5), InvalidSeedTypeError),
        (5, lambda r: r.manual_seed(False), InvalidSeedTypeError),
    ],
)
def test_steps_and_seeds_out_of_range_are_typed_errors(start, call, error):
    """Out-of-range or mistyped steps and seeds raise their typed error and change nothing
    (a step past 2**32 would wrap the counter word and repeat an earlier step's masks)."""
    rng = _seeded("a")
    rng.set_step(start)
    before = _snapshot(rng)
    with pytest.raises(error) as info:
        call(rng)
    assert isinstance(info.value, RNGTrackerError)
    assert _snapshot(rng) == before


def test_manual_seed_restarts_at_step_zero_and_keyed_rngs_are_per_device():
    rng = _seeded("a", seed=3)
    rng.advance(10)
    rng.manual_seed(3)
    assert rng.step == 0 and rng.seed == 3
    assert get_keyed_rng("cpu") is get_keyed_rng(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_keyed_words_and_step_advance_inside_a_captured_cuda_graph():
    """The seed words and the step are device tensors: a captured graph that reads the words
    and advances the step does both on every replay, with no host involvement."""
    rng = KeyedRNG("cuda", seed=5)
    rng.register("a")
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        out.copy_(rng.seed_tensor("a"))
        rng.advance()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(rng.seed_tensor("a"))
        rng.advance()
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert out[3].item() == 1 + replay and out[2].item() == site_id_of("a")
    assert rng.step == 4


# -- state dicts ---------------------------------------------------------------------------
def test_state_dict_is_logical_and_round_trips():
    """state_dict is {version, seed, step, sites} only (no device or rank), and loading it
    into a fresh RNG gives the same words for every site."""
    rng = _seeded("layer.0.attention", "embedding", seed=2**64 - 1)
    rng.advance(17)
    state = rng.state_dict()
    assert state == {
        "version": 1,
        "seed": 2**64 - 1,
        "step": 17,
        "sites": {
            "embedding": site_id_of("embedding"),
            "layer.0.attention": site_id_of("layer.0.attention"),
        },
    }
    fresh = KeyedRNG("cpu")
    fresh.load_state_dict(state)
    assert fresh.sites == rng.sites and fresh.step == 17 and fresh.seed == rng.seed
    for name in rng.sites:
        assert torch.equal(fresh.seed_tensor(name), rng.seed_tensor(name))


def _bad_states() -> list[tuple[object, type]]:
    good = _seeded("a", "b", seed=7).state_dict()
    a, b = COLLIDING
    return [
        ([1, 2], StateDictError),
        ({**good, "version": 2}, StateDictError),
        ({**good, "version": True}, StateDictError),
        ({**good, "version": 1.0}, StateDictTypeError),  # 1.0 == 1 was loaded
        ({k: v for k, v in good.items() if k != "step"}, StateDictError),
        ({**good, "extra": 1}, StateDictError),
        ({**good, "step": STEP_LIMIT}, StepRangeError),
        ({**good, "step": "3"}, KeyedTypeError),
        ({**good, "seed": -5}, InvalidSeedError),
        ({**good, "seed": 2**64}, InvalidSeedError),
        ({**good, "sites": ["a"]}, StateDictError),
        ({**good, "sites": {"a": 0}}, SiteIdError),
        ({**good, "sites": {"a": 9, "b": 9}}, SiteCollisionError),
        ({**good, "sites": {"registered": 11}}, SiteCollisionError),  # another id than here
        ({**good, "sites": {"other": site_id_of("registered")}}, SiteCollisionError),
        (
            {**good, "sites": {**good["sites"], b: site_id_of(a), a: site_id_of(a)}},
            SiteCollisionError,
        ),
    ]


@pytest.mark.parametrize("index", range(len(_bad_states())))
def test_bad_state_dicts_are_refused_and_nothing_is_half_loaded(index):
    """Each malformed or conflicting state dict raises a typed error, and seed, step and
    sites stay exactly as before (validation runs to the end before anything is applied)."""
    state, error = _bad_states()[index]
    rng = _seeded("registered", seed=11)
    rng.advance(3)
    before = _snapshot(rng)
    with pytest.raises(error) as info:
        rng.load_state_dict(state)
    assert isinstance(info.value, RNGTrackerError)
    assert _snapshot(rng) == before


def test_loading_merges_sites_and_keeps_the_ones_registered_here():
    rng = _seeded("here", seed=1)
    rng.load_state_dict(_seeded("there", seed=2).state_dict())
    assert set(rng.sites) == {"here", "there"} and rng.seed == 2 and rng.step == 0


def test_no_generator_is_touched_by_keyed_calls():
    """Registering, seeding, stepping and drawing seed words leaves the CPU generator as it
    was: keyed randomness is stateless on the host."""
    before = torch.get_rng_state()
    rng = _seeded("a", "b")
    for _ in range(3):
        rng.seed_tensor("a"), rng.seed_tensor("b")
        rng.advance()
    rng.load_state_dict(rng.state_dict())
    assert torch.equal(torch.get_rng_state(), before)


# -- keyed sites in TinyGPT ----------------------------------------------------------------
SMALL = GPTConfig(hidden=32, heads=4, ffn=64, seq_len=16, layers=2, rng_mode="keyed")
GLOBAL_BATCH = 4


def _tokens() -> torch.Tensor:
    return Corpus(vocab=SMALL.vocab).global_batch(0, batch=GLOBAL_BATCH, seq_len=SMALL.seq_len)


def _keyed_model(recompute: str = "none", *, seed: int = 1234, group=None, **kw) -> TinyGPT:
    get_keyed_rng("cpu").manual_seed(seed)
    return TinyGPT(replace(SMALL, recompute=recompute, **kw), group=group)


def _microbatched_masks(model: TinyGPT, order: list[int], size: int) -> dict[str, torch.Tensor]:
    inputs, targets = _tokens()
    with record_masks() as records:
        for index in order:
            rows = slice(index * size, (index + 1) * size)
            with batch_position(index * size, GLOBAL_BATCH):
                model.loss(inputs[rows], targets[rows]).backward()
    return place_masks(records)


def test_keyed_masks_do_not_depend_on_microbatches_or_their_order():
    """The whole batch in one forward, 2 microbatches, and 4 microbatches run in a shuffled
    order draw bitwise-identical logical masks at every site (each sample's mask depends on
    its place in the global batch, not on which call computed it); every element is covered.
    Another step draws other masks, and no two sites share a mask."""
    model = _keyed_model()
    whole = _microbatched_masks(model, [0], GLOBAL_BATCH)
    assert list(whole) == list(model.sites)
    for order, size in (([0, 1], 2), ([2, 0, 3, 1], 1)):
        split = _microbatched_masks(model, order, size)
        assert list(split) == list(whole)
        for site, mask in whole.items():
            assert bool((mask >= 0).all()) and torch.equal(split[site], mask), (order, site)
    masks = list(whole.values())
    assert not torch.equal(masks[1], masks[4])  # layer.0.attention vs layer.1.attention
    get_keyed_rng("cpu").advance()
    later = _microbatched_masks(model, [0], GLOBAL_BATCH)
    assert all(not torch.equal(later[site], whole[site]) for site in whole)


class _SeededOps(TorchDispatchMode):
    """Counts ops tagged nondeterministic_seeded (every op that draws from a generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _count_rng_access(monkeypatch) -> list[str]:
    """Wrap every way this library and torch's checkpoint read or write a generator or a
    tracker stream, recording each call's name."""
    calls: list[str] = []

    def counted(name, original):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return wrapper

    capture = RNGSnapshot.capture
    monkeypatch.setattr(
        RNGSnapshot,
        "capture",
        classmethod(lambda cls, *a, **k: (calls.append("capture"), capture(*a, **k))[1]),
    )
    fork_rng = torch.random.fork_rng

    def counted_fork_rng(devices=None, enabled=True, *args, **kwargs):
        if enabled:  # torch's checkpoint enters fork_rng(enabled=False), which touches nothing
            calls.append("fork_rng")
        return fork_rng(devices, enabled, *args, **kwargs)

    monkeypatch.setattr(torch.random, "fork_rng", counted_fork_rng)
    for owner, names in (
        (DeviceRNG, ("snapshot", "install", "live", "fresh", "swap_in", "swap_out")),
        (RNGStatesTracker, ("_enter", "_exit", "get_states", "set_states")),
        (torch, ("get_rng_state", "set_rng_state")),
        (torch.random, ("get_rng_state", "set_rng_state")),
        (torch.utils.checkpoint, ("get_device_states", "set_device_states")),
        (_rng_source, ("_drawn",)),  # where every kernel call draws from a generator
    ):
        for name in names:
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, counted(name, getattr(owner, name)))
    return calls


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_keyed_recompute_draws_the_forward_masks_without_touching_any_generator(
    recompute, monkeypatch
):
    """Under full and selective recompute, keyed sites recompute exactly the forward's masks
    (recorded per call, compared bitwise) and the gradients equal the no-recompute run's
    bitwise, while not one generator state or tracker stream is read or written and no
    seeded-random op runs - even with the CPU generator reseeded between forward and
    backward. The same counters see the snapshots of invariant mode (they are not blind)."""
    inputs, targets = _tokens()
    reference = _keyed_model()
    reference.loss(inputs, targets).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}

    model = _keyed_model(recompute)
    calls = _count_rng_access(monkeypatch)
    with _SeededOps() as seeded, record_masks() as records:
        loss = model.loss(inputs, targets)
        forward = {r.site: r for r in records}
        torch.manual_seed(999)  # a recompute that replayed a generator would now diverge
        calls.clear()
        loss.backward()
    recomputed = records[len(forward) :]
    assert calls == [] and seeded.ops == []
    sites = {"full": 3, "selective": 1}[recompute] * SMALL.layers
    assert len(recomputed) == sites
    for record in recomputed:
        first = forward[record.site]
        assert record.region == first.region and torch.equal(record.mask, first.mask), record.site
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name

    control = TinyGPT(replace(SMALL, rng_mode="invariant", recompute=recompute))
    with _SeededOps() as seeded:
        control.loss(inputs, targets).backward()
    assert calls and seeded.ops  # the counters do see generator use


def test_batch_position_is_checked():
    model = _keyed_model()
    inputs, targets = _tokens()
    with pytest.raises(ParallelConfigError, match="does not fit"), batch_position(3, GLOBAL_BATCH):
        model.loss(inputs[:2], targets[:2])
    for args in ((-1, 4), (4, 4), (0, 0), (True, 4), (0, 2.0)):
        with pytest.raises(ParallelConfigError), batch_position(*args):
            pass


def _layouts_on_two_ranks() -> dict:
    """On 2 ranks: TP=2 with SP over the whole batch, and DP=2 (each rank half the batch at
    its offset); every rank also runs TP=1 on the whole batch as the reference."""
    rank = dist.get_rank()
    inputs, targets = _tokens()

    def gathered(model: TinyGPT, rows: slice, offset: int) -> dict[str, torch.Tensor]:
        with record_masks() as records, batch_position(offset, GLOBAL_BATCH):
            model.loss(inputs[rows], targets[rows]).backward()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(records))
        return place_masks(r for rank_records in everyone for r in rank_records)

    state = init_model_parallel(tensor=2)
    tp_sp = gathered(_keyed_model(sequence_parallel=True, group=state.group("tp")), slice(None), 0)
    destroy_model_parallel()
    half = GLOBAL_BATCH // 2
    dp = gathered(_keyed_model(), slice(rank * half, (rank + 1) * half), rank * half)
    with record_masks() as records:
        _keyed_model().loss(inputs, targets).backward()
    return {"reference": place_masks(records), "tp2+sp": tp_sp, "dp2": dp}


def test_keyed_masks_are_equal_across_tp_sp_and_dp_ranks():
    """Gathered per sample from both ranks, TP=2 with sequence parallelism and DP=2 draw
    bitwise the TP=1 whole-batch masks at every site (every element covered)."""
    for result in run_distributed(_layouts_on_two_ranks, world_size=2, timeout=180):
        reference = result["reference"]
        for layout in ("tp2+sp", "dp2"):
            assert list(result[layout]) == list(reference), layout
            for site, mask in reference.items():
                got = result[layout][site]
                assert bool((got >= 0).all()) and torch.equal(got, mask), (layout, site)


def test_a_site_name_utf8_cannot_encode_is_refused_typed_when_registered_and_loaded():
    """A lone surrogate raised a bare UnicodeEncodeError from register, and load_state_dict
    accepted the same name (its id then failed later)."""
    from rng_tracker import KeyedRNG
    from rng_tracker.errors import RNGTrackerError, SiteIdError

    rng = KeyedRNG("cpu", seed=1)
    with pytest.raises(SiteIdError, match="UTF-8 can encode") as info:
        rng.register("\ud800")
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
    with pytest.raises(SiteIdError, match="UTF-8 can encode"):
        rng.load_state_dict({"version": 1, "seed": 5, "step": 3, "sites": {"\ud800": 7}})
    assert rng.seed == 1 and rng.sites == {}
    assert rng.register("é-site") > 0  # any text UTF-8 encodes is a name


def test_sites_met_first_on_the_meta_device_or_under_fake_tensors_register_real_words(
    monkeypatch: pytest.MonkeyPatch,
):
    """A model built under ``torch.device("meta")`` (deferred init) or FakeTensorMode (a memory
    estimate) registers its keyed sites there: each site's words are real CPU tensors (a meta
    build failed half-registered, a fake one stored fake words that broke every later real
    call); under fake tensors a keyed dropout is shape-only; later real calls draw the keyed
    masks."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from rng_tracker.parallel.sites import site_dropout

    rng = KeyedRNG("cpu", seed=3)  # the process's, for this test alone
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    with torch.device("meta"):
        rng.register("test.meta_site")
    with FakeTensorMode():
        rng.register("test.fake_site")
        shaped = site_dropout("test.fake_site", torch.empty(2, 4, 8), 0.5, rng_mode="keyed")
    assert isinstance(shaped, FakeTensor) and shaped.shape == (2, 4, 8)
    x = torch.ones(2, 4, 8)
    for name in ("test.meta_site", "test.fake_site"):
        seed = rng.seed_tensor(name)
        assert type(seed) is torch.Tensor and seed.device.type == "cpu"
        assert seed.tolist() == [rng.seed_tensor(name).tolist()[0], 0, site_id_of(name), 0]
        got = site_dropout(name, x, 0.5, rng_mode="keyed")
        assert torch.equal(got, kernels.dropout(x, 0.5, seed=seed))


class _KeyedBlock(torch.nn.Module):
    """Two keyed sites: a dropout and a fused bias-dropout-add."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rng_tracker.parallel.sites import site_dropout

        h = site_dropout("test.export.a", self.linear(x), 0.5, rng_mode="keyed", batch_dim=0)
        return site_dropout(
            "test.export.b", h, 0.25, rng_mode="keyed", batch_dim=0,
            bias=self.linear.bias, residual=x,
        )  # fmt: skip


@pytest.mark.parametrize("strict", [False, True])
def test_a_saved_and_loaded_export_reads_the_keyed_step_and_seed_when_it_runs(
    strict: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """An exported keyed site reads (seed, step) from get_keyed_rng(device) each time the
    program runs (the op ``rng_tracker::keyed_seed``), as torch's exported dropout reads its
    generator: saved and loaded, it equals eager bitwise at every step and after a reseed (the
    export failed; baked words would give the export's step forever). Both modes meet the sites
    first in the export and register them there."""
    rng = KeyedRNG("cpu", seed=7)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    torch.manual_seed(0)
    model, x = _KeyedBlock(), torch.randn(4, 8)
    program = torch.export.export(model, (x,), strict=strict)
    assert "test.export.a" in rng and "test.export.b" in rng
    ops = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert ops.count(torch.ops.rng_tracker.keyed_seed.default) == 2
    torch.export.save(program, tmp_path / "keyed.pt2")
    loaded = torch.export.load(tmp_path / "keyed.pt2").module()
    outs = []
    for seed, step in ((7, 0), (7, 1), (7, 5), (9, 1)):
        rng.manual_seed(seed)
        rng.set_step(step)
        want = model(x)
        got = loaded(x)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (seed, step)
        outs.append(got)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[3])


def test_exported_keyed_words_refuse_a_hand_made_rng_and_an_unseeded_process(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """The program reads get_keyed_rng(device), so words of another KeyedRNG are refused at
    export (the program would read another state), and a run with no seed is a typed error."""
    from rng_tracker.errors import KeyedExportError

    own = KeyedRNG("cpu", seed=7)
    own.register("test.export.own")

    class Own(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return kernels.dropout(x, 0.5, seed=own.seed_tensor("test.export.own"))

    with pytest.raises(KeyedExportError, match="get_keyed_rng") as caught:
        torch.export.export(Own(), (torch.randn(4, 8),), strict=False)
    assert isinstance(caught.value, RuntimeError)

    rng = KeyedRNG("cpu", seed=7)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    x = torch.randn(4, 8)
    program = torch.export.export(_KeyedBlock(), (x,), strict=False).module()
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), KeyedRNG("cpu"))
    with pytest.raises(KeyedUnseededError, match="manual_seed"):
        program(x)


def test_exporting_keyed_words_before_the_kernels_are_imported_says_to_import_them():
    """The op is registered with the kernels' ones; the core never imports the kernels."""
    probe = (
        "import torch, rng_tracker\n"
        "from rng_tracker.errors import KeyedExportError\n"
        "rng = rng_tracker.get_keyed_rng('cpu'); rng.manual_seed(1); rng.register('s')\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x): return x + rng.seed_tensor('s')\n"
        "try:\n"
        "    torch.export.export(M(), (torch.zeros(4, dtype=torch.int64),), strict=False)\n"
        "except KeyedExportError as error:\n"
        "    print('refused:', error)\n"
    )
    out = run_python(probe)
    assert "refused:" in out and "import rng_tracker.kernels" in out


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (None, "a keyed state dict must be a mapping, got NoneType"),
        ([1, 2], "a keyed state dict must be a mapping, got list"),
        ("a str", "got str"),
        ("<sites as a list>", "'sites' must map names to ids, got list"),
        ("<version True>", "keyed state dict version True is not the supported version 1"),
    ],
)
def test_a_keyed_state_dict_of_the_wrong_type_is_a_type_error(state, match):
    """load_state_dict(None), a list, 'sites' as a list or a bool version raised StateDictError,
    a ValueError only, where the tracker's load_state_dict raises StateDictTypeError."""
    from rng_tracker.errors import StateDictTypeError

    good = _seeded("a", seed=7).state_dict()
    made = {
        "<sites as a list>": {**good, "sites": ["a"]},
        "<version True>": {**good, "version": True},
    }
    state = made.get(state, state) if isinstance(state, str) else state
    rng = _seeded("registered", seed=11)
    rng.advance(3)
    before, cpu = _snapshot(rng), torch.get_rng_state()
    with pytest.raises(StateDictTypeError, match=match) as info:
        rng.load_state_dict(state)
    assert isinstance(info.value, StateDictError) and isinstance(info.value, TypeError)
    assert isinstance(info.value, RNGTrackerError)
    assert _snapshot(rng) == before and rng.state_dict()["step"] == 3
    assert torch.equal(torch.get_rng_state(), cpu)
