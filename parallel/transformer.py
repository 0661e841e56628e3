"""A tensor-parallel transformer layer and a small GPT, every dropout site in its RNG region.

Sites and their regions:

| site | activation | rng_mode="megatron" | rng_mode="invariant" |
| --- | --- | --- | --- |
| attention probs | sharded by heads (dim 1) | fork ``model-parallel-rng`` | default stream, ``Shard(1, tp_rank, tp)`` |
| hidden (after row-parallel), embedding | replicated | default stream | default stream |
| … under sequence parallelism | sharded by sequence (dim 0) | fork ``model-parallel-rng`` | default stream, ``Shard(0, tp_rank, tp)`` |

In invariant mode every site draws from the replicated default stream with global
indices, so the masks do not depend on the TP or SP degree.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rng_tracker.checkpoint import checkpoint
from rng_tracker.device_rng import default_generator
from rng_tracker.errors import ParallelConfigError
from rng_tracker.kernels import Shard, bias_dropout_add, dropout
from rng_tracker.parallel.collectives import scatter_to_tp
from rng_tracker.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_param,
)
from rng_tracker.tracker import MODEL_PARALLEL_RNG, get_rng_tracker

__all__ = [
    "GPTConfig",
    "ParallelTransformerLayer",
    "RNGMode",
    "Recompute",
    "TinyGPT",
    "record_masks",
]

RNGMode = Literal["megatron", "invariant"]
Recompute = Literal["none", "full", "selective"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape and randomness of :class:`TinyGPT`."""

    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256
    seq_len: int = 32
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    embedding_dropout: float = 0.1
    rng_mode: RNGMode = "megatron"
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    init_seed: int = 0

    def __post_init__(self) -> None:
        if self.rng_mode not in ("megatron", "invariant"):
            raise ParallelConfigError(
                f"rng_mode must be 'megatron' or 'invariant', got {self.rng_mode!r}"
            )
        if self.recompute not in ("none", "full", "selective"):
            raise ParallelConfigError(
                f"recompute must be 'none', 'full' or 'selective', got {self.recompute!r}"
            )


_PROBE: list[tuple[str, torch.Tensor, Shard | None]] | None = None


@contextlib.contextmanager
def record_masks() -> Iterator[list[tuple[str, torch.Tensor, Shard | None]]]:
    """Record (site, local keep mask, shard) of every dropout site run in the body.

    The probe redraws each mask from a copy of the generator the site is about to use,
    through the same kernel, so it sees exactly the site's mask without changing it.
    """
    global _PROBE
    previous, _PROBE = _PROBE, []
    try:
        yield _PROBE
    finally:
        _PROBE = previous


