"""What ``install(invariant=True)`` puts into megatron-core, what it refuses, and how it is undone.

Name swaps (by identity, in every megatron module, as ``install()`` routes ``random``'s names):
megatron's affine init helpers (deferring) and ``schedules.forward_step`` (telling sites how many
microbatches run). Megatron's checkpoint entry points are ``rng_tracker.megatron``'s already,
which carry the batch position into the recompute while invariant mode is installed. Class
patches: ``TransformerConfig.__post_init__`` (refuses what cannot be invariant, wraps the init
methods so a parameter they are called on is deferred) and ``GPTModel.__init__`` (refuses a
TransformerEngine spec before megatron builds anything; when construction ends, wires the keyed
sites and fills every deferred parameter from the model's ``sharded_state_dict()``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rng_tracker._batch_position import microbatches
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._megatron_invariant import keyed_params, sites
from rng_tracker._optional_module import OptionalModule
from rng_tracker.errors import MegatronInvariantUnsupportedError

_INIT_METHODS = ("init_method", "output_layer_init_method", "embedding_init_method")
_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")
_te_extension_module = OptionalModule(_TE_MODULES[0])


@dataclasses.dataclass(frozen=True, slots=True)
class ClassPatch:
    """``owner.attribute`` was ``original`` and is ``replacement`` while installed."""

    owner: type
    attribute: str
    original: Any
    replacement: Any


# -- refusals -------------------------------------------------------------------------------
def refuse_config(config: Any) -> None:
    """Raise for a config whose randomness cannot be layout-invariant here."""
    if getattr(config, "context_parallel_size", 1) > 1:
        raise MegatronInvariantUnsupportedError(
            f"context parallelism (context_parallel_size={config.context_parallel_size}) cannot "
            "be invariant here: megatron-core runs it only with TransformerEngine attention, whose "
            "kernels own the dropout; use context_parallel_size=1 with install(invariant=True)"
        )
    if getattr(config, "moe_router_force_load_balancing", False):
        raise MegatronInvariantUnsupportedError(
            "moe_router_force_load_balancing draws router logits with megatron's RandomSTE, a "
            "per-rank stream draw with no keyed counterpart: it cannot be invariant; turn it off "
            "with install(invariant=True)"
        )
    if getattr(config, "moe_router_force_biased", None) is not None:
        raise MegatronInvariantUnsupportedError(
            "moe_router_force_biased draws a router bias with megatron's RandomSTEShared, a "
            "stream draw with no keyed counterpart: it cannot be invariant; leave it None with "
            "install(invariant=True)"
        )


def _leaves(spec: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """Every class or callable a layer spec names (ModuleSpec trees, submodule dataclasses,
    lists)."""
    seen = set() if seen is None else seen
    if id(spec) in seen or spec is None:
        return
    seen.add(id(spec))
    if isinstance(spec, (list, tuple)):
        for item in spec:
            yield from _leaves(item, seen)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            yield from _leaves(getattr(spec, field.name, None), seen)
    elif hasattr(spec, "module") and hasattr(spec, "submodules") and not isinstance(spec, type):
        yield from _leaves(spec.module, seen)  # a ModuleSpec
        yield from _leaves(spec.submodules, seen)
    else:
        yield spec


def _transformer_engine_name(obj: Any) -> str | None:
    """The name of ``obj`` if it is one of megatron's TransformerEngine wrappers or a TE class.

    Without TransformerEngine installed megatron binds its TE wrappers to stand-in objects in
    ``megatron.core.extensions.transformer_engine``; they are found by identity there."""
    extension = _te_extension_module()
    if extension is not None:
        for name, value in vars(extension).items():
            if value is obj and name.startswith("TE"):
                return name
    module = getattr(obj, "__module__", None) if isinstance(obj, type) else None
    if isinstance(module, str) and module.startswith(_TE_MODULES):
        return obj.__name__
    return None


def _refuse_transformer_engine(objects: Iterator[Any], where: str) -> None:
    for obj in objects:
        name = _transformer_engine_name(obj)
        if name is not None:
            raise MegatronInvariantUnsupportedError(
                f"TransformerEngine module {name} in {where}: TransformerEngine's kernels own its "
                "dropout (attention) and init, which rng_tracker cannot key, so it cannot be "
                "invariant; build the model with megatron-core's local spec "
                "(get_gpt_layer_local_spec) under install(invariant=True)"
            )


def refuse_spec(spec: Any) -> None:
    """Raise for a layer spec that names a TransformerEngine module."""
    _refuse_transformer_engine(_leaves(spec), "the layer spec")


# -- the end of a model's construction ----------------------------------------------------------
def finish_model(model: torch.nn.Module) -> None:
    """Wire ``model``'s keyed sites, fill its deferred parameters (its construction ended) and
    register every pipeline stage's sites (a collective over the model's pipeline group)."""
    try:
        refuse_config(model.config)
        _refuse_transformer_engine((type(m) for m in model.modules()), "the model")
        names = sites.wire(model)
        keyed_params.fill_deferred(model, seed=get_keyed_rng().seed)
    except Exception:
        sites.register_every_stage(model, [], failed=True)  # the other stages must not wait
        raise
    sites.register_every_stage(model, names, failed=False)


def _finishing(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        if "config" in arguments:
            refuse_config(arguments["config"])
        refuse_spec(arguments.get("transformer_layer_spec"))
        original(self, *args, **kwargs)
        finish_model(self)

    return __init__


def _deferring(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        refuse_config(self)
        for name in _INIT_METHODS:
            method = getattr(self, name, None)
            if callable(method) and not isinstance(method, keyed_params.DeferredInitMethod):
                setattr(self, name, keyed_params.DeferredInitMethod(method))

    return __post_init__


def apply_class_patches() -> list[ClassPatch]:
    """Patch megatron's classes for invariant mode; returns what to undo."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    patches = [
        ClassPatch(
            TransformerConfig,
            "__post_init__",
            TransformerConfig.__dict__["__post_init__"],
            _deferring(TransformerConfig.__dict__["__post_init__"]),
        ),
        ClassPatch(
            GPTModel, "__init__", GPTModel.__dict__["__init__"], _finishing(GPTModel.__init__)
        ),
    ]
    for patch in patches:
        setattr(patch.owner, patch.attribute, patch.replacement)
    return patches


def undo_class_patches(patches: list[ClassPatch]) -> None:
    """Put back every original :func:`apply_class_patches` replaced."""
    for patch in reversed(patches):
        if patch.owner.__dict__.get(patch.attribute) is patch.replacement:
            setattr(patch.owner, patch.attribute, patch.original)


# -- name swaps -------------------------------------------------------------------------------
def _counting_microbatches(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``schedules.forward_step`` that tells keyed sites how many microbatches run."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        count = signature.bind_partial(*args, **kwargs).arguments.get("num_microbatches")
        with microbatches(count if isinstance(count, int) else None):
            return original(*args, **kwargs)

    return forward_step


def name_swaps() -> dict[str, tuple[Any, Any]]:
    """label -> (megatron's object, its invariant-mode replacement), for the identity swap."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    keyed_params.check_helpers()
    return {
        "layers._initialize_affine_weight_gpu": (
            layers._initialize_affine_weight_gpu,
            keyed_params.initialize_affine_weight_gpu,
        ),
        "layers._initialize_affine_weight_cpu": (
            layers._initialize_affine_weight_cpu,
            keyed_params.initialize_affine_weight_cpu,
        ),
        "schedules.forward_step": (
            schedules.forward_step,
            _counting_microbatches(schedules.forward_step),
        ),
    }
