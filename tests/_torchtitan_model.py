"""torchtitan 0.3.0's Llama3 debug model as the torchtitan tests build it on CPU gloo ranks:
on meta, parallelized by torchtitan's own ``parallelize_fn``, then materialised on the CPU."""

from __future__ import annotations

import torch


def build_llama3_debug(
    tp: int = 1, dp_shard: int = 1, *, parallel: bool = True, layers: int | None = None
) -> torch.nn.Module:
    """The debug model (its first ``layers`` blocks; all when None), with torchtitan's
    ``ScaledDotProductAttention`` (its FlexAttention has no CPU backward and compiles for tens of
    seconds on CPU), parallelized at ``tp`` x ``dp_shard`` unless ``parallel`` is False."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as titan_utils
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    # torchtitan picks "cuda" when no accelerator is found; these ranks are CPU (gloo).
    parallel_dims_module.device_type = titan_utils.device_type = "cpu"
    spec = model_registry("debugmodel", attn_backend="flex")
    config = spec.model
    if layers is not None:
        config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=dp_shard,
        spmd_backend="partial_dtensor",
    )
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    if parallel:
        dims = ParallelDims(
            dp_replicate=1,
            dp_shard=dp_shard,
            cp=1,
            tp=tp,
            pp=1,
            ep=1,
            world_size=dist.get_world_size(),
            spmd_backend="partial_dtensor",
        )
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=TrainingConfig(),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
    model.to_empty(device="cpu")
    return model
