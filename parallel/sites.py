"""Dropout sites: which randomness a model's dropout call draws, given how its activation is laid
out over tensor parallelism.

A *site* is a named dropout call (``"layer.3.attention"``). :func:`site_dropout` runs one in the
region its layout and the run's ``rng_mode`` call for, so the reference transformer
(:class:`~rng_tracker.parallel.transformer.TinyGPT`) and a user's own model place their sites by
one rule:

| activation | rng_mode="megatron" | rng_mode="invariant" | rng_mode="keyed" |
| --- | --- | --- | --- |
| sharded over TP along ``sharded_dim`` (attention heads; sequence under SP) | fork ``model-parallel-rng`` (differs per TP rank) | default stream, ``Chunk(sharded_dim, tp_rank, tp)`` | keyed site, ``Region`` of the logical tensor |
| replicated over TP (``sharded_dim=None``: after a row-parallel all-reduce, the embedding) | default stream | default stream | keyed site, ``Region`` of the logical tensor |

In invariant mode every site draws from the replicated default stream with global indices, so
the masks do not depend on the TP or SP degree. In keyed mode every site draws from
:func:`rng_tracker.get_keyed_rng` with the box its activation holds in the site's logical tensor
over the *whole global batch* (TP/SP shard and the microbatch's place, set by
:func:`batch_position`), so the masks depend on neither TP, SP, DP, PP, microbatches nor
recompute; recompute then needs no RNG snapshot at all. :func:`record_masks` probes every site's
mask and :func:`place_masks` assembles the records in the logical tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from rng_tracker._batch_position import (
    ENTER_A_POSITION,
    BatchPosition,
    assumed_batch_position,
    batch_position,
    box_in_batch,
    current_batch_position,
    fitting,
    required_position,
)
from rng_tracker._device_rng import default_generator
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._streams import MODEL_PARALLEL_RNG
from rng_tracker._tracker import get_rng_tracker
from rng_tracker._validate import checked_dim, checked_flag
from rng_tracker.errors import (
    ArgumentTypeError,
    KernelInputTypeError,
    KeyedTypeError,
    KeyedUnseededError,
    ParallelConfigError,
    ParallelConfigTypeError,
    RNGConsistencyError,
    SiteIdError,
)
from rng_tracker.kernels import Chunk, Region, bias_dropout_add, dropout
from rng_tracker.kernels.reference import check_p
from rng_tracker.parallel._tp_mappings import tp_rank_and_size

__all__ = [
    "BatchPosition",
    "MaskRecord",
    "RNGMode",
    "batch_position",
    "current_batch_position",
    "place_masks",
    "record_masks",
    "site_dropout",
]

RNGMode = Literal["megatron", "invariant", "keyed"]
_RNG_MODES = get_args(RNGMode)


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


# Process-wide, not per thread: a recompute may run in autograd's device thread (CUDA), and
# the probe must record its masks too.
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
    if not isinstance(records, Iterable) or isinstance(records, MaskRecord):
        raise ArgumentTypeError(
            f"records must be an iterable of MaskRecords (what record_masks() yields, gathered "
            f"from every rank), got {type(records).__name__}"
        )
    placed: dict[str, torch.Tensor] = {}
    for record in records:
        if not isinstance(record, MaskRecord):
            raise ArgumentTypeError(
                f"records must be MaskRecords (from record_masks()), got {type(record).__name__}"
            )
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
    split = None if shard is None else (shard.dim, shard.index, shard.count)
    return Region(*box_in_batch(shape, batch_dim, position, split))


def _check_site_options(
    site: object,
    x: object,
    rng_mode: object,
    sharded_dim: object,
    batch_dim: object,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> tuple[int | None, int]:
    """The checked (sharded_dim, batch_dim) of a site's call, after every check of its options."""
    if not isinstance(site, str):
        raise KeyedTypeError(
            f"site must be a str (a stable global name), got {type(site).__name__} {site!r}"
        )
    if not site:
        raise SiteIdError("site must not be empty; use a stable global name")
    if not isinstance(x, torch.Tensor):
        raise KernelInputTypeError(f"x must be a tensor, got {type(x).__name__}")
    if rng_mode not in _RNG_MODES:
        raise ParallelConfigError(
            f"rng_mode must be 'megatron', 'invariant' or 'keyed', got {rng_mode!r}"
        )
    if batch_dim is None:
        raise ParallelConfigTypeError("batch_dim must be an int (x's sample dim), got None")
    dims = []
    for name, dim in (("sharded_dim", sharded_dim), ("batch_dim", batch_dim)):
        if dim is not None:
            dim = checked_dim(
                dim,
                name,
                x.shape,
                type_error=ParallelConfigTypeError,
                value_error=ParallelConfigError,
            )
        dims.append(dim)
    if dims[0] == dims[1]:
        raise ParallelConfigError(
            f"sharded_dim={sharded_dim} and batch_dim={batch_dim} are the same dim of x (shape "
            f"{tuple(x.shape)}): a TP shard along the sample dim has no place per sample; pass "
            "x's sample dim as batch_dim and the dim TP (or SP) splits as sharded_dim"
        )
    if bias is not None and residual is None:
        raise ParallelConfigError(
            "bias= is added by the fused bias-dropout-add, which needs residual= too; add the "
            "bias to x yourself for a plain dropout"
        )
    return dims[0], dims[1]


