"""The bytes of one RNG checkpoint entry (format 2): a magic line, a checksum, a header, raw states.

An entry is ``MAGIC + checksum + header + b"\\n" + blob``: the header is canonical JSON (sorted
keys, no spaces, ASCII), the blob the raw bytes of the generator states the header lists, in
order. The checksum is BLAKE2b-256 over the entry's key (``shared``, ``rank3``) and everything
after the checksum, so every single-bit flip anywhere (magic, checksum, header, blob) and an
entry filed under another key are refused. Nothing is unpickled: the header is JSON and the
states are bytes.

The header schemas are checked here too (a checksum proves integrity, not that a writer
followed the format), and a format-1 save is read into format 2's parts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any

from rng_tracker._collective import as_bytes
from rng_tracker.errors import StateDictError

FORMAT = 2  # 1: one blob of every rank's states, gathered to every rank (rng_tracker <= da7a863)
MAGIC = b"rng_tracker RNG state, format 2\n"
_RANK_DIGITS = 9  # a ``rank<r>`` key's r has at most this many digits
MAX_RANK = 10**_RANK_DIGITS - 1  # the largest rank a key holds (dcp's check of a rank)
_RANK_KEY = re.compile(rf"rank(0|[1-9][0-9]{{0,{_RANK_DIGITS - 1}}})")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PART_NAME = re.compile(r"cpu|device|stream/.+", re.DOTALL)
_CHECKSUM_BYTES = 32
_PERSON = b"rng_tracker.ckpt"


def canonical(record: Any) -> bytes:
    """The one byte encoding of a JSON record: sorted keys, no spaces, ASCII."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def checksum(key: str, body: bytes) -> bytes:
    """BLAKE2b-256 of an entry's key and body (what follows the checksum)."""
    digest = hashlib.blake2b(digest_size=_CHECKSUM_BYTES, person=_PERSON)
    digest.update(key.encode("utf-8") + b"\0")
    digest.update(body)
    return digest.digest()


def encode_entry(key: str, header: dict[str, Any], parts: list[bytes]) -> bytes:
    """The entry ``key`` holding ``header`` and the raw ``parts`` it lists."""
    body = canonical(header) + b"\n" + b"".join(parts)
    return MAGIC + checksum(key, body) + body


def decode_entry(key: str, data: object) -> tuple[dict[str, Any], bytes, bytes]:
    """``(header, blob, checksum)`` of entry ``key``, or :class:`StateDictError` for anything
    that is not an intact format-2 entry written under ``key``."""
    if not isinstance(data, bytes | bytearray):
        raise StateDictError(
            f"RNG checkpoint entry {key!r} is a {type(data).__name__}, not bytes; it was not "
            "written by RNGStateful.state_dict()"
        )
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise StateDictError(
            f"RNG checkpoint entry {key!r} ({len(data)} bytes) does not start with the format-2 "
            "marker: it is corrupt, truncated, or not an rng_tracker RNG state; resume from "
            "another checkpoint"
        )
    stored = data[len(MAGIC) : len(MAGIC) + _CHECKSUM_BYTES]
    body = data[len(MAGIC) + _CHECKSUM_BYTES :]
    if not hmac.compare_digest(stored, checksum(key, body)):
        raise StateDictError(
            f"RNG checkpoint entry {key!r} does not match its checksum: it is corrupt (or "
            "filed under another key); nothing was restored - resume from another checkpoint"
        )
    text, newline, blob = body.partition(b"\n")
    try:
        header = json.loads(text.decode("ascii")) if newline else None
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict) or canonical(header) != text:
        raise StateDictError(
            f"RNG checkpoint entry {key!r} has an intact checksum but no canonical JSON header; "
            "it was not written by this rng_tracker"
        )
    return header, blob, stored


def split_blob(key: str, blob: bytes, sizes: list[int]) -> list[bytes]:
    """``blob`` cut into pieces of ``sizes`` bytes, which must add up to its length exactly."""
    if sum(sizes) != len(blob):
        raise StateDictError(
            f"RNG checkpoint entry {key!r} lists {sum(sizes)} bytes of states but holds "
            f"{len(blob)}; it was not written by this rng_tracker"
        )
    pieces, start = [], 0
    for size in sizes:
        pieces.append(blob[start : start + size])
        start += size
    return pieces


def is_rank_key(key: object) -> bool:
    """Whether ``key`` names a per-rank entry (``rank0``, ``rank12``, ...)."""
    return isinstance(key, str) and _RANK_KEY.fullmatch(key) is not None


def is_entry_key(key: object) -> bool:
    """Whether ``key`` names an entry an RNGStateful writes: ``shared``, ``rank<r>``, or a
    format-1 ``blob``."""
    return key in ("shared", "blob") or is_rank_key(key)


def format1_parts(saved: Mapping[str, Any]) -> dict[str, tuple[bytes, int | None]]:
    """One rank's states in a format-1 save, as format 2's parts: name -> (bytes, seed)."""
    parts = {"cpu": (as_bytes(saved["cpu"]), None)}
    if "device" in saved:
        parts["device"] = (as_bytes(saved["device"]), None)
    for name, entry in sorted(saved["tracker"]["streams"].items()):
        parts[f"stream/{name}"] = (as_bytes(entry["state"]), entry["seed"])
    return parts


