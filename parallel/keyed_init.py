"""Keyed init of a model's parameters: values a pure function of (seed, stable name, global index).

Each rank computes only its local shard with the compiled kernel of
``rng_tracker.kernels._keyed_fill``: no full-size buffer, work in proportion to the shard,
nothing drawn from any generator. So a parameter's full tensor is the same for any TP, FSDP
or PP layout (and on one device), whether it was built on the meta device and materialised
later, and whatever order the modules were built or initialised in: only the seed and the
parameter's name count. ``invariant_random(model)`` of :mod:`rng_tracker.parallel.invariant`
(keyed is its default init; without ``model=`` a tensor is named by its place among the block's
draws) routes ``nn.init`` and ``Tensor.uniform_``/``normal_`` here, and ``nn.init.trunc_normal_``
to one inverse-CDF draw per element (torch resamples out-of-range values in a data-dependent
loop); the values differ from torch's own draws (use ``init="full"`` for those). See
docs/dtensor.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from rng_tracker._torch_private import holds_no_data, storage_identity
from rng_tracker._tracker import validate_seed
from rng_tracker.errors import (
    InvariantRandomConfigError,
    InvariantRandomConfigTypeError,
    KernelInputTypeError,
)
from rng_tracker.kernels import _keyed_fill as _kernel
from rng_tracker.parallel._placement import holds_values, local_index_of

__all__ = [
    "KeyedInit",
    "keyed_normal_",
    "keyed_trunc_normal_",
    "keyed_uniform_",
    "stable_name",
]

# Wrapper modules that put a component into parameter names without changing the model.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def stable_name(fqn: str) -> str:
    """``fqn`` without the parts activation checkpointing, torch.compile and FSDP1 insert."""
    if not isinstance(fqn, str):
        raise KernelInputTypeError(
            f"fqn must be a str (a parameter's qualified name), got {type(fqn).__name__} {fqn!r}"
        )
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS)


FillKind = Literal["uniform", "normal", "trunc_normal"]


def check_keyed_fill(t: object, kind: FillKind, *params: object) -> tuple[float, ...]:
    """``params`` as floats, once checked: raise what filling ``t`` with ``kind`` of ``params``
    would refuse (the tensor, its dtype, the parameters as torch's op checks them), before a
    name is taken or anything written."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputTypeError(
            f"keyed init fills a tensor or a DTensor, got {type(t).__name__}"
        )
    return _kernel.check_fill(kind, t.dtype, t.dim(), params)


def _fill(t: torch.Tensor, kind: FillKind, *params: object, name: str, seed: int) -> None:
    _write(t, kind, check_keyed_fill(t, kind, *params), name, seed)


def _write(t: torch.Tensor, kind: FillKind, values: Sequence[float], name: str, seed: int) -> None:
    """:func:`_fill` of the floats :func:`check_keyed_fill` returned."""
    _kernel.name_hash(name)  # a bad name or seed raises here, on the meta device too
    _kernel.init_key(seed)
    if isinstance(t, DTensor):
        index = local_index_of(t)
        holds = holds_values(t)
        local = t.to_local()  # (local shape of t)
        indices: Sequence[Sequence[int]] | None = index.indices
        global_shape: Sequence[int] = tuple(t.shape)
    else:
        local, holds, indices, global_shape = t, True, None, tuple(t.shape)
    if holds_no_data(local):
        return  # meta or fake: values come when the tensor is materialised and initialised
    with torch.no_grad():
        if not holds:
            local.zero_()
            return
        target = local if local.device.type == "cpu" else torch.empty_like(local, device="cpu")
        _kernel.fill_checked(
            target, kind, values, seed=seed, name=name, global_shape=global_shape, indices=indices
        )
        if target is not local:
            local.copy_(target)


def keyed_uniform_(
    t: torch.Tensor, a: float = 0.0, b: float = 1.0, *, name: str, seed: int
) -> torch.Tensor:
    """Fill ``t`` (a plain tensor or a DTensor of any placements) from U[a, b), keyed by ``name``."""
    _fill(t, "uniform", a, b, name=name, seed=seed)
    return t


def keyed_normal_(
    t: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, name: str, seed: int
) -> torch.Tensor:
    """Fill ``t`` (a plain tensor or a DTensor) from N(mean, std²), keyed by ``name``."""
    _fill(t, "normal", mean, std, name=name, seed=seed)
    return t