def site_dropout(
    site: str,
    x: torch.Tensor,
    p: float,
    *,
    rng_mode: RNGMode,
    sharded_dim: int | None = None,
    group: dist.ProcessGroup | None = None,
    batch_dim: int = 1,
    position: BatchPosition | None = None,
    training: bool = True,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dropout at the site named ``site``, drawing what its layout and ``rng_mode`` call for.

    ``x`` is this rank's activation: sharded over the TP group ``group`` along ``sharded_dim``
    (an even split), or replicated over it (``sharded_dim=None``, or ``group=None``: no TP).
    ``batch_dim`` is x's sample dim, another dim than ``sharded_dim``; ``position`` the
    microbatch's place in the global batch (default: :func:`current_batch_position`, which a
    keyed site requires where several data-parallel ranks or microbatches run: their rows of
    the global batch are never guessed). With ``residual`` (and ``bias``) the site is the
    fused ``residual + dropout(x + bias)``. Keyed mode registers ``site`` with
    ``get_keyed_rng(x.device)`` (a name that collides with another site's id raises there).
    The table of the module docstring says what each mode draws. Example, attention
    probabilities (batch, heads/tp, s, s) sharded by heads and an MLP output replicated::

        probs = site_dropout(
            "layer.3.attention", probs, 0.1, rng_mode="keyed", sharded_dim=1, batch_dim=0,
            group=tp_group, position=position, training=self.training,
        )
        out = site_dropout(
            "layer.3.mlp_output", out, 0.1, rng_mode="keyed", group=tp_group,
            position=position, training=self.training, bias=bias, residual=x,
        )
    """
    sharded_dim, batch_dim = _check_site_options(
        site, x, rng_mode, sharded_dim, batch_dim, bias, residual
    )
    training, p = checked_flag(training, "training"), check_p(p)
    local_batch = x.shape[batch_dim]
    if position is not None:
        position = fitting(position, local_batch)
    elif rng_mode == "keyed" and training and p > 0:  # the only mode whose mask reads it
        position = required_position(local_batch, f"keyed site {site!r}", ENTER_A_POSITION)
    else:
        position = assumed_batch_position(local_batch)  # where a mask probe records it
    tp_rank, tp = tp_rank_and_size(group)
    placement = None  # the TP/SP shard of x (an even split)
    if sharded_dim is not None and tp > 1:
        placement = Chunk(sharded_dim, tp_rank, tp, extent=x.shape[sharded_dim] * tp)
    if rng_mode == "keyed" and training and p > 0:
        return _keyed_site(site, x, p, placement, batch_dim, position, bias, residual)
    region, shard = contextlib.nullcontext(), placement
    if placement is not None and rng_mode == "megatron":
        region = get_rng_tracker(x.device).fork(MODEL_PARALLEL_RNG)
        shard = None  # megatron mode draws local indices from a per-rank stream
    with region:
        if _PROBE is not None and training and p > 0:
            twin = torch.Generator(device=x.device)
            twin.set_state(default_generator(x.device).get_state())
            box = _region(x.shape, placement, batch_dim, position)
            _probe(site, x, p, shard, box, batch_dim, shard=shard, generator=twin)
        if residual is None:
            return dropout(x, p, training=training, shard=shard)
        return bias_dropout_add(x, bias, residual, p, training=training, shard=shard)


def _probe(
    site: str,
    x: torch.Tensor,
    p: float,
    placement: Chunk | None,
    region: Region,
    batch_dim: int,
    **draw: object,
) -> None:
    """Record the mask the site is about to draw (``draw``: the kernel's shard and randomness)."""
    record = MaskRecord((site, dropout(torch.ones_like(x), p, **draw) != 0, placement))
    record.region, record.batch_dim = region, batch_dim
    _PROBE.append(record)


def _keyed_site(
    site: str,
    x: torch.Tensor,
    p: float,
    shard: Chunk | None,
    batch_dim: int,
    position: BatchPosition,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """A keyed site (training, p > 0): no generator is read or written, the mask is
    (seed, step, site, box)'s."""
    rng = get_keyed_rng(x.device)
    region = _region(x.shape, shard, batch_dim, position)

    def draw(**randomness: Any) -> torch.Tensor:
        if residual is None:
            return dropout(x, p, shard=region, **randomness)
        return bias_dropout_add(x, bias, residual, p, shard=region, **randomness)

    # a new site registers only once its call has passed every check; under Dynamo the checks
    # run while tracing, where the table is not read (registration is done in the trace)
    if torch.compiler.is_dynamo_compiling() or site not in rng:
        if rng.seed is None:
            raise KeyedUnseededError(
                "keyed randomness has no seed; call get_keyed_rng(device).manual_seed(seed) with "
                "the run's seed (the same on every rank) first"
            )
        draw(training=False)  # the kernel checks its inputs, and draws nothing
    rng.register(site)
    seed = rng.seed_tensor(site)  # (4,) [key, 0, site id, step]
    if _PROBE is not None:
        _probe(site, x, p, shard, region, batch_dim, shard=region, seed=seed)
    return draw(seed=seed)
