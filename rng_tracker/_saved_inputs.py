"""How a checkpoint keeps its inputs until the recompute: split across a group, or on the CPU.

``pack``/``unpack`` have the shape of saved-tensor hooks, so the non-reentrant checkpoint
applies them to the inputs torch saves, and the reentrant one calls them directly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker._collective import all_gather_cat
from rng_tracker._deprecation import warn_deprecated
from rng_tracker.errors import CheckpointConfigError, CheckpointUsageError


@dataclass(frozen=True, slots=True)
class _SplitTensor:
    part: torch.Tensor  # (ceil(numel / group_size),) this rank's slice of the padded flat tensor
    shape: torch.Size
    group: dist.ProcessGroup


@dataclass(frozen=True, slots=True)
class _KeptTensor:
    tensor: torch.Tensor  # saved as it is: an in-place change before the recompute is refused
    version: int


@dataclass(frozen=True, slots=True)
class _OffloadedTensor:
    data: torch.Tensor | _SplitTensor  # on the CPU
    device: torch.device


def split_for_save(tensor: torch.Tensor, group: dist.ProcessGroup) -> _SplitTensor:
    """This rank's equal slice of ``tensor`` flattened and zero-padded to a multiple of the group size."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = tensor.detach().reshape(-1)
    per_rank = -(-flat.numel() // size)
    if flat.numel() != per_rank * size:
        flat = torch.nn.functional.pad(flat, (0, per_rank * size - flat.numel()))
    return _SplitTensor(flat[rank * per_rank : (rank + 1) * per_rank].clone(), tensor.shape, group)


def first_tensor(args: Sequence[Any]) -> torch.Tensor:
    """The first argument, which ``distribute_saved_activations`` splits: it must be a tensor."""
    if not args or not isinstance(args[0], torch.Tensor):
        raise CheckpointConfigError(
            "distribute_saved_activations=True needs a tensor as the first argument"
        )
    return args[0]


def check_split_input(args: Sequence[Any]) -> None:
    """Refuse ``args`` whose first item cannot give its storage up to a split (Megatron's
    in-place ``distribute_saved_activations``), before anything runs."""
    if first_tensor(args)._base is not None:
        raise CheckpointConfigError(
            "distribute_saved_activations=True replaces args[0].data by this rank's chunk, but "
            "args[0] is a view of another tensor, whose data would not shrink; pass a tensor "
            "that owns its storage (e.g. x.clone() or Megatron's make_viewless_tensor)"
        )


def gather_chunks(part: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor of ``shape`` again, all-gathered from the group's flat slices
    ``part`` (padding dropped)."""
    return all_gather_cat(part, group)[: shape.numel()].view(shape)


def gather_saved(split: _SplitTensor) -> torch.Tensor:
    """The whole tensor again, all-gathered from the group's slices (padding dropped)."""
    return gather_chunks(split.part, split.shape, split.group)


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return pinned.copy_(tensor.detach(), non_blocking=True)


def _unchanged(kept: _KeptTensor) -> torch.Tensor:
    """The kept tensor, refused if changed in place since it was saved: autograd checks the
    tensors it saves itself, but not those a saved-tensor hook keeps."""
    if kept.tensor._version != kept.version:
        raise CheckpointUsageError(
            f"a tensor of shape {tuple(kept.tensor.shape)} that the checkpoint saved for its "
            f"recompute (an input of the checkpointed function) was modified by an inplace "
            f"operation: it is at version {kept.tensor._version}, expected {kept.version}. The "
            "recompute would compute other values than the forward did; change it only after "
            "backward, or pass the checkpoint a clone"
        )
    return kept.tensor


class InputSaver:
    """Packs saved checkpoint inputs: ``distribute`` splits one tensor across ``group``;
    ``offload`` keeps every saved tensor in (pinned) CPU memory until it is unpacked."""

    def __init__(
        self,
        *,
        distribute: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        offload: bool = False,
    ) -> None:
        # A weak reference: holding the input would keep alive the memory we mean to free.
        self._distribute = None if distribute is None else weakref.ref(distribute)
        self.group = group
        self.offload = offload

    @property
    def packing(self) -> bool:
        """Whether packing changes anything (else inputs are saved as they are)."""
        return self._distribute is not None or self.offload

    @property
    def active(self) -> bool:
        """Deprecated name of :attr:`packing`."""
        warn_deprecated("InputSaver.active", "InputSaver.packing")
        return self.packing

    def pack(self, tensor: torch.Tensor) -> object:
        """What to keep for ``tensor`` until backward."""
        data: torch.Tensor | _SplitTensor = tensor
        if self._distribute is not None and tensor is self._distribute():
            data = split_for_save(tensor, self.group)
        if not self.offload:
            return _KeptTensor(data, data._version) if isinstance(data, torch.Tensor) else data
        if isinstance(data, _SplitTensor):
            return _OffloadedTensor(
                _SplitTensor(_to_cpu(data.part), data.shape, data.group), tensor.device
            )
        return _OffloadedTensor(_to_cpu(data), tensor.device)

    def unpack(self, packed: object) -> torch.Tensor:
        """The saved tensor, on its device again."""
        device = None
        if isinstance(packed, _OffloadedTensor):
            packed, device = packed.data, packed.device
            if isinstance(packed, _SplitTensor):
                packed = _SplitTensor(
                    packed.part.to(device, non_blocking=True), packed.shape, packed.group
                )
        if isinstance(packed, _SplitTensor):
            return gather_saved(packed)
        if isinstance(packed, _KeptTensor):
            return _unchanged(packed)
        assert isinstance(packed, torch.Tensor)
        return packed if device is None else packed.to(device, non_blocking=True)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks applying :meth:`pack` and :meth:`unpack`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
