"""Training checkpoints of the demo job through torch.distributed.checkpoint (DCP).

What is saved: every parameter and AdamW moment as its *logical* (unsharded) tensor, so a
checkpoint loads on any tp/pp/dp layout; the RNG state as an :class:`RNGCheckpoint`
``Stateful`` holding each rank's exact generator and stream states under a key of its own
(``rng.rank3.cpu``: one key per rank, so DCP's deduplication of equal keys - pytorch#120356 -
cannot drop a rank's state) and the keyed state logically, once.

How it is written, so that a rank killed at any point leaves the previous checkpoint intact:
the pieces are gathered to rank 0 with tensor collectives, rank 0 writes one DCP checkpoint
(``no_dist``: DCP's own planning exchanges pickled objects, which needs numpy on the wire)
into a fresh temporary directory, records a manifest (run id, step, layout, file hashes),
renames the directory to its final name and only then commits it by atomically replacing
the ``COMMITTED`` pointer. The loader reads only what ``COMMITTED`` names, checks every hash
and that every piece belongs to the run and step the pointer names, stages everything, and
changes model, optimizer and RNG only when every rank has staged its part.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker.dcp import RankStates
from rng_tracker.errors import ResumeRefusedError, TrainingCheckpointError

__all__ = [
    "FAULT_ENV",
    "FORMAT",
    "Layout",
    "LogicalTensor",
    "Manifest",
    "RNGCheckpoint",
    "check_resume",
    "load_checkpoint",
    "local_shard",
    "new_run_id",
    "rank_rng_states",
    "read_manifest",
    "save_checkpoint",
    "tracker_state_of",
]

FORMAT = 2
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
# Test tooling: "RANK:POINT" makes that rank SIGKILL itself at POINT of save_checkpoint.
FAULT_ENV = "RNG_TRACKER_SAVE_FAULT"
FAULT_POINTS = ("gather", "write", "rename", "commit", "cleanup")


@dataclass(frozen=True, slots=True)
class Layout:
    """The parallel layout a checkpoint was written on (or is loaded into)."""

    tp: int
    dp: int
    pp: int
    microbatches: int
    sp: bool

    def rank_of(self, *, tp: int, dp: int, pp: int) -> int:
        """Global rank of a coordinate (the mesh lays ranks out tp-fastest, then dp, then pp)."""
        return (pp * self.dp + dp) * self.tp + tp


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a committed checkpoint says about itself."""

    format: int
    run_id: str
    step: int
    rng_mode: str
    seed: int
    global_batch: int
    layout: Layout
    losses: list[float] = field(hash=False)
    has_optimizer: bool = True
    files: dict[str, str] = field(default_factory=dict, hash=False)  # name -> sha256
    directory: str = ""


def new_run_id() -> str:
    """A fresh run id, broadcast from rank 0 as bytes (no pickled objects on the wire)."""
    data = torch.zeros(16, dtype=torch.uint8)
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).clone()
    dist.broadcast(data, src=0)
    return bytes(data.tolist()).hex()


