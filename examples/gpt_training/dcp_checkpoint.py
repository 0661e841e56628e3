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
import re
import shutil
import signal
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker.dcp import RankStates

# mesh.py has no public "global rank of these coordinates"; its own rank grid is the truth.
from rng_tracker.parallel._mesh import global_rank
from rng_tracker.parallel._tp_mappings import gather_from_tp

from .errors import ResumeRefusedError, SaveCommitError, TrainingCheckpointError

__all__ = [
    "FAULT_ENV",
    "FORMAT",
    "LogicalTensor",
    "Manifest",
    "RNGCheckpoint",
    "RunLayout",
    "check_resume",
    "commit_pointer",
    "is_save_directory",
    "load_checkpoint",
    "local_shard",
    "manifest_bytes",
    "new_run_id",
    "parse_manifest",
    "parse_pointer",
    "pointer_bytes",
    "rank_rng_states",
    "read_manifest",
    "save_checkpoint",
    "tracker_state_of",
    "write_manifest",
]

FORMAT = 3  # 3: COMMITTED records the manifest's sha256 and its own
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
# Test tooling: "RANK:POINT" makes that rank SIGKILL itself at POINT of save_checkpoint.
FAULT_ENV = "RNG_TRACKER_SAVE_FAULT"
FAULT_POINTS = ("gather", "write", "rename", "commit", "cleanup")


@dataclass(frozen=True, slots=True)
class RunLayout:
    """The parallel layout a checkpoint was written on (or is loaded into)."""

    tp: int
    dp: int
    pp: int
    microbatches: int
    sp: bool

    def rank_of(self, *, tp: int, dp: int, pp: int) -> int:
        """The global rank :func:`init_model_parallel` gives coordinate (tp, dp, pp) here.

        The mesh's own rule (Megatron's default order; the job runs without
        context parallelism, so cp is 1), also for a saved layout that is not the live mesh.
        """
        sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
        return global_rank({"tp": tp, "dp": dp, "pp": pp}, sizes)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a committed checkpoint says about itself."""

    format: int
    run_id: str
    step: int
    rng_mode: str
    seed: int
    global_batch: int
    layout: RunLayout
    losses: list[float] = field(hash=False)
    has_optimizer: bool = True
    files: dict[str, str] = field(default_factory=dict, hash=False)  # name -> sha256
    directory: str = ""  # the step directory: its name in the file, its path once read


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
    with torch.no_grad():
        return gather_from_tp(local.detach(), tp_group, dim=shard_dim)


def local_shard(full: torch.Tensor, shard_dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's chunk of a logical tensor (the chunking the TP layers use)."""
    return full if shard_dim is None else full.chunk(tp, dim=shard_dim)[tp_rank].contiguous()


def _gather_logical(
    specs: list[LogicalTensor],
    local: Mapping[str, torch.Tensor],
    *,
    layout: RunLayout,
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


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
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
    failure = ""
    if dist.get_rank() == 0:
        failure = _commit_or_rescue(path, tensors, RNGCheckpoint(per_rank, keyed), manifest)
    failure = _from_rank0(failure)  # every rank raises the same error, none waits forever
    if failure:
        raise SaveCommitError(failure)
    dist.barrier()


def _from_rank0(text: str) -> str:
    """Rank 0's ``text`` on every rank (two broadcasts of bytes; nothing pickled)."""
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size), dtype=torch.uint8)
    if dist.get_rank() == 0 and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if int(size):
        dist.broadcast(buffer, src=0)
    return bytes(buffer.tolist()).decode()


def _committed_step(path: str) -> str:
    """What ``path`` holds committed, in words, for an error message."""
    try:
        with open(os.path.join(path, COMMITTED), "rb") as f:
            pointer = parse_pointer(f.read(), os.path.join(path, COMMITTED))
    except (OSError, TrainingCheckpointError):
        return f"{path} holds no readable committed checkpoint, and none was changed"
    return (
        f"the checkpoint {path} held before (step {pointer['step']} of run "
        f"{pointer['run_id'][:8]}) is still the committed one, unchanged"
    )


