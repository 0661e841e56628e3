"""Keyed randomness: site ids, steps, seeds and logical state dicts (rng_tracker.keyed), and
keyed dropout sites in TinyGPT that draw the same masks on every layout and under recompute."""

from __future__ import annotations

import pytest
import torch

from rng_tracker import (
    InvalidSeedError,
    InvalidSeedTypeError,
    KeyedRNG,
    KeyedTypeError,
    KeyedUnseededError,
    RNGTrackerError,
    SiteCollisionError,
    SiteIdError,
    StateDictError,
    StepRangeError,
    UnknownSiteError,
    get_keyed_rng,
)
from rng_tracker.keyed import STEP_LIMIT, _philox_key, site_id_of

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
    assert 1 <= first < 2**32
    assert KeyedRNG("cpu").register("layer.3.attention") == first
    assert rng.register("layer.4.attention") != first
    assert rng.sites == {
        "layer.3.attention": first,
        "layer.4.attention": rng.sites["layer.4.attention"],
    }


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