def _fault(point: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{dist.get_rank()}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


# The RNG part of a checkpoint: the library's Stateful of several ranks' exact states (each
# under its own ``rank<r>`` key) and the keyed state, stored once.
RNGCheckpoint = RankStates


# --- per-rank RNG states as one flat uint8 tensor, for a tensor gather -----------------------


def _seed_bytes(seed: int | None) -> torch.Tensor:
    raw = b"\x00" * 17 if seed is None else b"\x01" + int(seed).to_bytes(16, "little", signed=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _seed_of(data: torch.Tensor) -> int | None:
    raw = bytes(data.tolist())
    return None if raw[0] == 0 else int.from_bytes(raw[1:], "little", signed=True)


def rank_rng_states(
    tracker_state: Mapping[str, Any], cpu: torch.Tensor, device: torch.Tensor | None
) -> dict[str, Any]:
    """This rank's states in the checkpoint's form (see :class:`RNGCheckpoint`)."""
    states: dict[str, Any] = {"cpu": cpu.clone()}
    if device is not None:
        states["device"] = device.clone()
    states["streams"] = {
        name: {"state": entry["state"].clone(), "seed": _seed_bytes(entry["seed"])}
        for name, entry in sorted(tracker_state["streams"].items())
    }
    return states


def tracker_state_of(
    states: Mapping[str, Any], *, version: int, device_type: str
) -> dict[str, Any]:
    """The tracker ``state_dict`` stored in a rank's checkpoint states."""
    return {
        "version": version,
        "device_type": device_type,
        "streams": {
            name: {"state": entry["state"], "seed": _seed_of(entry["seed"])}
            for name, entry in states["streams"].items()
        },
    }


def _flatten(states: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    items = []
    for key, value in states.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _unflatten(items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in items:
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _gather_rng(mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every rank's RNG states on rank 0 ({} elsewhere); all ranks must hold the same streams."""
    items = _flatten(mine)
    flat = torch.cat([t.reshape(-1) for _, t in items])
    size = torch.tensor([flat.numel(), -flat.numel()], dtype=torch.int64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    if size[0] != -size[1]:
        raise TrainingCheckpointError(
            "ranks hold RNG states of different sizes (different streams or devices); "
            "register the same streams on every rank before saving"
        )
    world = dist.get_world_size()
    parts = [torch.empty_like(flat) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(flat, parts, dst=0)
    if parts is None:
        return {}
    out = {}
    for rank, part in enumerate(parts):
        pieces, start = [], 0
        for key, template in items:
            pieces.append(
                (key, part[start : start + template.numel()].view(template.shape).clone())
            )
            start += template.numel()
        out[rank] = _unflatten(pieces)
    return out


# --- logical tensors ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """One saved tensor: its key, the owning pipeline stage, logical shape and TP shard dim."""

    key: str
    stage: int
    shape: tuple[int, ...]
    shard_dim: int | None


def _full(
    local: torch.Tensor, shard_dim: int | None, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    if shard_dim is None or tp_group is None or dist.get_world_size(tp_group) == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=shard_dim)


def local_shard(full: torch.Tensor, shard_dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's chunk of a logical tensor (the chunking the TP layers use)."""
    return full if shard_dim is None else full.chunk(tp, dim=shard_dim)[tp_rank].contiguous()


def _gather_logical(
    specs: list[LogicalTensor],
    local: Mapping[str, torch.Tensor],
    *,
    layout: Layout,
    coords: Mapping[str, int],
    tp_group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """The logical tensors of every stage on rank 0 ({} elsewhere).

    Each stage's TP group all-gathers its shards; the stage's (dp 0, tp 0) rank sends them to
    rank 0 in ``specs`` order. Rank 0 finishes its own stage before receiving, so no cycle.
    """
    mine = [s for s in specs if s.stage == coords["pp"]]
    full = {s.key: _full(local[s.key], s.shard_dim, tp_group) for s in mine}
    out: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        out.update(full)
        for spec in specs:
            if spec.stage != 0:
                buf = torch.empty(spec.shape, dtype=torch.float32)
                dist.recv(buf, src=layout.rank_of(tp=0, dp=0, pp=spec.stage))
                out[spec.key] = buf
    elif coords["tp"] == 0 and coords["dp"] == 0:
        for spec in mine:
            dist.send(full[spec.key].to(torch.float32).contiguous(), dst=0)
    return out


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's note that ``no_dist`` runs as one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str,
    *,
    specs: list[LogicalTensor],
    local: Mapping[str, torch.Tensor],
    rng: dict[str, Any],
    keyed: str | None,
    manifest: Manifest,
    coords: Mapping[str, int],
    tp_group: dist.ProcessGroup | None,
) -> None:
    """Write and commit one checkpoint of every rank into ``path``; collective.

    ``local`` maps each spec key of this rank's stage to its local shard; ``rng`` is this
    rank's :func:`rank_rng_states`. Nothing under ``COMMITTED`` changes until the new
    checkpoint is complete on disk.
    """
    _fault("gather")
    tensors = _gather_logical(
        specs, local, layout=manifest.layout, coords=coords, tp_group=tp_group
    )
    per_rank = _gather_rng(rng)
    if dist.get_rank() == 0:
        _commit(path, tensors, RNGCheckpoint(per_rank, keyed), manifest)
    dist.barrier()


def _commit(
    path: str, tensors: dict[str, torch.Tensor], rng: RNGCheckpoint, manifest: Manifest
) -> None:
    os.makedirs(path, exist_ok=True)
    name = f"step-{manifest.step:08d}-{manifest.run_id[:8]}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(path, f".tmp-{name}")
    state = {
        "tensors": tensors,
        "rng": rng,
        "meta": {"run_id": manifest.run_id, "step": manifest.step, "rng_mode": manifest.rng_mode},
    }
    import torch.distributed.checkpoint as dcp  # only on save/load: it takes seconds to import

    with _single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
    _fault("write")
    files = {f: _sha256(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
    record = {**asdict(manifest), "files": files, "directory": name}
    _write_durably(os.path.join(tmp, MANIFEST), json.dumps(record, indent=1))
    _fsync_dir(tmp)
    os.rename(tmp, os.path.join(path, name))
    _fsync_dir(path)
    _fault("rename")
    pointer = {
        "format": FORMAT,
        "directory": name,
        "run_id": manifest.run_id,
        "step": manifest.step,
    }
    _write_durably(os.path.join(path, COMMITTED + ".tmp"), json.dumps(pointer))
    _fault("commit")
    os.replace(os.path.join(path, COMMITTED + ".tmp"), os.path.join(path, COMMITTED))
    _fsync_dir(path)
    _fault("cleanup")
    for entry in os.listdir(path):
        if entry != name and (entry.startswith("step-") or entry.startswith(".tmp-")):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def read_manifest(path: str) -> Manifest:
    """The committed checkpoint in ``path``, its files checked against their hashes.

    Raises :class:`TrainingCheckpointError` when nothing is committed, the pointer and the
    manifest name different runs or steps, or a file is missing, extra or altered.
    """
    pointer_path = os.path.join(path, COMMITTED)
    try:
        with open(pointer_path) as f:
            pointer = json.load(f)
        directory = os.path.join(path, pointer["directory"])
        with open(os.path.join(directory, MANIFEST)) as f:
            record = json.load(f)
    except FileNotFoundError as exc:
        raise TrainingCheckpointError(
            f"{path} holds no committed checkpoint ({exc.filename} is missing): the save that "
            "wrote it did not finish; resume from an earlier checkpoint"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TrainingCheckpointError(
            f"{path}: the commit pointer or manifest is unreadable ({exc}); the checkpoint is corrupt"
        ) from None
    if pointer.get("format") != FORMAT or record.get("format") != FORMAT:
        raise TrainingCheckpointError(
            f"{path} is not an rng_tracker training checkpoint of format {FORMAT}"
        )
    if (record.get("run_id"), record.get("step")) != (pointer["run_id"], pointer["step"]):
        raise TrainingCheckpointError(
            f"{path}: COMMITTED names run {pointer['run_id']} step {pointer['step']} but "
            f"{pointer['directory']} holds run {record.get('run_id')} step {record.get('step')}; "
            "the directory mixes checkpoints - resume from another one"
        )
    present = sorted(f for f in os.listdir(directory) if f != MANIFEST)
    if present != sorted(record["files"]):
        raise TrainingCheckpointError(
            f"{directory}: files {present} differ from the manifest's {sorted(record['files'])}"
        )
    for name, digest in record["files"].items():
        if _sha256(os.path.join(directory, name)) != digest:
            raise TrainingCheckpointError(
                f"{directory}/{name} does not match its recorded hash: the checkpoint is corrupt"
            )
    record["layout"] = Layout(**record["layout"])
    record["directory"] = directory
    return Manifest(**record)


def check_resume(
    manifest: Manifest, *, rng_mode: str, seed: int, global_batch: int, layout: Layout
) -> None:
    """Refuse a resume whose randomness or data could not continue the saved run exactly.

    Keyed mode resumes on any layout. Invariant mode keeps its masks across TP and SP
    degrees only. Megatron mode's per-rank streams hold only on the same layout.
    """
    if manifest.rng_mode != rng_mode:
        raise ResumeRefusedError(
            f"the checkpoint was written in rng_mode={manifest.rng_mode!r} but this run uses "
            f"{rng_mode!r}; resume with --rng-mode {manifest.rng_mode}"
        )
    if manifest.global_batch != global_batch or manifest.seed != seed:
        raise ResumeRefusedError(
            f"the checkpoint's run has global batch {manifest.global_batch} and seed "
            f"{manifest.seed}, this run {global_batch} and {seed}: keep both to continue the run"
        )
    old = manifest.layout
    if rng_mode == "keyed" or old == layout:
        return
    if rng_mode == "invariant" and (old.dp, old.pp, old.microbatches) == (
        layout.dp,
        layout.pp,
        layout.microbatches,
    ):
        return
    changed = ", ".join(
        axis
        for axis in ("tp", "dp", "pp", "microbatches", "sp")
        if getattr(old, axis) != getattr(layout, axis)
    )
    may = "tp and sp only" if rng_mode == "invariant" else "no axis"
    raise ResumeRefusedError(
        f"the checkpoint was written on {old}, this run is {layout}: rng_mode={rng_mode!r} draws "
        f"layout-dependent masks, so changing {changed} cannot continue the run exactly (this "
        f"mode may change {may}); resume on the saved layout, or train with --rng-mode keyed, "
        "whose masks do not depend on the layout"
    )


def load_checkpoint(
    manifest: Manifest,
    *,
    specs: list[LogicalTensor],
    stage: int,
    rng_ranks: list[int],
    rng_template: Callable[[], dict[str, Any]] | None,
    keyed_template: str | None,
) -> tuple[dict[str, torch.Tensor], RNGCheckpoint]:
    """Stage this rank's logical tensors and the RNG states of ``rng_ranks`` from ``manifest``.

    Collective: every rank stages its part, and all raise if any rank failed, so no rank goes
    on half-loaded. Nothing here touches the model, optimizer or generators.
    """
    import torch.distributed.checkpoint as dcp  # only on save/load: it takes seconds to import
    from torch.distributed.checkpoint.api import CheckpointException

    error: Exception | None = None
    tensors: dict[str, torch.Tensor] = {}
    rng = RNGCheckpoint(
        {r: rng_template() for r in rng_ranks} if rng_template is not None else {},
        keyed_template,
    )
    try:
        tensors = {s.key: torch.empty(s.shape) for s in specs if s.stage == stage}
        state = {
            "tensors": tensors,
            "rng": rng,
            "meta": {"run_id": "", "step": -1, "rng_mode": ""},
        }
        try:
            with _single_process():
                dcp.load(
                    state, storage_reader=dcp.FileSystemReader(manifest.directory), no_dist=True
                )
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException
            raise TrainingCheckpointError(
                f"{manifest.directory} could not be loaded ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); it was written "
                "by another version or layout of the job, or it is corrupt"
            ) from exc
        meta = state["meta"]
        if (meta["run_id"], meta["step"], meta["rng_mode"]) != (
            manifest.run_id,
            manifest.step,
            manifest.rng_mode,
        ):
            raise TrainingCheckpointError(
                f"{manifest.directory} holds run {meta['run_id']} step {meta['step']} "
                f"({meta['rng_mode']}) but its manifest says run {manifest.run_id} step "
                f"{manifest.step} ({manifest.rng_mode}): the pieces belong to different saves"
            )
    except Exception as exc:
        error = exc
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise TrainingCheckpointError(
            f"{failed.item()} rank(s) could not load {manifest.directory} (see their errors); "
            "nothing was loaded on any rank"
        )
    return tensors, rng