def _commit_or_rescue(
    path: str, tensors: dict[str, torch.Tensor], rng: RNGCheckpoint, manifest: Manifest
) -> str:
    """Commit into ``path``; if that fails, into a fresh rescue directory. "" on success, else
    the error message: what failed, that ``path``'s checkpoint is kept, where the state is."""
    try:
        os.makedirs(path, exist_ok=True)
        _commit(path, tensors, rng, manifest)
        return ""
    except (OSError, _WriteFailed) as exc:
        cause = str(exc) if isinstance(exc, _WriteFailed) else f"{type(exc).__name__}: {exc}"
    kept = _committed_step(path)
    try:
        rescue = tempfile.mkdtemp(prefix=f"rng-tracker-rescue-step{manifest.step}-")
        _commit(rescue, tensors, rng, manifest)
        where = (
            f"this run's state at step {manifest.step} was committed to {rescue} instead: "
            f"resume with --resume {rescue}"
        )
    except (OSError, _WriteFailed) as exc:
        where = (
            f"committing it to a rescue directory under {tempfile.gettempdir()} failed too "
            f"({exc}): the state of step {manifest.step} is not on disk"
        )
    return (
        f"--save {path}: committing the checkpoint of step {manifest.step} failed ({cause}); "
        f"{kept}; {where}"
    )


def _commit(
    path: str, tensors: dict[str, torch.Tensor], rng: RNGCheckpoint, manifest: Manifest
) -> None:
    name = f"step-{manifest.step:08d}-{manifest.run_id[:8]}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(path, f".tmp-{name}")
    from torch.distributed.checkpoint.api import CheckpointException  # wraps DCP's write errors

    try:
        _write_and_commit(path, name, tmp, tensors, rng, manifest)
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)
        if _pointer_directory(path) != name:  # not committed: leave the directory as it was
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
            raise _WriteFailed(f"{type(exc).__name__}: {str(exc).strip()[:300]}") from exc
    _fault("cleanup")
    with contextlib.suppress(OSError):  # stale directories of earlier saves; the commit stands
        for entry in os.listdir(path):
            if entry != name and is_save_directory(entry):
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def is_save_directory(entry: str) -> bool:
    """Whether ``entry`` is a step directory (or a save's temporary one) a save wrote: a user's
    ``step-notes/`` in the same directory is not."""
    return bool(_STEP_DIR.fullmatch(entry.removeprefix(".tmp-")))


def _pointer_directory(path: str) -> str | None:
    """The step directory ``path/COMMITTED`` names, or None."""
    try:
        with open(os.path.join(path, COMMITTED), "rb") as f:
            return parse_pointer(f.read(), path)["directory"]
    except (OSError, TrainingCheckpointError):
        return None


class _WriteFailed(Exception):
    """A checkpoint write or commit failed; the message says how."""


def _write_and_commit(
    path: str,
    name: str,
    tmp: str,
    tensors: dict[str, torch.Tensor],
    rng: RNGCheckpoint,
    manifest: Manifest,
) -> None:
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
    digest = write_manifest(tmp, replace(manifest, files=files, directory=name))
    os.rename(tmp, os.path.join(path, name))
    _fsync_dir(path)
    _fault("rename")
    commit_pointer(path, replace(manifest, directory=name), digest)


# --- the manifest and the commit pointer: canonical JSON, hashed, parsed by a strict schema ---
#
# COMMITTED names the step directory and records the sha256 of that directory's manifest.json
# bytes; COMMITTED itself carries the sha256 of its own canonical body. So any change to either
# file - one flipped bit included - is refused before a field of it is trusted.

_HEX64 = re.compile(r"[0-9a-f]{64}")
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_STEP_DIR = re.compile(r"step-[0-9]{8}-[0-9a-f]{8}-[0-9a-f]{8}")
_RNG_MODES = ("megatron", "invariant", "keyed")
_LAYOUT_FIELDS = {"tp": int, "dp": int, "pp": int, "microbatches": int, "sp": bool}
_MANIFEST_FIELDS = {
    "format": int,
    "run_id": str,
    "step": int,
    "rng_mode": str,
    "seed": int,
    "global_batch": int,
    "layout": dict,
    "losses": list,
    "has_optimizer": bool,
    "files": dict,
    "directory": str,
}
_POINTER_FIELDS = {
    "format": int,
    "directory": str,
    "run_id": str,
    "step": int,
    "manifest_sha256": str,
}