def keyed_trunc_normal_(
    t: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    *,
    name: str,
    seed: int,
) -> torch.Tensor:
    """Fill ``t`` (a plain tensor or a DTensor) from N(mean, std²) truncated to [a, b], keyed by
    ``name``: one inverse-CDF draw per element, so a rank never waits on another's values."""
    _fill(t, "trunc_normal", mean, std, a, b, name=name, seed=seed)
    return t


_Key = tuple[int, int, tuple[int, ...]]  # (storage identity, offset, shape) of the local tensor


def _local_key(t: torch.Tensor) -> _Key | None:
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device.type == "meta":
        return None
    return (storage_identity(local), local.storage_offset(), tuple(t.shape))


class KeyedInit:
    """The names keyed init gives tensors under ``invariant_random``: a parameter's or buffer's
    stable name in ``model``; any other tensor (every tensor when ``model`` is None) its place
    among the block's draws, the same on every rank that runs the same init.

    A tensor is found by identity (the parameter object ``nn.init`` receives) or by its
    storage (``param.data``); a hit counts only while that tensor still holds that storage, and
    the map is rebuilt when a lookup misses and the model's tensors or their storages changed,
    so parameters that ``to_empty``, ``.to()``, FSDP or TP replaced after this was made are
    found, never taken for the tensor that held the address before. A tensor under several
    names (tied weights) takes the smallest, whatever order the modules were registered in.
    """

    def __init__(self, model: torch.nn.Module | None, seed: int) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InvariantRandomConfigTypeError(
                f"init='keyed' takes model= (the nn.Module whose parameter names key the "
                f"values) or None, got {type(model).__name__}"
            )
        try:
            checked = validate_seed(
                seed,
                type_error=InvariantRandomConfigTypeError,
                value_error=InvariantRandomConfigError,
            )
        except InvariantRandomConfigError as refused:
            # One message for every refusal: it names the range and what to pass; a seed of the
            # wrong type stays a TypeError.
            raise type(refused)(
                f"seed must be an int in [0, 2**64), got {seed!r}; pass the run's seed (the same "
                "on every rank)"
            ) from None
        self.model = model
        self.seed = checked
        # id / storage -> (a weak reference to the model's tensor, its name)
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._by_storage: dict[_Key, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._seen: list[tuple[int, _Key | None]] = []  # the model's tensors at the last rebuild
        self._anonymous = 0
        self._rebuild()

    def anonymous_name(self) -> str:
        """A name for the next draw into a tensor that is none of the model's (e.g. a resampling
        buffer): its place among such draws, the same on every layout that runs the same init."""
        self._anonymous += 1
        return f"<anonymous>.{self._anonymous}"

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        if self.model is None:
            return []
        return [
            *self.model.named_parameters(remove_duplicate=False),
            *self.model.named_buffers(remove_duplicate=False),
        ]

    def _rebuild(self) -> None:
        """Map the model's tensors by id and storage, unless they are those of the last map."""
        named = self._named()
        seen = [(id(t), _local_key(t)) for _, t in named]
        if seen == self._seen:
            return
        self._by_id.clear()
        self._by_storage.clear()
        self._seen = seen
        for (fqn, tensor), (ident, key) in zip(named, seen, strict=True):
            name = stable_name(fqn)
            for table, at in ((self._by_id, ident), (self._by_storage, key)):
                if at is not None and (at not in table or name < table[at][1]):  # tied: smallest
                    table[at] = (weakref.ref(tensor), name)

    def _lookup(self, t: torch.Tensor) -> str | None:
        entry = self._by_id.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        key = _local_key(t)
        entry = None if key is None else self._by_storage.get(key)
        if entry is None:
            return None
        owner = entry[0]()
        # the storage's address may now be another tensor's: a hit only while the owner holds it
        return entry[1] if owner is not None and _local_key(owner) == key else None

    def fill(self, t: torch.Tensor, kind: FillKind, *params: object) -> torch.Tensor:
        """Fill ``t`` with the keyed values of ``kind`` (see :data:`FillKind`) under its name
        (:meth:`name_of`); a refused call is refused before it takes a name, so it leaves the
        names of later draws as they were."""
        values = check_keyed_fill(t, kind, *params)
        _write(t, kind, values, self.name_of(t), self.seed)
        return t

    def name_of(self, t: torch.Tensor) -> str:
        """``t``'s stable name in the model, or, for a tensor that is none of its parameters or
        buffers (or with no model), its place among such draws (:meth:`anonymous_name`)."""
        name = self._lookup(t)
        if name is None:
            self._rebuild()  # tensors or storages replaced (to_empty, .to(), FSDP, TP) since?
            name = self._lookup(t)
        return self.anonymous_name() if name is None else name
