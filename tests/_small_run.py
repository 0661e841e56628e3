"""The small training run the job's tests share: a 2-layer TinyGPT and a TrainConfig around it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpt_training.trainer import TrainConfig

from rng_tracker.parallel.sites import RNGMode
from rng_tracker.parallel.transformer import GPTConfig, Recompute

SMALL = GPTConfig(hidden=32, heads=4, ffn=64, seq_len=16, layers=2)


def small_run(
    *,
    model: GPTConfig = SMALL,
    rng_mode: RNGMode = "megatron",
    recompute: Recompute = "none",
    sp: bool = False,
    **kw: Any,
) -> TrainConfig:
    """A quiet run of ``model``; rng mode, recompute and SP go into the model, where TrainConfig
    reads them; ``kw`` are TrainConfig's other fields."""
    model = replace(model, rng_mode=rng_mode, recompute=recompute, sequence_parallel=sp)
    return TrainConfig(**{"quiet": True, "model": model, **kw})
