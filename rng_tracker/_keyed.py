"""Keyed randomness: masks that are a pure function of (seed, step, site, global index).

A keyed site draws nothing from a generator. Its Philox key is derived from the seed
alone, and the counter of logical element g is (lo32(g // 4), hi32(g // 4), site id,
step), so a site's mask depends on neither the parallel layout, the microbatch count,
the schedule nor recompute, and the whole RNG state of a run is (seed, step, sites):
it reshards to any layout. See docs/keyed.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from rng_tracker._bits import mix_key, signed64
from rng_tracker._device_rng import normalize_device
from rng_tracker._torch_private import (
    active_fake_mode,
    disable_current_dispatch_modes,
    run_while_tracing,
)
from rng_tracker._tracker import validate_seed
from rng_tracker._validate import checked_int
from rng_tracker.errors import (
    KeyedExportError,
    KeyedTypeError,
    KeyedUnseededError,
    SiteCollisionError,
    SiteIdError,
    StateDictError,
    StateDictTypeError,
    StepRangeError,
    UnknownSiteError,
)

STEP_LIMIT = 2**32  # the step is Philox counter word 3
_SITE_LIMIT = 2**32  # the site id is counter word 2; 0 is left to generator-driven calls
_STATE_DICT_VERSION = 1
_STATE_KEYS = frozenset({"version", "seed", "step", "sites"})
# Mixed into the seed so a keyed key never equals the seed a torch generator was given.
_KEY_DOMAIN = 0x6B65796564524E47  # b"keyedRNG"


def _philox_key(seed: int) -> int:
    """The 64-bit Philox key of ``seed`` (a bijection, so distinct seeds never share a key)."""
    return mix_key(seed, _KEY_DOMAIN)


def site_id_of(name: str) -> int:
    """The default 32-bit id of a site name: BLAKE2b of its UTF-8 bytes, mapped into [1, 2**32)."""
    return _hashed_id(_check_name(name))


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise KeyedTypeError(f"a keyed site name must be a str, got {type(name).__name__}")
    if not name:
        raise SiteIdError("a keyed site name must not be empty; use a stable global name")
    if not name.isascii():
        try:
            name.encode("utf-8")  # a site's id is a hash of its UTF-8 bytes
        except UnicodeEncodeError as error:
            raise SiteIdError(
                f"a keyed site name must be text UTF-8 can encode; {name!r} is not ({error.reason} "
                f"at {error.start}); use a stable global name"
            ) from None
    return name


def _check_step(step: object) -> int:
    return checked_int(
        step,
        "step",
        type_error=KeyedTypeError,
        value_error=StepRangeError,
        minimum=0,
        maximum=STEP_LIMIT - 1,
        note=": it is one 32-bit Philox counter word",
    )


def _check_site_id(site_id: object) -> int:
    return checked_int(
        site_id,
        "site_id",
        type_error=KeyedTypeError,
        value_error=SiteIdError,
        minimum=1,
        maximum=_SITE_LIMIT - 1,
        note=" (0 is reserved for generator-driven draws)",
    )


class KeyedRNG:
    """The keyed randomness of one device: a seed, a step held in a device tensor, and named sites.

    ``seed_tensor(name)`` gives the 4 words [key, 0, site id, step] a fused dropout call
    takes as ``seed=``: element g of the site's logical tensor then uses the Philox
    counter (lo32(g // 4), hi32(g // 4), site id, step). Nothing is read from or written
    to any generator, so recompute needs no replay; the step lives on the device, so a
    captured CUDA graph can advance it in place.

    Args:
        device: the device the words live on; None means the current accelerator, else CPU.
        seed: the run's seed in [0, 2**64), the same on every rank; None leaves it unseeded.
    """

    def __init__(
        self, device: torch.device | str | int | None = None, *, seed: int | None = None
    ) -> None:
        self._device = normalize_device(device)
        self._words = torch.zeros(4, dtype=torch.int64, device=self._device)  # [key, 0, 0, step]
        self._seed: int | None = None
        self._host_step = 0  # mirrors the device step for range checks without a sync
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._site_words: dict[str, torch.Tensor] = {}  # name -> [0, 0, id, 0] on the device
        if seed is not None:
            self.manual_seed(seed)

    # -- inspection -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device whose tensors hold the step and the seed words."""
        return self._device

    @property
    def seed(self) -> int | None:
        """The run's seed, or None before :meth:`manual_seed`."""
        return self._seed

    @property
    def step(self) -> int:
        """The current step, read from the device tensor (a sync on an accelerator)."""
        self._host_step = int(self._words[3])
        return self._host_step

    @property
    def step_tensor(self) -> torch.Tensor:
        """The step as a 0-dim int64 view on the device; in-place writes move the step."""
        return self._words[3]

    @property
    def sites(self) -> dict[str, int]:
        """A copy of the registered sites: name -> 32-bit id."""
        return dict(self._ids)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a registered site (``name in rng``; no copy of the table)."""
        return isinstance(name, str) and name in self._ids

    def site_id(self, name: str) -> int:
        """The id of a registered site."""
        site = self._ids.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._unknown(name)
        return site

    def __repr__(self) -> str:
        return (
            f"KeyedRNG(device={self._device}, seed={self._seed}, step={self._host_step}, "
            f"sites={len(self._ids)})"
        )

    # -- configuration ----------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Set the seed and go back to step 0 (the state of a fresh run)."""
        seed = validate_seed(seed)
        key = signed64(_philox_key(seed))
        with disable_current_dispatch_modes():  # real words, under fake tensors or a trace too
            self._words.copy_(torch.tensor([key, 0, 0, 0], dtype=torch.int64, device="cpu"))
        self._seed, self._host_step = seed, 0

    def register(self, name: str, *, site_id: int | None = None) -> int:
        """Register a site under a stable global name; returns its id.

        Re-registering a name is a no-op. The id defaults to :func:`site_id_of` (name);
        pass ``site_id=`` to resolve a hash collision. Two names never share an id.
        """
        known = _current_site_id(self, name)
        if known is not None and (site_id is None or _check_site_id(site_id) == known):
            return known
        _check_name(name)
        wanted = _hashed_id(name) if site_id is None else _check_site_id(site_id)
        collision = _collision(self, name, known, wanted)
        if collision is not None:
            raise SiteCollisionError(collision)
        _add_site(self, name, wanted)
        return wanted

    def _add(self, name: str, site_id: int) -> None:
        # the words first (real, on this device, whatever mode or default device is active),
        # then the names: a failure registers nothing
        with disable_current_dispatch_modes():
            words = torch.tensor([0, 0, site_id, 0], dtype=torch.int64, device="cpu")
            self._site_words[name] = words.to(self._device)
        self._ids[name], self._names[site_id] = site_id, name

    def set_step(self, step: int) -> None:
        """Move to ``step`` (in [0, 2**32))."""
        step = _check_step(step)
        self._words[3].fill_(step)
        self._host_step = step

    def advance(self, steps: int = 1) -> None:
        """Advance the step by ``steps`` in place on the device (no host sync, capturable)."""
        steps = checked_int(steps, "steps", type_error=KeyedTypeError)
        if steps < 0 or self._host_step + steps >= STEP_LIMIT:
            raise StepRangeError(
                f"advancing step {self._host_step} by {steps} leaves [0, 2**32); "
                "a keyed step is one 32-bit Philox counter word"
            )
        self._words[3:].add_(steps)
        self._host_step += steps

    # -- drawing ----------------------------------------------------------------------
    def seed_tensor(self, name: str) -> torch.Tensor:
        """The 4 int64 words [key, 0, site id, step] of site ``name`` at the current step.

        A fresh tensor (one device add, no host sync): a later :meth:`advance` does not
        change it, so the backward of this step's call still regenerates this step's mask.
        Under ``torch.export`` the words come from the op ``rng_tracker::keyed_seed``, which
        reads the seed and step of ``get_keyed_rng(device)`` each time the program runs (a
        saved program follows the running process's :meth:`set_step`, as torch's dropout
        follows its generator), with the site's id fixed in the program.
        """
        # the table itself, not Dynamo's copy: a site registered while tracing is in it
        site = _current_site_id(self, name)
        if site is None:
            raise self._unknown(name)
        self._check_seeded()
        if torch.compiler.is_exporting():
            return self._words_read_when_run(name, site)
        if torch.compiler.is_dynamo_compiling():  # the step tensor a graph input, the id a constant
            return self._words + torch.tensor(
                [0, 0, site, 0], dtype=torch.int64, device=self._device
            )
        site_words = self._site_words[name]
        fake = active_fake_mode()
        if fake is not None:  # shape-only: the words as fake tensors of the mode
            return fake.from_tensor(self._words) + fake.from_tensor(site_words)
        return self._words + site_words  # (4,) int64 on the device

    def _check_seeded(self) -> None:
        if self._seed is None:
            raise KeyedUnseededError(
                "keyed randomness has no seed; call get_keyed_rng(device).manual_seed(seed) "
                "with the run's seed (the same on every rank) first"
            )

    def _words_read_when_run(self, name: str, site: int) -> torch.Tensor:
        if _KEYED_RNGS.get(self._device) is not self:
            raise KeyedExportError(
                f"torch.export met the seed words of site {name!r} of a KeyedRNG made by hand; an "
                "exported program reads get_keyed_rng(device) when it runs, so seed and use that "
                "one (or pass kernels.dropout a seed= tensor that is an input of the program)"
            )
        # rng_tracker.kernels registers the op with every other one; the words feed its kernels,
        # so whoever exports them has imported it (the core never imports the kernels)
        if not hasattr(torch.ops.rng_tracker, "keyed_seed"):
            raise KeyedExportError(
                "exporting keyed words needs the op rng_tracker::keyed_seed: import "
                "rng_tracker.kernels, which registers it, before torch.export"
            )
        return torch.ops.rng_tracker.keyed_seed(self._device, site)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The logical state {version, seed, step, sites}: equal on every rank of a run,
        so it reshards to any layout (and a deduplicating checkpointer keeps the right copy)."""
        step = self.step
        if not 0 <= step < STEP_LIMIT:
            raise StepRangeError(f"the device step {step} left [0, 2**32)")
        return {
            "version": _STATE_DICT_VERSION,
            "seed": self._seed,
            "step": step,
            "sites": dict(sorted(self._ids.items())),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; validates all of it before changing anything.

        Sites of the checkpoint are merged with those registered here; a name with
        another id, or an id held by another name, is a :class:`SiteCollisionError`.
        """
        if not isinstance(state_dict, Mapping):
            raise StateDictTypeError(
                f"a keyed state dict must be a mapping, got {type(state_dict).__name__}; pass "
                "what KeyedRNG.state_dict() returned"
            )
        if set(state_dict) != _STATE_KEYS:
            raise StateDictError(
                f"a keyed state dict has the keys {sorted(_STATE_KEYS)}, got {sorted(state_dict)}; "
                "was it written by KeyedRNG.state_dict()?"
            )
        version = state_dict["version"]
        if type(version) is not int or version != _STATE_DICT_VERSION:  # True, 1.0 == 1
            raise (StateDictTypeError if type(version) is not int else StateDictError)(
                f"keyed state dict version {state_dict['version']!r} is not the supported "
                f"version {_STATE_DICT_VERSION}"
            )
        seed = state_dict["seed"]
        seed = None if seed is None else validate_seed(seed)
        step = _check_step(state_dict["step"])
        sites = state_dict["sites"]
        if not isinstance(sites, Mapping):
            raise StateDictTypeError(
                f"'sites' must map names to ids, got {type(sites).__name__}; pass what "
                "KeyedRNG.state_dict() returned"
            )
        merged_ids, merged_names = dict(self._ids), dict(self._names)
        for name, site_id in sites.items():
            _check_name(name)
            site_id = _check_site_id(site_id)
            if merged_ids.get(name, site_id) != site_id:
                raise SiteCollisionError(
                    f"the checkpoint gives keyed site {name!r} id {site_id} but it is registered "
                    f"here with id {merged_ids[name]}"
                )
            if merged_names.get(site_id, name) != name:
                raise SiteCollisionError(
                    f"the checkpoint gives id {site_id} to {name!r} but {merged_names[site_id]!r} "
                    "holds it here"
                )
            merged_ids[name], merged_names[site_id] = site_id, name
        # Everything is valid: apply.
        if seed is None:
            self._words.zero_()
            self._seed = None
        else:
            self.manual_seed(seed)
        self.set_step(step)
        for name, site_id in merged_ids.items():
            if name not in self._ids:
                self._add(name, site_id)

    def _unknown(self, name: object) -> UnknownSiteError | KeyedTypeError:
        if not isinstance(name, str):
            return KeyedTypeError(
                f"a keyed site name must be a str, got {type(name).__name__}; pass the name "
                "the site was registered under"
            )
        return UnknownSiteError(
            f"no keyed site named {name!r}; register it first with register(name) "
            f"(registered: {sorted(self._ids)})"
        )


# The table is host state that Dynamo must not trace (a BLAKE2b hash, device tensors) nor guard
# (a site registered in the trace would fail the guards of its own frame): under torch.compile
# and strict export these run while tracing, on the table itself, and their results are
# constants of the graph. That holds for good: the table only grows, and a name never changes
# its id. They return what is wrong rather than raise, so the traced caller raises the typed
# error (Dynamo would report an error raised here as its own).
@run_while_tracing
def _current_site_id(rng: KeyedRNG, name: object) -> int | None:
    return rng._ids.get(name) if isinstance(name, str) else None


@run_while_tracing
def _hashed_id(name: str) -> int:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=4, person=b"rng_tracker.site")
    return int.from_bytes(digest.digest(), "little") % (_SITE_LIMIT - 1) + 1


@run_while_tracing
def _collision(rng: KeyedRNG, name: str, known: int | None, wanted: int) -> str | None:
    if known is not None:
        return (
            f"keyed site {name!r} already has id {known}; it cannot change to {wanted} "
            "(its masks would change)"
        )
    other = rng._names.get(wanted)
    if other is not None:
        return (
            f"keyed sites {other!r} and {name!r} both map to id {wanted}, so they would "
            "draw the same masks; rename one or pass an unused site_id="
        )
    return None


@run_while_tracing
def _add_site(rng: KeyedRNG, name: str, site_id: int) -> None:
    rng._add(name, site_id)


# Process-wide, not per thread: the keyed state is the run's (seed, step, sites), the same for
# every thread (an autograd worker's recompute draws the forward's masks from it).
_KEYED_RNGS: dict[torch.device, KeyedRNG] = {}


def current_site_words(device: torch.device, site_id: int) -> torch.Tensor:
    """[key, 0, site_id, step] of ``get_keyed_rng(device)`` now (what ``rng_tracker::keyed_seed``
    returns when an exported program runs): a new tensor on the device."""
    rng = get_keyed_rng(device)
    rng._check_seeded()
    words = rng._words.clone()
    words[2].fill_(_check_site_id(site_id))
    return words


def get_keyed_rng(device: torch.device | str | int | None = None) -> KeyedRNG:
    """The process's :class:`KeyedRNG` of ``device`` (created unseeded on first use)."""
    device = normalize_device(device)
    rng = _KEYED_RNGS.get(device)
    if rng is None:
        rng = _KEYED_RNGS[device] = KeyedRNG(device)
    return rng
