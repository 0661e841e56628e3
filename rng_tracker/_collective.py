"""The collectives the library runs on top of ``torch.distributed``, each written once.

Python objects cross ranks only as bytes in uint8 tensors (JSON, or JSON plus raw tensor
bytes), never pickled: nothing a peer sends is executed on load, and no numpy is needed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_bytes(data: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor (on any device), copied in one pass (no numpy needed)."""
    out = bytearray(data.numel())
    if out:  # torch.frombuffer refuses an empty buffer
        torch.frombuffer(out, dtype=torch.uint8).copy_(data.detach().reshape(-1))
    return bytes(out)


def as_uint8(payload: bytes, device: torch.device) -> torch.Tensor:
    """``payload`` as a uint8 tensor on ``device`` (empty payloads included)."""
    if not payload:  # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``payload`` (any length), in rank order of ``group`` (None: the world).

    Two all-gathers into one flat tensor each: the lengths, then the payloads zero-padded to the
    longest; the result is read back to the host in one copy, however many ranks there are.
    """
    device = collective_device(group)
    data = as_uint8(payload, device)
    world = dist.get_world_size(group)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.all_gather_single(lengths, length, group=group)
    sizes = lengths.tolist()
    width = max(sizes)
    if width == 0:  # every rank agrees: nothing to gather
        return [b""] * world
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
    dist.all_gather_single(gathered, padded, group=group)
    return unpad(gathered, sizes)


def unpad(gathered: torch.Tensor, sizes: list[int]) -> list[bytes]:
    """The payloads of ``sizes`` bytes each out of ``gathered``: rank by rank, each zero-padded
    to the longest. One copy to the host, then slices."""
    width = max(sizes, default=0)
    flat = as_bytes(gathered)
    return [flat[rank * width : rank * width + n] for rank, n in enumerate(sizes)]


def all_gather_json(payload: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serialisable ``payload``, in rank order of ``group``."""
    return parse_each(all_gather_bytes(json.dumps(payload).encode(), group))


def parse_each(parts: list[bytes]) -> list[Any]:
    """Each of these JSON texts parsed, as one JSON array: one parse, however many ranks."""
    return json.loads(b"[" + b",".join(parts) + b"]")


_TENSOR = "__tensor__"  # marks a tensor leaf in the JSON header of all_gather_tensor_tree


def _encode_tree(tree: Any) -> bytes:
    """``tree`` (dicts with str keys, lists, JSON scalars, tensors) as a JSON header of its
    structure, a newline, then the tensors' raw bytes in the order the header names them."""
    blobs: list[bytes] = []

    def header(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            flat = node.detach().to("cpu").contiguous().reshape(-1)
            blobs.append(as_bytes(flat.view(torch.uint8)))
            return {_TENSOR: [str(node.dtype).removeprefix("torch."), list(node.shape)]}
        if isinstance(node, dict):
            return {key: header(value) for key, value in node.items()}
        if isinstance(node, list | tuple):
            return [header(value) for value in node]
        return node

    return json.dumps(header(tree)).encode() + b"\n" + b"".join(blobs)


def _decode_tree(data: bytes) -> Any:
    text, _, body = data.partition(b"\n")  # JSON escapes newlines: the first one ends it
    offset = 0

    def build(node: Any) -> Any:
        nonlocal offset
        if isinstance(node, dict) and set(node) == {_TENSOR}:
            dtype_name, shape = node[_TENSOR]
            dtype = getattr(torch, dtype_name)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = as_uint8(body[offset : offset + nbytes], torch.device("cpu"))
            offset += nbytes
            return raw.view(dtype).reshape(shape).clone()
        if isinstance(node, dict):
            return {key: build(value) for key, value in node.items()}
        if isinstance(node, list):
            return [build(value) for value in node]
        return node

    return build(json.loads(text))


def all_gather_tensor_tree(tree: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``tree`` of dicts (str keys), lists, JSON scalars and tensors, in rank order.

    Tensors come back on the CPU with their dtype and shape; tuples come back as lists.
    """
    return [_decode_tree(part) for part in all_gather_bytes(_encode_tree(tree), group)]


def all_gather_cat(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 0
) -> torch.Tensor:
    """Every rank's ``tensor`` (all of one shape) concatenated along ``dim`` in rank order."""
    parts = [
        torch.empty_like(tensor, memory_format=torch.contiguous_format)
        for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def state_digest(state: torch.Tensor) -> str:
    """A short hex digest of a generator state (its uint8 bytes), to compare states across ranks."""
    return hashlib.blake2b(as_bytes(state), digest_size=8).hexdigest()
