"""A tensor-parallel transformer layer and a small GPT, every dropout site in its RNG region.

Sites (``embedding``; per layer i of the whole model ``layer.i.attention``,
``layer.i.attention_output``, ``layer.i.mlp_output``) and their regions:

| site | activation | rng_mode="megatron" | rng_mode="invariant" | rng_mode="keyed" |
| --- | --- | --- | --- | --- |
| attention probs | sharded by heads (dim 1) | fork ``model-parallel-rng`` | default stream, ``Chunk(1, tp_rank, tp)`` | keyed site, ``Region`` of (batch, heads, s, s) |
| hidden (after row-parallel), embedding | replicated | default stream | default stream | keyed site, ``Region`` of (s, batch, h) |
| … under sequence parallelism | sharded by sequence (dim 0) | fork ``model-parallel-rng`` | default stream, ``Chunk(0, tp_rank, tp)`` | keyed site, ``Region`` of (s, batch, h) |

In invariant mode every site draws from the replicated default stream with global
indices, so the masks do not depend on the TP or SP degree. In keyed mode every site
draws from :func:`rng_tracker.get_keyed_rng` with the box its activation holds in the
site's logical tensor over the *whole global batch* (TP/SP shard and the microbatch's
place, set by :func:`batch_position`), so the masks depend on neither TP, SP, DP, PP,
microbatches nor recompute; recompute then needs no RNG snapshot at all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from rng_tracker._device_rng import default_generator
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._tracker import MODEL_PARALLEL_RNG, get_rng_tracker
from rng_tracker._validate import checked_int
from rng_tracker.activation_checkpoint import checkpoint
from rng_tracker.errors import ParallelConfigError, RNGConsistencyError
from rng_tracker.kernels import Chunk, Region, bias_dropout_add, dropout
from rng_tracker.parallel._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _tp,
    shard_param,
)
from rng_tracker.parallel._tp_mappings import scatter_to_tp

__all__ = [
    "BatchPosition",
    "GPTConfig",
    "MaskRecord",
    "ParallelTransformerLayer",
    "RNGMode",
    "Recompute",
    "TinyGPT",
    "batch_position",
    "place_masks",
    "record_masks",
]

RNGMode = Literal["megatron", "invariant", "keyed"]
_RNG_MODES = ("megatron", "invariant", "keyed")
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
        if self.rng_mode not in _RNG_MODES:
            raise ParallelConfigError(
                f"rng_mode must be 'megatron', 'invariant' or 'keyed', got {self.rng_mode!r}"
            )
        if self.recompute not in ("none", "full", "selective"):
            raise ParallelConfigError(
                f"recompute must be 'none', 'full' or 'selective', got {self.recompute!r}"
            )


@dataclass(frozen=True, slots=True)
class BatchPosition:
    """A microbatch holds samples [sample_offset, sample_offset + b) of a global batch."""

    sample_offset: int
    global_batch: int


_POSITION: BatchPosition | None = None


@contextlib.contextmanager
def batch_position(sample_offset: int, global_batch: int) -> Iterator[BatchPosition]:
    """Run the body's forward as the microbatch at ``sample_offset`` of a ``global_batch``.

    The trainer enters it around each microbatch's forward on each data-parallel rank:
    keyed dropout sites then draw the masks of those samples of the whole global batch.
    Without it a forward's local batch is taken to be the whole global batch. Recompute
    does not need it: layers capture the position at forward time.
    """
    global _POSITION
    position = BatchPosition(
        checked_int(sample_offset, "sample_offset", type_error=ParallelConfigError, minimum=0),
        checked_int(global_batch, "global_batch", type_error=ParallelConfigError, minimum=1),
    )
    if position.sample_offset >= position.global_batch:
        raise ParallelConfigError(
            f"sample_offset {position.sample_offset} must be below global_batch {position.global_batch}"
        )
    previous, _POSITION = _POSITION, position
    try:
        yield position
    finally:
        _POSITION = previous


def _position(batch: int) -> BatchPosition:
    """The position of a local batch of ``batch`` samples (the context's, else the whole batch)."""
    position = _POSITION if _POSITION is not None else BatchPosition(0, batch)
    if position.sample_offset + batch > position.global_batch:
        raise ParallelConfigError(
            f"a microbatch of {batch} samples at offset {position.sample_offset} does not fit a "
            f"global batch of {position.global_batch}; fix batch_position(...)"
        )
    return position


class MaskRecord(tuple):
    """(site, local keep mask, TP ``Chunk`` or None) of one dropout call.

    ``region`` places the mask in the site's logical tensor over the whole global batch
    (TP/SP shard and batch position), in every rng mode, so masks can be gathered per
    sample across layouts; ``batch_dim`` is that tensor's sample dim.
    """

    region: Region
    batch_dim: int

    @property
    def site(self) -> str:
        return self[0]

    @property
    def mask(self) -> torch.Tensor:
        return self[1]

    @property
    def shard(self) -> Chunk | None:
        return self[2]


_PROBE: list[MaskRecord] | None = None


@contextlib.contextmanager
def record_masks() -> Iterator[list[MaskRecord]]:
    """Record a :class:`MaskRecord` of every dropout site run in the body (recompute included).

    The probe redraws each mask through the same kernel, from a copy of the generator the
    site is about to use (or, in keyed mode, from the site's seed words), so it sees
    exactly the site's mask without changing it.
    """
    global _PROBE
    previous, _PROBE = _PROBE, []
    try:
        yield _PROBE
    finally:
        _PROBE = previous


def place_masks(records: Iterable[MaskRecord]) -> dict[str, torch.Tensor]:
    """Each site's recorded masks placed in its logical tensor over the whole global batch.

    Returns int8 CPU tensors: 1 kept, 0 dropped, -1 where no record covers the element.
    Records of one site that overlap (TP replicas, recompute) must agree, else
    :class:`RNGConsistencyError`. Gather the records of all ranks first to see the whole batch.
    """
    placed: dict[str, torch.Tensor] = {}
    for record in records:
        region = record.region
        logical = placed.get(record.site)
        if logical is None:
            logical = placed[record.site] = torch.full(region.global_shape, -1, dtype=torch.int8)
        box = logical[
            tuple(slice(o, o + n) for o, n in zip(region.offset, record.mask.shape, strict=True))
        ]
        mask = record.mask.to(device="cpu", dtype=torch.int8)
        if bool(((box != -1) & (box != mask)).any()):
            raise RNGConsistencyError(
                f"two records of site {record.site!r} draw different masks for the same elements "
                f"(box at {region.offset})"
            )
        box.copy_(mask)
    return placed


def _region(
    shape: torch.Size, shard: Chunk | None, batch_dim: int, position: BatchPosition
) -> Region:
    """The box a local activation of ``shape`` holds in its site's logical tensor."""
    global_shape, offset = list(shape), [0] * len(shape)
    if shard is not None:
        global_shape[shard.dim] *= shard.count
        offset[shard.dim] = shard.index * shape[shard.dim]
    global_shape[batch_dim], offset[batch_dim] = position.global_batch, position.sample_offset
    return Region(tuple(global_shape), tuple(offset))


def _site(
    name: str,
    x: torch.Tensor,
    p: float,
    *,
    sharded_dim: int | None,
    group: dist.ProcessGroup | None,
    rng_mode: RNGMode,
    training: bool,
    batch_dim: int = 1,
    position: BatchPosition | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One dropout site, run in the RNG region its sharding and ``rng_mode`` call for.

    ``batch_dim`` is x's batch dim; ``position`` the microbatch's place in the global batch
    (default: the current :func:`batch_position`).
    """
    if position is None:
        position = _position(x.shape[batch_dim])
    tp_rank, tp = _tp(group)
    placement = None  # the TP/SP shard of x (an even split)
    if sharded_dim is not None and tp > 1:
        placement = Chunk(sharded_dim, tp_rank, tp, extent=x.shape[sharded_dim] * tp)
    if rng_mode == "keyed" and training and p > 0:
        return _keyed_site(name, x, p, placement, batch_dim, position, training, bias, residual)
    region, shard = contextlib.nullcontext(), placement
    if placement is not None and rng_mode == "megatron":
        region = get_rng_tracker(x.device).fork(MODEL_PARALLEL_RNG)
        shard = None  # megatron mode draws local indices from a per-rank stream
    with region:
        if _PROBE is not None and training and p > 0:
            twin = torch.Generator(device=x.device)
            twin.set_state(default_generator(x.device).get_state())
            region = _region(x.shape, placement, batch_dim, position)
            _probe(name, x, p, shard, region, batch_dim, shard=shard, generator=twin)
        if residual is None:
            return dropout(x, p, training=training, shard=shard)
        return bias_dropout_add(x, bias, residual, p, training=training, shard=shard)


def _probe(
    name: str,
    x: torch.Tensor,
    p: float,
    placement: Chunk | None,
    region: Region,
    batch_dim: int,
    **draw: object,
) -> None:
    """Record the mask the site is about to draw (``draw``: the kernel's shard and randomness)."""
    record = MaskRecord((name, dropout(torch.ones_like(x), p, **draw) != 0, placement))
    record.region, record.batch_dim = region, batch_dim
    _PROBE.append(record)


def _keyed_site(
    name: str,
    x: torch.Tensor,
    p: float,
    shard: Chunk | None,
    batch_dim: int,
    position: BatchPosition,
    training: bool,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """A keyed site (training, p > 0): no generator is read or written, the mask is
    (seed, step, site, box)'s."""
    rng = get_keyed_rng(x.device)
    rng.register(name)
    seed = rng.seed_tensor(name)  # (4,) [key, 0, site id, step]
    region = _region(x.shape, shard, batch_dim, position)
    if _PROBE is not None:
        _probe(name, x, p, shard, region, batch_dim, shard=region, seed=seed)
    if residual is None:
        return dropout(x, p, shard=region, seed=seed)
    return bias_dropout_add(x, bias, residual, p, shard=region, seed=seed)


class _LayerNorm(torch.nn.LayerNorm):
    def __init__(
        self, hidden: int, group: dist.ProcessGroup | None, sequence_parallel: bool
    ) -> None:
        super().__init__(hidden)
        for param in self.parameters():
            param.tp_shard_dim = None
            param.sequence_parallel = sequence_parallel and group is not None


def _checkpoint(rng_mode: RNGMode, function: Any, *args: Any) -> Any:
    """Checkpoint ``function``: keyed sites need no RNG snapshot, the other modes replay one."""
    if rng_mode == "keyed":
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=False
        )
    return checkpoint(function, *args)


class ParallelTransformerLayer(torch.nn.Module):
    """Pre-LN block: attention (heads split over TP) and MLP (ffn split over TP).

    Input and output are (seq, batch, hidden), or (seq/tp, batch, hidden) under sequence
    parallelism. ``recompute``: "full" checkpoints the whole layer, "selective" only the
    core attention (its dropout replays exactly either way). ``layer_index`` is the
    layer's place in the whole model (not in a pipeline stage): it names its dropout sites.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        init: torch.Generator,
        layer_index: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _, tp = _tp(group)
        if config.heads % tp or config.hidden % config.heads:
            raise ParallelConfigError(
                f"heads={config.heads} must divide by tp={tp} and divide hidden={config.hidden}"
            )
        self.config, self.group = config, group
        self.layer_index = checked_int(
            layer_index, "layer_index", type_error=ParallelConfigError, minimum=0
        )
        self.sites = tuple(
            f"layer.{self.layer_index}.{site}"
            for site in ("attention", "attention_output", "mlp_output")
        )
        self.local_heads, self.head_dim = config.heads // tp, config.hidden // config.heads
        sequence_parallel = config.sequence_parallel
        h = config.hidden
        parallel: dict[str, Any] = {
            "init": init,
            "group": group,
            "sequence_parallel": sequence_parallel,
        }
        self.ln1 = _LayerNorm(h, group, sequence_parallel)
        self.qkv = ColumnParallelLinear(h, 3 * h, **parallel)  # rows: (heads, 3, d)
        self.proj = RowParallelLinear(h, h, skip_bias_add=True, **parallel)
        self.ln2 = _LayerNorm(h, group, sequence_parallel)
        self.fc1 = ColumnParallelLinear(h, config.ffn, **parallel)
        self.fc2 = RowParallelLinear(config.ffn, h, skip_bias_add=True, **parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position = _position(x.shape[1])  # read now: a recompute runs outside batch_position
        if self.config.recompute == "full" and self.training:
            return _checkpoint(self.config.rng_mode, self._forward, x, position)
        return self._forward(x, position)

    def _dropout(
        self,
        name: str,
        x: torch.Tensor,
        p: float,
        sharded_dim: int | None,
        batch_dim: int,
        position: BatchPosition,
        **kw: torch.Tensor | None,
    ) -> torch.Tensor:
        return _site(
            name,
            x,
            p,
            sharded_dim=sharded_dim,
            batch_dim=batch_dim,
            position=position,
            group=self.group,
            rng_mode=self.config.rng_mode,
            training=self.training,
            **kw,
        )

    def _forward(self, x: torch.Tensor, position: BatchPosition) -> torch.Tensor:
        seq_dim = 0 if self.config.sequence_parallel else None
        _, attention_output, mlp_output = self.sites
        qkv = self.qkv(self.ln1(x))  # (s, b, 3 h/tp)
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).unbind(
            3
        )  # each (s, b, heads/tp, d)
        if self.config.recompute == "selective" and self.training:
            attn = _checkpoint(self.config.rng_mode, self._attention, q, k, v, position)
        else:
            attn = self._attention(q, k, v, position)
        out, bias = self.proj(attn)  # (s, b, h) replicated, or (s/tp, b, h) under SP
        hidden_p = self.config.hidden_dropout
        x = self._dropout(
            attention_output, out, hidden_p, seq_dim, 1, position, bias=bias, residual=x
        )
        out, bias = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self._dropout(mlp_output, out, hidden_p, seq_dim, 1, position, bias=bias, residual=x)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: BatchPosition
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (b, heads/tp, s, d)
        s = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (b, heads/tp, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        probs = self._dropout(self.sites[0], probs, self.config.attention_dropout, 1, 0, position)
        context = probs @ v  # (b, heads/tp, s, d)
        return context.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)  # (s, b, heads/tp * d)


class TinyGPT(torch.nn.Module):
    """A small GPT over the TP group ``group`` (None: no tensor parallelism).

    In keyed mode its sites are registered with :func:`rng_tracker.get_keyed_rng` when it
    is built, so a site-id collision is reported before the first step.
    """

    def __init__(self, config: GPTConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.group = config, group
        init = torch.Generator().manual_seed(config.init_seed)
        self.embed = VocabParallelEmbedding(config.vocab, config.hidden, init=init, group=group)
        self.pos = shard_param(
            torch.randn(config.seq_len, config.hidden, generator=init) * 0.02, None, group
        )
        self.layers = torch.nn.ModuleList(
            ParallelTransformerLayer(config, init=init, layer_index=i, group=group)
            for i in range(config.layers)
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
        if config.rng_mode == "keyed":
            rng = get_keyed_rng()
            for name in self.sites:
                rng.register(name)

    @property
    def sites(self) -> tuple[str, ...]:
        """The global names of the model's dropout sites, in forward order."""
        return ("embedding", *(name for layer in self.layers for name in layer.sites))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding and its dropout: tokens (batch, seq) -> (s, b, h), or (s/tp, b, h) under SP."""
        s = tokens.shape[1]
        x = self.embed(tokens.t()) + self.pos[:s, None, :]  # (s, b, h) replicated
        sequence_parallel = self.config.sequence_parallel and self.group is not None
        if sequence_parallel:
            x = scatter_to_tp(x, self.group, 0)  # (s/tp, b, h)
        return _site(
            "embedding",
            x,
            self.config.embedding_dropout,
            sharded_dim=0 if sequence_parallel else None,
            batch_dim=1,
            position=_position(x.shape[1]),
            group=self.group,
            rng_mode=self.config.rng_mode,
            training=self.training,
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: the last layer's output -> logits (s, b, vocab)."""
        self.last_hidden = x.detach()
        return self.head(self.ln_f(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (seq, batch, vocab) of tokens (batch, seq)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.logits(x)  # (s, b, vocab)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; targets (batch, seq)."""
        logits = self(tokens)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.t().reshape(-1)
        )
