"""megatron-core's invariant mode, behind ``rng_tracker.megatron.install(invariant=True)``.

One concern per module: ``position`` (where a microbatch sits in the global batch, carried into
recomputes by ``rng_tracker.megatron``'s checkpoints), ``keyed_params`` (deferred init, filled
per shard from ``sharded_state_dict()`` boxes), ``sites`` (megatron's dropout and jitter sites,
keyed), ``patches`` (what install puts in megatron-core and takes out again, and what it
refuses). Nothing here imports megatron at import time, nor ``rng_tracker.megatron``.
"""