# --- header schemas (a checksum proves integrity, not that a writer followed the format) -------


def _malformed(what: str) -> StateDictError:
    return StateDictError(
        f"the RNG state's {what} is malformed: it was not written by this rng_tracker's "
        "RNGStateful; resume from another checkpoint"
    )


def _is_int(value: object, low: int = 0, high: int | None = None) -> bool:
    return (
        type(value) is int and value >= low and (high is None or value <= high)  # no bools
    )


def check_shared_header(header: dict[str, Any]) -> dict[str, Any]:
    """``header`` of the ``shared`` entry, if it follows the format, else :class:`StateDictError`."""
    keys = {
        "kind",
        "format",
        "nonce",
        "world",
        "layout",
        "run_seed",
        "step",
        "trainer_step",
        "keyed",
        "tracker",
        "parts",
    }
    if set(header) != keys or header["kind"] != "shared":
        raise _malformed("shared entry")
    if header["format"] != FORMAT:
        raise StateDictError(
            f"RNG state of format {header['format']!r}; this rng_tracker reads formats 1 and "
            f"{FORMAT}: load it with the version that wrote it"
        )
    tracker = header["tracker"]
    if not (
        isinstance(header["nonce"], str)
        and _HEX32.fullmatch(header["nonce"])
        and _is_int(header["world"], 1)
        and isinstance(header["layout"], str)
        and _is_int(header["run_seed"], 0, 2**64 - 1)
        and (header["step"] is None or _is_int(header["step"]))
        and (header["trainer_step"] is None or _is_int(header["trainer_step"]))
        and (header["keyed"] is None or isinstance(header["keyed"], dict))
        and isinstance(tracker, dict)
        and set(tracker) == {"version", "device_type"}
        and isinstance(header["parts"], list)
    ):
        raise _malformed("shared entry's header")
    names = []
    for part in header["parts"]:
        if not (
            isinstance(part, dict)
            and set(part) == {"name", "replicated", "nbytes", "seed", "axes"}
            and isinstance(part["name"], str)
            and _PART_NAME.fullmatch(part["name"])
            and type(part["replicated"]) is bool
            and _is_int(part["nbytes"])
            and (part["seed"] is None or _is_int(part["seed"], 0, 2**64 - 1))
            and isinstance(part["axes"], list)
            and all(isinstance(a, str) and a for a in part["axes"])
            and (part["replicated"] or (part["axes"] and part["nbytes"] == 0))
        ):
            raise _malformed("shared entry's list of states")
        names.append(part["name"])
    if len(set(names)) != len(names) or "cpu" not in names:
        raise _malformed("shared entry's list of states")
    return header


def check_rank_entry(
    key: str,
    data: object,
    shared: dict[str, Any],
    shared_sum: str,
    per_rank: list[str],
) -> tuple[dict[str, tuple[bytes, int | None]], dict[str, int] | None]:
    """The parts of entry ``key`` (name -> (bytes, seed)) and the rank's coordinates at the save
    (axis -> coordinate on the axes of size > 1; None in entries written before they were kept),
    checked against the format and against the save its ``shared`` entry (checksum
    ``shared_sum``) records; else :class:`StateDictError`."""
    header, blob, _ = decode_entry(key, data)
    fields = {"kind", "format", "rank", "world", "nonce", "shared", "parts"}
    at = header.get("at")
    if set(header) - {"at"} != fields or not (
        ((at is None and "at" not in header) or _is_coordinates(at))
        and header["kind"] == "rank"
        and header["format"] == FORMAT
        and _is_int(header["rank"])
        and f"rank{header['rank']}" == key
        and isinstance(header["shared"], str)
        and _HEX64.fullmatch(header["shared"])
        and isinstance(header["parts"], list)
    ):
        raise _malformed(f"entry {key!r}")
    if (header["world"], header["nonce"], header["shared"]) != (
        shared["world"],
        shared["nonce"],
        shared_sum,
    ) or header["rank"] >= shared["world"]:
        raise StateDictError(
            f"the RNG state's entry {key!r} belongs to another save than its 'shared' entry: "
            "the checkpoint mixes saves; resume from another one"
        )
    parts = header["parts"]
    if (
        not all(
            isinstance(p, dict)
            and set(p) == {"name", "nbytes", "seed"}
            and _is_int(p["nbytes"])
            and (p["seed"] is None or _is_int(p["seed"], 0, 2**64 - 1))
            for p in parts
        )
        or [p["name"] for p in parts] != per_rank
    ):
        raise _malformed(f"entry {key!r}'s list of states")
    pieces = split_blob(key, blob, [p["nbytes"] for p in parts])
    return {p["name"]: (piece, p["seed"]) for p, piece in zip(parts, pieces, strict=True)}, at


def _is_coordinates(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(axis, str) and axis and _is_int(rank) for axis, rank in value.items()
    )