def _tp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _site(
    name: str,
    x: torch.Tensor,
    p: float,
    *,
    sharded_dim: int | None,
    group: dist.ProcessGroup | None,
    rng_mode: RNGMode,
    training: bool,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One dropout site, run in the RNG region its sharding and ``rng_mode`` call for."""
    tp_rank, tp = _tp(group)
    sharded = sharded_dim is not None and tp > 1
    region = contextlib.nullcontext()
    shard = None
    if sharded and rng_mode == "megatron":
        region = get_rng_tracker(x.device).fork(MODEL_PARALLEL_RNG)
    elif sharded:
        shard = Shard(sharded_dim, tp_rank, tp)
    with region:
        if _PROBE is not None and training and p > 0:
            twin = torch.Generator(device=x.device)
            twin.set_state(default_generator(x.device).get_state())
            _PROBE.append(
                (name, dropout(torch.ones_like(x), p, shard=shard, generator=twin) != 0, shard)
            )
        if residual is None:
            return dropout(x, p, training=training, shard=shard)
        return bias_dropout_add(x, bias, residual, p, training=training, shard=shard)


class _LayerNorm(torch.nn.LayerNorm):
    def __init__(
        self, hidden: int, group: dist.ProcessGroup | None, sequence_parallel: bool
    ) -> None:
        super().__init__(hidden)
        for param in self.parameters():
            param.tp_shard_dim = None
            param.sequence_parallel = sequence_parallel and group is not None


class ParallelTransformerLayer(torch.nn.Module):
    """Pre-LN block: attention (heads split over TP) and MLP (ffn split over TP).

    Input and output are (seq, batch, hidden), or (seq/tp, batch, hidden) under sequence
    parallelism. ``recompute``: "full" checkpoints the whole layer, "selective" only the
    core attention (its dropout replays exactly either way).
    """

    def __init__(
        self, config: GPTConfig, *, init: torch.Generator, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        _, tp = _tp(group)
        if config.heads % tp or config.hidden % config.heads:
            raise ParallelConfigError(
                f"heads={config.heads} must divide by tp={tp} and divide hidden={config.hidden}"
            )
        self.config, self.group = config, group
        self.local_heads, self.head_dim = config.heads // tp, config.hidden // config.heads
        sp = config.sequence_parallel
        h = config.hidden
        self.ln1 = _LayerNorm(h, group, sp)
        self.qkv = ColumnParallelLinear(
            h, 3 * h, init=init, group=group, sequence_parallel=sp
        )  # rows: (heads, 3, d)
        self.proj = RowParallelLinear(
            h, h, init=init, group=group, skip_bias_add=True, sequence_parallel=sp
        )
        self.ln2 = _LayerNorm(h, group, sp)
        self.fc1 = ColumnParallelLinear(h, config.ffn, init=init, group=group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(
            config.ffn, h, init=init, group=group, skip_bias_add=True, sequence_parallel=sp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.recompute == "full" and self.training:
            return checkpoint(self._forward, x)
        return self._forward(x)

    def _dropout(
        self,
        name: str,
        x: torch.Tensor,
        p: float,
        sharded_dim: int | None,
        **kw: torch.Tensor | None,
    ) -> torch.Tensor:
        return _site(
            name,
            x,
            p,
            sharded_dim=sharded_dim,
            group=self.group,
            rng_mode=self.config.rng_mode,
            training=self.training,
            **kw,
        )

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_dim = 0 if self.config.sequence_parallel else None
        qkv = self.qkv(self.ln1(x))  # (s, b, 3 h/tp)
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).unbind(
            3
        )  # each (s, b, heads/tp, d)
        if self.config.recompute == "selective" and self.training:
            attn = checkpoint(self._attention, q, k, v)
        else:
            attn = self._attention(q, k, v)
        out, bias = self.proj(attn)  # (s, b, h) replicated, or (s/tp, b, h) under SP
        x = self._dropout("hidden", out, self.config.hidden_dropout, seq_dim, bias=bias, residual=x)
        out, bias = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self._dropout(
            "hidden", out, self.config.hidden_dropout, seq_dim, bias=bias, residual=x
        )

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (b, heads/tp, s, d)
        s = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (b, heads/tp, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        probs = self._dropout("attention", probs, self.config.attention_dropout, 1)
        context = probs @ v  # (b, heads/tp, s, d)
        return context.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)  # (s, b, heads/tp * d)


class TinyGPT(torch.nn.Module):
    """A small GPT over the TP group ``group`` (None: no tensor parallelism)."""

    def __init__(self, config: GPTConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.group = config, group
        init = torch.Generator().manual_seed(config.init_seed)
        self.embed = VocabParallelEmbedding(config.vocab, config.hidden, init=init, group=group)
        self.pos = shard_param(
            torch.randn(config.seq_len, config.hidden, generator=init) * 0.02, None, group
        )
        self.layers = torch.nn.ModuleList(
            ParallelTransformerLayer(config, init=init, group=group) for _ in range(config.layers)
        )
        self.ln_f = _LayerNorm(config.hidden, group, config.sequence_parallel)
        self.head = ColumnParallelLinear(
            config.hidden,
            config.vocab,
            init=init,
            group=group,
            bias=False,
            gather_output=True,
            sequence_parallel=config.sequence_parallel,
        )
        self.last_hidden: torch.Tensor | None = (
            None  # the final layer's output, for consistency checks
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (seq, batch, vocab) of tokens (batch, seq)."""
        s = tokens.shape[1]
        x = self.embed(tokens.t()) + self.pos[:s, None, :]  # (s, b, h) replicated
        sp = self.config.sequence_parallel and self.group is not None
        if sp:
            x = scatter_to_tp(x, self.group, 0)  # (s/tp, b, h)
        x = _site(
            "embedding",
            x,
            self.config.embedding_dropout,
            sharded_dim=0 if sp else None,
            group=self.group,
            rng_mode=self.config.rng_mode,
            training=self.training,
        )
        for layer in self.layers:
            x = layer(x)
        self.last_hidden = x.detach()
        return self.head(self.ln_f(x))  # (s, b, vocab)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; targets (batch, seq)."""
        logits = self(tokens)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.t().reshape(-1)
        )