def _canonical(record: Mapping[str, Any]) -> bytes:
    """The one byte encoding of a record: sorted keys, no spaces, ASCII, newline-terminated."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def manifest_bytes(manifest: Manifest) -> bytes:
    """What ``manifest.json`` holds for ``manifest`` (its canonical JSON)."""
    return _canonical(asdict(manifest))


def pointer_bytes(pointer: Mapping[str, Any]) -> bytes:
    """What ``COMMITTED`` holds for a pointer body: its canonical JSON with its own sha256 added."""
    body = {key: pointer[key] for key in _POINTER_FIELDS}
    return _canonical({**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()})


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write ``manifest.json`` into ``directory`` durably; returns the sha256 of its bytes."""
    raw = manifest_bytes(manifest)
    _write_durably(os.path.join(directory, MANIFEST), raw)
    _fsync_dir(directory)
    return hashlib.sha256(raw).hexdigest()


def commit_pointer(path: str, manifest: Manifest, manifest_sha256: str) -> None:
    """Atomically point ``path/COMMITTED`` at ``manifest.directory`` (a name inside ``path``)."""
    pointer = {
        "format": FORMAT,
        "directory": manifest.directory,
        "run_id": manifest.run_id,
        "step": manifest.step,
        "manifest_sha256": manifest_sha256,
    }
    _write_durably(os.path.join(path, COMMITTED + ".tmp"), pointer_bytes(pointer))
    _fault("commit")
    os.replace(os.path.join(path, COMMITTED + ".tmp"), os.path.join(path, COMMITTED))
    _fsync_dir(path)


def _corrupt(where: str, what: str) -> TrainingCheckpointError:
    return TrainingCheckpointError(
        f"{where}: {what}; the checkpoint is corrupt or was not written by this version of the "
        "job - resume from another checkpoint"
    )


def _fields(record: Any, schema: Mapping[str, type], where: str, what: str) -> dict[str, Any]:
    """``record`` as a dict with exactly the keys of ``schema``, each of exactly its type."""
    if not isinstance(record, dict):
        raise _corrupt(where, f"{what} is a {type(record).__name__}, not an object")
    if set(record) != set(schema):
        missing, extra = sorted(set(schema) - set(record)), sorted(set(record) - set(schema))
        raise _corrupt(where, f"{what} has missing keys {missing} and unknown keys {extra}")
    for key, kind in schema.items():
        if type(record[key]) is not kind:  # exact: a bool is no int here, an int no float
            raise _corrupt(
                where,
                f"{what} field {key!r} is a {type(record[key]).__name__}, not {kind.__name__}",
            )
    return record


def _load_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(where, f"not valid JSON ({exc})") from None


