"""What megatron-core 0.19.2's own code needs to run on CPU gloo ranks in tests (not on CUDA).

Each shim is documented in docs/migrating.md; none is part of rng_tracker's install path:

- ``cuda_means_cpu()``: megatron allocates on ``torch.cuda.current_device()`` (sequence-parallel
  collectives, pipeline p2p buffers, ``use_cpu_initialization=False`` parameters, the router's
  weight move), its schedules make ``torch.zeros(..., device="cuda")`` and a tied embedding's
  copies meet in ``weight.data.cuda()``; inside the block all three name the CPU.
- ``sequence_parallel_spec()``: the local spec's torch LayerNorm wrapper refuses sequence
  parallelism, so SP runs swap it for a torch LayerNorm that marks its parameters
  ``sequence_parallel`` as Megatron's Apex/TE norms do.
- ``CPU_ONLY_CONFIG``: the TransformerConfig fields that turn megatron's fused CUDA kernels off.
- ``destroy_megatron_groups()``: ``parallel_state.destroy_model_parallel()`` forgets groups it
  does not destroy; each gloo group holds threads, so a test that re-initialises many layouts
  destroys them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# TransformerConfig fields that turn off megatron's fused CUDA kernels (none runs on CPU).
CPU_ONLY_CONFIG: dict[str, Any] = {
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
}


class _CudaDeviceIsTheCPU(TorchFunctionMode):
    """Factory calls given ``device="cuda"`` (megatron's schedules) allocate on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_means_cpu() -> Iterator[None]:
    """Within the block ``torch.cuda.current_device()``, ``device="cuda"`` and ``Tensor.cuda()``
    name the CPU."""
    current_device, to_cuda = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        with _CudaDeviceIsTheCPU():
            yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda = current_device, to_cuda


def sequence_parallel_spec(layer: Any, num_layers: int) -> Any:
    """A block of ``num_layers`` of megatron's layer spec ``layer`` whose norms allow sequence
    parallelism (the local spec's WrappedTorchNorm asserts it off)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class SequenceParallelLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
            super().__init__(hidden_size, eps=eps)
            for param in self.parameters():
                param.sequence_parallel = True

    def swap(spec: Any) -> Any:
        if spec is WrappedTorchNorm:
            return SequenceParallelLayerNorm
        if isinstance(spec, ModuleSpec):
            return dataclasses.replace(
                spec, module=swap(spec.module), submodules=swap(spec.submodules)
            )
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            fields = [f.name for f in dataclasses.fields(spec) if f.init]
            return dataclasses.replace(spec, **{f: swap(getattr(spec, f)) for f in fields})
        return spec

    swapped = swap(layer)
    return TransformerBlockSubmodules(
        layer_specs=[swapped] * num_layers, layer_norm=SequenceParallelLayerNorm
    )


def process_groups() -> list[dist.ProcessGroup]:
    """Every live process group (torch has no public list; its registry is the only way)."""
    return list(dist.distributed_c10d._world.pg_map)


def destroy_megatron_groups(ps: Any, before: list[dist.ProcessGroup]) -> None:
    """``ps.destroy_model_parallel()`` and destroy the groups it leaves alive."""
    ps.destroy_model_parallel()
    dist.barrier()  # every rank has finished with Megatron's groups before any closes them
    for group in process_groups():
        if all(group is not g for g in before):
            dist.destroy_process_group(group)
