"""The bytes of one RNG checkpoint entry (format 2): a magic line, a checksum, a header, raw states.

An entry is ``MAGIC + checksum + header + b"\\n" + blob``: the header is canonical JSON (sorted
keys, no spaces, ASCII), the blob the raw bytes of the generator states the header lists, in
order. The checksum is BLAKE2b-256 over the entry's key (``shared``, ``rank3``) and everything
after the checksum, so every single-bit flip anywhere (magic, checksum, header, blob) and an
entry filed under another key are refused. Nothing is unpickled: the header is JSON and the
states are bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from rng_tracker.errors import StateDictError

MAGIC = b"rng_tracker RNG state, format 2\n"
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
