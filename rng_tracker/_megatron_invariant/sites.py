"""megatron-core's dropout and jitter sites, keyed: each draws from (seed, step, site, global index).

:func:`wire` replaces, in a built model, the randomness of every site megatron-core's local spec
has: the embedding dropout, each attention's dropout over ``[b, heads/tp, sq, sk]``, each
layer's two bias-dropout-adds over ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism),
each router's input jitter. A site is named by its place in the model with a layer's *global*
index (``decoder.layers.3.self_attn_bda``), so a pipeline stage names its layers as one stage
does. At run time a site places its local activation in the site's logical tensor over the
whole global batch: the TP/SP shard from its module's tensor-parallel group, the rows from
the batch position; the keyed kernels then draw exactly that box of the logical mask.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import rng_tracker.kernels._keyed_fill as _init_kernel
from rng_tracker._batch_position import BatchPosition, box_in_batch, required_position
from rng_tracker._collective import all_gather_json
from rng_tracker._keyed import get_keyed_rng
from rng_tracker.errors import MegatronInvariantInitError, MegatronInvariantUnsupportedError
from rng_tracker.kernels import Region, bias_dropout_add, dropout


@dataclass(frozen=True, slots=True)
class SiteLayout:
    """How a site's local activation sits in its logical tensor: the batch dim, and the dim
    split evenly over the tensor-parallel group (None: replicated there)."""

    batch_dim: int
    sharded_dim: int | None
    tp_rank: int
    tp_size: int

    def region(self, shape: torch.Size, position: BatchPosition) -> Region:
        """The box a local activation of ``shape`` holds in the site's logical tensor."""
        split = None
        if self.sharded_dim is not None and self.tp_size > 1:
            split = (self.sharded_dim, self.tp_rank, self.tp_size)
        return Region(*box_in_batch(shape, self.batch_dim, position, split))


def _layout(group: Any, batch_dim: int, sharded_dim: int | None) -> SiteLayout:
    if group is None or not dist.is_initialized():
        return SiteLayout(batch_dim, sharded_dim, 0, 1)
    return SiteLayout(batch_dim, sharded_dim, dist.get_rank(group), dist.get_world_size(group))


def _position(local_batch: int, site: str) -> BatchPosition:
    return required_position(
        local_batch,
        f"keyed site {site!r}",
        "Wrap the model call in forward_step_func in "
        "rng_tracker.megatron.batch_position(sample_offset, global_batch)",
    )


# -- the probe tests use to see every site's draw ---------------------------------------------
_PROBE = threading.local()


@contextlib.contextmanager
def record() -> Iterator[list[tuple[str, Region, torch.Tensor]]]:
    """Record (site, box, what it drew) of every keyed site run in the body, recomputes
    included: a dropout site's keep mask (bool), a jitter site's noise. The probe redraws
    through the same kernel from the site's seed words, so it changes nothing."""
    previous = getattr(_PROBE, "records", None)
    _PROBE.records = records = []
    try:
        yield records
    finally:
        _PROBE.records = previous


def _recording() -> list | None:
    return getattr(_PROBE, "records", None)


# -- the sites -------------------------------------------------------------------------------
def _seed_words(site: str, device: torch.device) -> torch.Tensor:
    rng = get_keyed_rng(device)
    rng.register(site)
    return rng.seed_tensor(site)  # (4,) [key, 0, site id, step]


