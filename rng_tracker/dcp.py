"""RNG state in any torch.distributed.checkpoint (DCP) checkpoint, reshardable where it can be.

Put an :class:`RNGStateful` in the state dict given to ``dcp.save``/``dcp.load`` (or to
torchtitan's ``CheckpointManager`` states): it saves this process's default generators (CPU
and accelerator), the rng_tracker streams and the keyed RNG state, for every rank.

DCP keeps one copy of equal keys written by several ranks (pytorch#120356), so a per-rank
state under a shared key would lose all ranks but one. Here every rank's states are gathered
(one small all-gather of their bytes, nothing pickled) into one blob that is the same on every
rank: the copy DCP keeps holds all ranks. Loading follows these rules:

- keyed state (seed, step, sites): any layout;
- a generator or stream that was equal on every saved rank (a replicated stream, e.g. the
  default generator under ``invariant_random()``): any layout;
- any other per-rank state: the same layout (``layout=`` and world size) restores each rank's
  own state; another layout raises :class:`RNGStateLayoutError` before anything changes.

:class:`RankStates` is the lower-level container (given ranks' states under ``rank<r>`` keys
and the keyed state as JSON) for a job that gathers states itself and saves from one process,
as the demo trainer does.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker._collective import all_gather_tensor_tree
from rng_tracker.device_rng import default_device, default_generator
from rng_tracker.errors import RNGStateLayoutError, StateDictError
from rng_tracker.keyed import KeyedRNG, get_keyed_rng
from rng_tracker.tracker import RNGStatesTracker, get_rng_tracker

__all__ = ["FORMAT", "RNGStateful", "RankStates"]

FORMAT = 1


class RankStates:
    """Several ranks' RNG states and the keyed state, as a DCP ``Stateful``.

    ``per_rank`` maps a global rank to its states (any nest of dicts of tensors); each lands
    under its own key ``rank<r>``, so DCP's deduplication of equal keys cannot drop a rank.
    ``keyed`` (the keyed RNG's state, e.g. as JSON) is the same on every rank and stored once.
    """

    def __init__(
        self, per_rank: dict[int, dict[str, Any]] | None = None, keyed: str | None = None
    ) -> None:
        self.per_rank = per_rank or {}
        self.keyed = keyed

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"rank{r}": states for r, states in self.per_rank.items()}
        if self.keyed is not None:
            out["keyed"] = self.keyed
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.per_rank = {
            int(key[4:]): value for key, value in state_dict.items() if key.startswith("rank")
        }
        self.keyed = state_dict.get("keyed")


def _layout_text(layout: object) -> str:
    if layout is None:
        return ""
    if isinstance(layout, str):
        return layout
    if isinstance(layout, Mapping):
        return ",".join(f"{k}={int(v)}" for k, v in layout.items())
    shape = getattr(layout, "shape", None)  # a DeviceMesh
    if shape is not None:
        names = getattr(layout, "mesh_dim_names", None) or [f"dim{i}" for i in range(len(shape))]
        return ",".join(f"{n}={int(s)}" for n, s in zip(names, shape, strict=True))
    raise StateDictError(
        f"layout must be a str, a mapping of axis sizes or a DeviceMesh, got {type(layout).__name__}"
    )


def _equal(values: list[torch.Tensor]) -> bool:
    return all(v.shape == values[0].shape and torch.equal(v, values[0]) for v in values[1:])


class RNGStateful:
    """This process's RNG state as a DCP ``Stateful``: default generators, tracker streams, keyed.

    Args:
        tracker: the rng_tracker tracker whose streams to save; None means the process's
            tracker for the default device (``get_rng_tracker()``).
        keyed: the keyed RNG; None means ``get_keyed_rng()`` (saved only once seeded).
        layout: what makes two runs' per-rank states interchangeable: a str, a mapping of
            axis sizes (``{"tp": 2, "dp": 2}``) or the DeviceMesh. The world size always counts.

    ``state_dict()`` and ``load_state_dict()`` are collective where torch.distributed is
    initialised (every rank calls them, as ``dcp.save``/``dcp.load`` do).
    """

    def __init__(
        self,
        tracker: RNGStatesTracker | None = None,
        keyed: KeyedRNG | None = None,
        *,
        layout: object = None,
    ) -> None:
        self._device = default_device()
        self.tracker = tracker if tracker is not None else get_rng_tracker(self._device)
        self.keyed = keyed if keyed is not None else get_keyed_rng(self._device)
        self.layout = _layout_text(layout)

    # -- this rank --------------------------------------------------------------------
    def _mine(self) -> dict[str, Any]:
        states: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self._device.type != "cpu":
            states["device"] = default_generator(self._device).get_state()
        tracker = self.tracker.state_dict()
        states["tracker"] = {
            "version": tracker["version"],
            "device_type": tracker["device_type"],
            "streams": {
                name: {"seed": entry["seed"], "state": entry["state"].clone()}
                for name, entry in tracker["streams"].items()
            },
        }
        return states

    @staticmethod
    def _world() -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def state_dict(self) -> dict[str, Any]:
        """``{"blob": bytes}``: every rank's states, equal on all ranks (collective)."""
        _, world = self._world()
        mine = self._mine()
        everyone = all_gather_tensor_tree(mine) if world > 1 else [mine]
        keyed = self.keyed.state_dict() if self.keyed.seed is not None else None
        payload = {
            "format": FORMAT,
            "world": world,
            "layout": self.layout,
            "ranks": dict(enumerate(everyone)),
            "keyed": keyed,
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return {"blob": buffer.getvalue()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore by the rules of the module docstring; on any error nothing changes."""
        blob = state_dict.get("blob") if isinstance(state_dict, Mapping) else None
        if not isinstance(blob, bytes | bytearray):
            raise StateDictError(
                "expected {'blob': bytes} as saved by RNGStateful.state_dict(); got "
                f"{type(state_dict).__name__}"
            )
        payload = torch.load(io.BytesIO(blob), weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise StateDictError(
                f"RNG state of format {payload.get('format') if isinstance(payload, dict) else '?'}"
                f", this rng_tracker reads format {FORMAT}; save it again with this version"
            )
        rank, world = self._world()
        ranks: dict[int, dict[str, Any]] = payload["ranks"]
        same_layout = payload["world"] == world and payload["layout"] == self.layout
        own = ranks.get(rank) if same_layout else None

        def pick(what: str, values: list[torch.Tensor]) -> torch.Tensor:
            if _equal(values):
                return values[0]
            if own is None:
                raise RNGStateLayoutError(
                    f"{what} differs between the {payload['world']} saved ranks (layout "
                    f"{payload['layout']!r}), so it can only be restored on that layout; this "
                    f"run has {world} ranks, layout {self.layout!r}. Resume on the saved layout, "
                    "or use replicated streams / keyed randomness, which reshard"
                )
            return values[rank]

        saved = [ranks[r] for r in sorted(ranks)]
        cpu = pick("the CPU default generator", [s["cpu"] for s in saved])
        device = None
        if self._device.type != "cpu" and all("device" in s for s in saved):
            device = pick("the device default generator", [s["device"] for s in saved])
        names = sorted(saved[0]["tracker"]["streams"])
        if any(sorted(s["tracker"]["streams"]) != names for s in saved):
            raise StateDictError("the saved ranks hold different tracker streams; cannot restore")
        tracker_sd = {
            "version": saved[0]["tracker"]["version"],
            "device_type": saved[0]["tracker"]["device_type"],
            "streams": {
                name: {
                    "seed": saved[0]["tracker"]["streams"][name]["seed"]
                    if own is None
                    else own["tracker"]["streams"][name]["seed"],
                    "state": pick(
                        f"tracker stream {name!r}",
                        [s["tracker"]["streams"][name]["state"] for s in saved],
                    ),
                }
                for name in names
            },
        }
        # Everything is chosen; apply, and put back what was there if any part refuses.
        before = (
            torch.get_rng_state(),
            default_generator(self._device).get_state() if device is not None else None,
            self.tracker.state_dict(),
            self.keyed.state_dict() if self.keyed.seed is not None else None,
        )
        try:
            if payload["keyed"] is not None:
                self.keyed.load_state_dict(payload["keyed"])
            self.tracker.load_state_dict(tracker_sd)
            torch.set_rng_state(cpu)
            if device is not None:
                default_generator(self._device).set_state(device)
        except Exception:
            torch.set_rng_state(before[0])
            if before[1] is not None:
                default_generator(self._device).set_state(before[1])
            self.tracker.load_state_dict(before[2])
            if before[3] is not None:
                self.keyed.load_state_dict(before[3])
            raise
