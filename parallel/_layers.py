"""Tensor-parallel layers: column- and row-parallel linears and a vocab-parallel embedding.

Each layer draws its *logical* weight from the ``init`` generator and keeps its shard, so
every TP degree holds the same logical model (a run can resume on another layout).
Parameters carry two attributes used by training code:

- ``tp_shard_dim``: the dim along which the parameter is sharded over TP (None: replicated);
- ``sequence_parallel``: its gradient is partial per TP rank under sequence parallelism
  and must be summed over the TP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rng_tracker._deprecation import warn_deprecated
from rng_tracker._validate import checked_flag, checked_instance, checked_size
from rng_tracker.errors import ParallelConfigError
from rng_tracker.parallel._tp_mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    tp_rank_and_size,
)


def shard_param(
    full: torch.Tensor,
    dim: int | None,
    group: dist.ProcessGroup | None,
    *,
    sequence_parallel: bool = False,
    sp: bool | None = None,
) -> torch.nn.Parameter:
    """A parameter holding this rank's chunk of ``full`` along ``dim`` (None: all of it).

    ``sequence_parallel`` marks its gradient as partial per TP rank (see the module
    docstring); ``sp`` is its deprecated old name.
    """
    if sp is not None:
        warn_deprecated("shard_param(sp=...)", "sequence_parallel=...")
        sequence_parallel = sp
    rank, size = tp_rank_and_size(group)
    if dim is not None and full.shape[dim] % size:
        raise ParallelConfigError(
            f"dim {dim} of size {full.shape[dim]} does not divide by the TP size {size}"
        )
    data = full if dim is None else full.chunk(size, dim=dim)[rank]
    param = torch.nn.Parameter(data.contiguous().clone())
    param.tp_shard_dim = dim
    param.sequence_parallel = sequence_parallel
    return param


def _check_layer(features: dict[str, object], init: object, flags: dict[str, object]) -> None:
    """Refuse sizes that are not positive ints, an ``init`` that is not a generator and flags
    that are not bools, before anything is drawn from ``init``."""
    for name, value in features.items():
        checked_size(value, name)
    checked_instance(
        init, torch.Generator, "init must be the torch.Generator the logical weights are drawn from"
    )
    for name, value in flags.items():
        checked_flag(value, name)


def _init_weight(out_features: int, in_features: int, init: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(out_features, in_features).uniform_(-bound, bound, generator=init)


class ColumnParallelLinear(torch.nn.Module):
    """y = x Wᵀ + b with W split by output features: (…, in) replicated → (…, out/tp) sharded.

    Under sequence parallelism the input is a sequence shard (dim 0) and is all-gathered.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init: torch.Generator,
        group: dist.ProcessGroup | None = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        _check_layer(
            {"in_features": in_features, "out_features": out_features},
            init,
            {"bias": bias, "gather_output": gather_output, "sequence_parallel": sequence_parallel},
        )
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = shard_param(_init_weight(out_features, in_features, init), 0, group)
        self.bias = shard_param(torch.zeros(out_features), 0, group) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            x = (
                gather_from_sp(x, self.group, 0)
                if self.sequence_parallel
                else copy_to_tp(x, self.group)
            )
        y = F.linear(x, self.weight, self.bias)  # (…, out/tp)
        if self.gather_output and self.group is not None:
            y = gather_from_tp(y, self.group, -1)
        return y


class RowParallelLinear(torch.nn.Module):
    """y = x Wᵀ (+ b) with W split by input features: (…, in/tp) sharded → (…, out) summed over TP.

    Under sequence parallelism the sum is a reduce-scatter onto sequence shards. With
    ``skip_bias_add`` the bias is returned instead of added, for a fused bias-dropout-add.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init: torch.Generator,
        group: dist.ProcessGroup | None = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        _check_layer(
            {"in_features": in_features, "out_features": out_features},
            init,
            {"bias": bias, "skip_bias_add": skip_bias_add, "sequence_parallel": sequence_parallel},
        )
        super().__init__()
        self.group = group
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = shard_param(_init_weight(out_features, in_features, init), 1, group)
        self.bias = (
            shard_param(torch.zeros(out_features), None, group, sequence_parallel=sequence_parallel)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = F.linear(x, self.weight)  # (…, out) partial sums
        if self.group is not None:
            y = (
                reduce_scatter_to_sp(y, self.group, 0)
                if self.sequence_parallel
                else reduce_from_tp(y, self.group)
            )
        if self.skip_bias_add:
            return y, self.bias
        return (y if self.bias is None else y + self.bias), None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary split over TP; each rank looks up its rows, then a sum.

    Without TP an id outside the vocabulary raises, as ``F.embedding`` (and Megatron at TP=1)
    does; with TP a rank sees only its rows and counts other ids as another rank's, as
    Megatron's does (checking would cost a collective per forward)."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        *,
        init: torch.Generator,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_layer({"vocab": vocab, "hidden": hidden}, init, {})
        super().__init__()
        self.group = group
        rank, size = tp_rank_and_size(group)
        if vocab % size:
            raise ParallelConfigError(f"vocab {vocab} does not divide by the TP size {size}")
        self.start, self.end = rank * vocab // size, (rank + 1) * vocab // size
        self.tp = size
        self.weight = shard_param(torch.randn(vocab, hidden, generator=init) * 0.02, 0, group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return y if self.group is None else reduce_from_tp(y, self.group)