def _keyed(
    site: str,
    layout: SiteLayout,
    x: torch.Tensor,
    p: float,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    position = _position(x.shape[layout.batch_dim], site)
    region = layout.region(x.shape, position)
    seed = _seed_words(site, x.device)
    records = _recording()
    if records is not None:
        keep = dropout(torch.ones_like(x), p, shard=region, seed=seed) != 0
        records.append((site, region, keep.detach().cpu()))
    if residual is None:
        return dropout(x, p, shard=region, seed=seed)
    return bias_dropout_add(x, bias, residual, p, shard=region, seed=seed)


class KeyedDropout(torch.nn.Module):
    """``torch.nn.Dropout`` of one megatron site, keyed (train mode, p > 0); the identity
    otherwise, as ``torch.nn.Dropout``."""

    def __init__(self, p: float, site: str, layout: SiteLayout) -> None:
        super().__init__()
        self.p, self.site, self.layout = float(p), site, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _keyed(self.site, self.layout, x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site!r}"


class KeyedBiasDropoutAdd:
    """A layer's ``self_attn_bda``/``mlp_bda`` (megatron's ``get_bias_dropout_add``): called as
    ``bda(training, fused)(x_with_bias, residual, prob)``; keyed in training with prob > 0,
    megatron's own function otherwise."""

    def __init__(self, original: Callable[..., Any], site: str, layout: SiteLayout) -> None:
        self.original, self.site, self.layout = original, site, layout

    def __call__(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        if not training:
            return self.original(training, fused)

        def bias_dropout_add_(
            x_with_bias: tuple[torch.Tensor, torch.Tensor | None],
            residual: torch.Tensor,
            prob: float,
        ) -> torch.Tensor:
            if prob == 0.0:
                return self.original(training, fused)(x_with_bias, residual, prob)
            x, bias = x_with_bias
            if x.dtype != residual.dtype:  # megatron's fp32 residual: add in its dtype
                x = x.to(residual.dtype)
                bias = None if bias is None else bias.to(residual.dtype)
            return _keyed(self.site, self.layout, x, prob, bias=bias, residual=residual)

        return bias_dropout_add_


class KeyedJitter:
    """A router's ``apply_input_jitter``: input times U[1 - eps, 1 + eps) noise, the noise of
    each element of the logical ``[s, B, h]`` tensor a pure function of (seed, step, site,
    index). Applied whenever megatron applies it (``moe_input_jitter_eps`` set)."""

    def __init__(self, router: torch.nn.Module, site: str, layout: SiteLayout) -> None:
        self.router, self.site, self.layout = router, site, layout

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        eps = self.router.config.moe_input_jitter_eps
        if eps is None:
            return input
        position = _position(input.shape[self.layout.batch_dim], self.site)
        region = self.layout.region(input.shape, position)
        rng = get_keyed_rng(input.device)
        if rng.seed is None:
            rng.seed_tensor(self.site)  # raises the unseeded error
        noise = torch.empty(input.shape, dtype=torch.float32)  # (local shape), on the CPU
        indices = [range(o, o + n) for o, n in zip(region.offset, input.shape, strict=True)]
        _init_kernel.keyed_uniform_(
            noise,
            1.0 - eps,
            1.0 + eps,
            seed=rng.seed,
            name=f"{self.site}@step{rng.step}",  # the step keys the noise as it keys masks
            global_shape=region.global_shape,
            indices=indices,
        )
        noise = noise.to(device=input.device, dtype=input.dtype)
        records = _recording()
        if records is not None:
            records.append((self.site, region, noise.detach().cpu()))
        return input * noise


# -- wiring a built model --------------------------------------------------------------------
def _site_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> its path with each transformer layer's local index replaced by its global
    one (``layer_number - 1``): the same on every pipeline stage and layout."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    paths: dict[int, str] = {id(model): ""}
    for module in model.modules():
        for name, child in module.named_children():
            if id(child) in paths:
                continue
            if isinstance(child, TransformerLayer):
                name = str(child.layer_number - 1)
            base = paths[id(module)]
            paths[id(child)] = f"{base}.{name}" if base else name
    return paths


def _sequence_parallel(module: torch.nn.Module) -> bool:
    return bool(getattr(module.config, "sequence_parallel", False))


def wire(model: torch.nn.Module) -> list[str]:
    """Replace every random site of ``model`` by its keyed site; returns the site names.

    Raises :class:`MegatronInvariantUnsupportedError` (before changing anything) for a dropout
    module or bias-dropout-add no site covers: its randomness would stay layout-dependent.
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.moe.router import Router
    from megatron.core.transformer.transformer_layer import TransformerLayer

    paths = _site_paths(model)
    edits: list[tuple[Any, str, Any]] = []  # (owner, attribute, keyed replacement)
    covered: set[int] = set()
    for module in model.modules():
        path = paths[id(module)]
        if isinstance(module, LanguageModelEmbedding):
            scattered = module.reduce_scatter_embeddings or module.scatter_to_sequence_parallel
            layout = _layout(
                module.tp_group, 1, 0 if _sequence_parallel(module) and scattered else None
            )
            drop = module.embedding_dropout
            covered.add(id(drop))
            edits.append(
                (
                    module,
                    "embedding_dropout",
                    KeyedDropout(drop.p, f"{path}.embedding_dropout", layout),
                )
            )
        elif isinstance(module, DotProductAttention):
            drop = module.attention_dropout
            covered.add(id(drop))
            layout = _layout(module.tp_group, 0, 1)  # [b, heads/tp, sq, sk]
            edits.append(
                (
                    module,
                    "attention_dropout",
                    KeyedDropout(drop.p, f"{path}.attention_dropout", layout),
                )
            )
        elif isinstance(module, TransformerLayer):
            layout = _layout(module.tp_group, 1, 0 if _sequence_parallel(module) else None)
            for attribute in ("self_attn_bda", "cross_attn_bda", "mlp_bda"):
                bda = getattr(module, attribute)
                if isinstance(bda, KeyedBiasDropoutAdd):  # wired before (a nested model)
                    bda = bda.original
                if bda is get_bias_dropout_add:
                    site = KeyedBiasDropoutAdd(bda, f"{path}.{attribute}", layout)
                    edits.append((module, attribute, site))
                elif not (isinstance(bda, IdentityOp) or bda in (IdentityOp, IdentityFuncOp)):
                    raise MegatronInvariantUnsupportedError(
                        f"{path}.{attribute} is {bda!r}, not megatron's get_bias_dropout_add: "
                        "invariant mode has no keyed site for its dropout; use the local spec's"
                    )
        elif isinstance(module, Router) and module.config.moe_input_jitter_eps is not None:
            layout = _layout(module.tp_group, 1, 0 if _sequence_parallel(module) else None)
            edits.append(
                (module, "apply_input_jitter", KeyedJitter(module, f"{path}.jitter", layout))
            )
    stray = [
        paths[id(m)]
        for m in model.modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and id(m) not in covered
    ]
    if stray:
        raise MegatronInvariantUnsupportedError(
            f"dropout module(s) {stray} belong to no site invariant mode knows (embedding, "
            "attention, bias-dropout-add, router jitter): their masks would depend on the layout"
        )
    for owner, attribute, replacement in edits:
        setattr(owner, attribute, replacement)
    device = next((p.device for p in model.parameters()), None)
    names = [r.site for _, _, r in edits]
    if device is not None and device.type != "meta":
        rng = get_keyed_rng(device)
        for name in names:
            rng.register(name)  # collisions surface at build time
    return names


def register_every_stage(model: torch.nn.Module, names: list[str], *, failed: bool) -> None:
    """Register on this rank the sites of every pipeline stage of ``model``, so the keyed state
    (seed, step, sites) is the same on every rank, as a checkpoint of it must be, and two
    stages' sites that would share an id are refused; collective over the model's pipeline
    group. ``failed``: this stage could not finish its model (it raises its own error; the
    other stages raise :class:`MegatronInvariantInitError` instead of waiting)."""
    group = getattr(model, "pp_group", None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone = all_gather_json({"failed": failed, "sites": [] if failed else names}, group)
    if failed:
        return
    stopped = [stage for stage, entry in enumerate(everyone) if entry["failed"]]
    if stopped:
        raise MegatronInvariantInitError(
            f"pipeline stage(s) {stopped} could not finish their GPTModel in invariant mode (see "
            "their errors), so this stage's model is not usable either; fix that error and build "
            "the model again"
        )
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type == "meta":
        return
    rng = get_keyed_rng(device)
    for name in sorted({name for entry in everyone for name in entry["sites"]}):
        rng.register(name)