def parse_pointer(raw: bytes, where: str) -> dict[str, Any]:
    """The pointer body of ``COMMITTED``'s bytes, checked against its own hash and schema."""
    record = _load_json(raw, where)
    if isinstance(record, dict) and "sha256" not in record and record.get("format") in (1, 2):
        raise TrainingCheckpointError(
            f"{where}: format {record['format']}, older than this job's checkpoint format "
            f"{FORMAT}; resume it with the version of rng_tracker that wrote it"
        )
    record = _fields(record, {**_POINTER_FIELDS, "sha256": str}, where, "the commit pointer")
    if pointer_bytes(record) != raw:
        raise _corrupt(where, "its bytes do not match the hash it records")
    if not (
        _STEP_DIR.fullmatch(record["directory"])
        and _RUN_ID.fullmatch(record["run_id"])
        and _HEX64.fullmatch(record["manifest_sha256"])
        and record["step"] >= 0
    ):
        raise _corrupt(where, "a field is out of its range")
    return record


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """The :class:`Manifest` in ``manifest.json``'s bytes, checked against the schema."""
    record = _fields(_load_json(raw, where), _MANIFEST_FIELDS, where, "the manifest")
    layout = _fields(record["layout"], _LAYOUT_FIELDS, where, "the manifest's layout")
    if record["format"] != FORMAT:
        raise _corrupt(where, f"format {record['format']} is not {FORMAT}")
    if not (
        _RUN_ID.fullmatch(record["run_id"])
        and _STEP_DIR.fullmatch(record["directory"])
        and record["rng_mode"] in _RNG_MODES
        and record["step"] >= 0
        and 0 <= record["seed"] < 2**64
        and record["global_batch"] >= 1
        and all(layout[axis] >= 1 for axis in ("tp", "dp", "pp", "microbatches"))
        and len(record["losses"]) == record["step"]
        and all(type(loss) is float for loss in record["losses"])
        and all(
            type(name) is str
            and os.path.basename(name) == name
            and name not in ("", ".", "..")
            and type(digest) is str
            and _HEX64.fullmatch(digest)
            for name, digest in record["files"].items()
        )
    ):
        raise _corrupt(where, "a field is out of its range or of the wrong type")
    if manifest_bytes(Manifest(**{**record, "layout": RunLayout(**layout)})) != raw:
        raise _corrupt(where, "it is not in the canonical form the job writes")
    return Manifest(**{**record, "layout": RunLayout(**layout)})


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_manifest(path: str) -> Manifest:
    """The committed checkpoint in ``path``, its manifest and files checked against their hashes.

    Raises :class:`TrainingCheckpointError` naming the file at fault when ``path`` does not
    exist or holds nothing committed, when ``COMMITTED`` or ``manifest.json`` is altered or
    does not fit the schema, when the pointer and the manifest name different runs or steps,
    or when a data file is missing, extra or altered.
    """
    if not os.path.isdir(path):
        raise TrainingCheckpointError(
            f"{path} does not exist or is not a directory; give the directory a run saved to"
        )
    pointer_path = os.path.join(path, COMMITTED)
    if not os.path.isfile(pointer_path):
        raise TrainingCheckpointError(
            f"{path} holds no committed checkpoint ({pointer_path} is missing): it is not a "
            "checkpoint directory, or the save that wrote it did not finish; resume from an "
            "earlier checkpoint"
        )
    pointer = parse_pointer(_read_bytes(pointer_path), pointer_path)
    directory = os.path.join(path, pointer["directory"])
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        raw = _read_bytes(manifest_path)
    except OSError as exc:
        raise TrainingCheckpointError(
            f"{pointer_path} names {manifest_path}, which cannot be read ({exc.strerror}); the "
            "checkpoint is incomplete - resume from another one"
        ) from None
    if hashlib.sha256(raw).hexdigest() != pointer["manifest_sha256"]:
        raise _corrupt(manifest_path, f"its bytes do not match the sha256 {pointer_path} records")
    manifest = parse_manifest(raw, manifest_path)
    if (manifest.run_id, manifest.step, manifest.directory) != (
        pointer["run_id"],
        pointer["step"],
        pointer["directory"],
    ):
        raise TrainingCheckpointError(
            f"{path}: COMMITTED names run {pointer['run_id']} step {pointer['step']} but "
            f"{pointer['directory']} holds run {manifest.run_id} step {manifest.step}; "
            "the directory mixes checkpoints - resume from another one"
        )
    present = sorted(f for f in os.listdir(directory) if f != MANIFEST)
    if present != sorted(manifest.files):
        raise TrainingCheckpointError(
            f"{directory}: files {present} differ from the manifest's {sorted(manifest.files)}"
        )
    for name, digest in manifest.files.items():
        if _sha256(os.path.join(directory, name)) != digest:
            raise TrainingCheckpointError(
                f"{directory}/{name} does not match its recorded hash: the checkpoint is corrupt"
            )
    return replace(manifest, directory=directory)


def check_resume(
    manifest: Manifest, *, rng_mode: str, seed: int, global_batch: int, layout: RunLayout
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
