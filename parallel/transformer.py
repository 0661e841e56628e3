"""A tensor-parallel transformer layer and a small GPT, every dropout site in its RNG region.

Sites (``embedding``; per layer i of the whole model ``layer.i.attention``,
``layer.i.attention_output``, ``layer.i.mlp_output``) run through
:func:`rng_tracker.parallel.sites.site_dropout`, which draws what each activation's layout and
``GPTConfig.rng_mode`` call for: attention probabilities are sharded by heads (dim 1), the
hidden states after a row-parallel layer and the embedding are replicated, or sharded by
sequence (dim 0) under sequence parallelism. The model reads the microbatch's place
(:func:`~rng_tracker.parallel.sites.batch_position`) at forward time and carries it into
recompute.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from rng_tracker._deprecation import deprecated_names
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._validate import checked_flag, checked_int, checked_size
from rng_tracker.activation_checkpoint import checkpoint
from rng_tracker.errors import (
    ArgumentTypeError,
    InvalidSeedError,
    InvalidSeedTypeError,
    ParallelConfigError,
    ParallelConfigTypeError,
)
from rng_tracker.parallel._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_param,
)
from rng_tracker.parallel._tp_mappings import scatter_to_tp, tp_rank_and_size
from rng_tracker.parallel.sites import (
    BatchPosition,
    RNGMode,
    current_batch_position,
    site_dropout,
)

__all__ = [
    "GPTConfig",
    "ParallelTransformerLayer",
    "Recompute",
    "TinyGPT",
]

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
        for name in ("vocab", "hidden", "heads", "layers", "ffn", "seq_len"):
            checked_size(getattr(self, name), f"GPTConfig.{name}")
        if self.hidden % self.heads:
            raise ParallelConfigError(
                f"GPTConfig.heads={self.heads} must divide hidden={self.hidden} (each head gets "
                "hidden / heads features)"
            )
        for name in ("attention_dropout", "hidden_dropout", "embedding_dropout"):
            _probability(f"GPTConfig.{name}", getattr(self, name))
        checked_flag(
            self.sequence_parallel,
            "GPTConfig.sequence_parallel",
            type_error=ParallelConfigTypeError,
        )
        checked_int(
            self.init_seed,
            "GPTConfig.init_seed",
            type_error=InvalidSeedTypeError,
            value_error=InvalidSeedError,
            minimum=0,
            maximum=2**64 - 1,
        )
        if self.rng_mode not in get_args(RNGMode):
            raise ParallelConfigError(
                f"rng_mode must be 'megatron', 'invariant' or 'keyed', got {self.rng_mode!r}"
            )
        if self.recompute not in get_args(Recompute):
            raise ParallelConfigError(
                f"recompute must be 'none', 'full' or 'selective', got {self.recompute!r}"
            )


def _probability(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParallelConfigTypeError(
            f"{what} must be a float in [0, 1], got {type(value).__name__} {value!r}"
        )
    if not 0.0 <= value <= 1.0:
        raise ParallelConfigError(
            f"{what} is a dropout probability: it must be in [0, 1], got {value}"
        )


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
        _, tp = tp_rank_and_size(group)
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
        position = None  # site_dropout reads it where a mask needs it
        config = self.config
        if (
            config.rng_mode == "keyed"
            and self.training
            and config.attention_dropout + config.hidden_dropout > 0
        ):
            position = current_batch_position(x.shape[1])  # now: recompute runs outside it
        if config.recompute == "full" and self.training:
            return _checkpoint(config.rng_mode, self._forward, x, position)
        return self._forward(x, position)

    def _dropout(
        self,
        name: str,
        x: torch.Tensor,
        p: float,
        sharded_dim: int | None,
        batch_dim: int,
        position: BatchPosition | None,
        **kw: torch.Tensor | None,
    ) -> torch.Tensor:
        return site_dropout(
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

    def _forward(self, x: torch.Tensor, position: BatchPosition | None) -> torch.Tensor:
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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: BatchPosition | None
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
        if not isinstance(config, GPTConfig):
            raise ArgumentTypeError(f"config must be a GPTConfig, got {type(config).__name__}")
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
        return site_dropout(
            "embedding",
            x,
            self.config.embedding_dropout,
            sharded_dim=0 if sequence_parallel else None,
            batch_dim=1,
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


# Names of 0.1 that live in rng_tracker.parallel.sites now (the dropout-site policy that users'
# models call too); they resolve, with a warning, until 0.3.
__getattr__ = deprecated_names(
    __name__,
    {
        name: f"rng_tracker.parallel.sites:{name}"
        for name in ("MaskRecord", "batch_position", "place_masks", "record_masks")
    },
)
