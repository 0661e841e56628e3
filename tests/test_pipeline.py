"""The demo job's pipeline split, microbatches and global batch, and keyed resume across layouts."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from _small_run import SMALL, small_run
from gpt_training.pipeline import GPTStage, split_layers
from gpt_training.trainer import TrainConfig, train

from rng_tracker.errors import MissingBatchPositionError, ParallelConfigError
from rng_tracker.parallel.testing import run_distributed
from rng_tracker.parallel.transformer import TinyGPT

NO_DROPOUT = replace(SMALL, attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0)
# Layouts that compute the same thing differ only in fp32 summation order (matmuls split over
# TP, per-microbatch loss sums, all-reduce order). Keyed runs saved on (2,2,1,1) and resumed on
# (4,1,1,1) or (1,1,2,2) stayed within 4.8e-7 (one ulp at loss ~4) of the one-rank run over 20
# steps; 1e-4 leaves 200x headroom and is 300x below what other masks change (megatron vs keyed
# masks on these runs: 0.031).
LAYOUT_LOSS_TOLERANCE = 1e-4


config = functools.partial(small_run, global_batch=8, verify=False)


def test_stages_split_the_layers_and_keep_the_full_models_names():
    """Stages hold disjoint parts whose union is the full model, under the full model's names
    (a layer keeps its global index); too many stages is a typed error."""
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ParallelConfigError, match="between 1 and the number of layers"):
        split_layers(2, 3)
    cfg = replace(SMALL, layers=5)
    full = dict(TinyGPT(cfg).named_parameters())
    stages = [GPTStage(TinyGPT(cfg), stage=s, stages=3) for s in range(3)]
    names = [dict(stage.named_parameters()) for stage in stages]
    assert sum(len(n) for n in names) == len(full)
    assert set().union(*names) == set(full)
    assert all(torch.equal(full[k], v) for n in names for k, v in n.items())
    assert [[layer.layer_index for layer in s.layers.values()] for s in stages] == [
        [0, 1],
        [2, 3],
        [4],
    ]
    assert stages[0].is_first and stages[2].is_last and not stages[1].is_first


def test_a_forward_beyond_the_steps_microbatches_is_refused_not_guessed():
    """A stage's n-th forward of a step is microbatch n; one more (torch's shape inference
    runs one when a PipelineStage has no input_args/output_args) drew another microbatch's
    masks. It raises instead, and the positions of the next step start over."""
    stage = GPTStage(TinyGPT(SMALL), stage=0, stages=1)
    tokens = torch.zeros(2, SMALL.seq_len, dtype=torch.int64)
    stage.set_positions([0, 2], 4)
    stage(tokens), stage(tokens)
    with pytest.raises(MissingBatchPositionError, match="input_args/output_args"):
        stage(tokens)
    stage.set_positions([0, 2], 4)
    stage(tokens)


def _losses(*configs: TrainConfig) -> list[list[float]]:
    return [train(cfg).losses for cfg in configs]


def test_every_layout_trains_on_the_same_global_batch_with_the_same_loss():
    """Without dropout, (tp, dp, pp, microbatches) = (2,1,2,2), (1,2,2,2) and (1,4,1,1) compute
    the (1,1,1,1) run's losses within LAYOUT_LOSS_TOLERANCE: every layout sees the same samples
    and averages the loss over the whole global batch. GPipe equals 1F1B bitwise."""
    steps = 3
    (base,) = run_distributed(_losses, world_size=1, args=(config(model=NO_DROPOUT, steps=steps),))[
        0
    ]
    layouts = [
        config(model=NO_DROPOUT, steps=steps, tp=2, pp=2, microbatches=2),
        config(model=NO_DROPOUT, steps=steps, pp=2, microbatches=2),
        config(model=NO_DROPOUT, steps=steps, pp=2, microbatches=2, schedule="gpipe"),
        config(model=NO_DROPOUT, steps=steps),
    ]
    runs = run_distributed(_losses, world_size=4, args=tuple(layouts), timeout=180)
    assert all(r == runs[0] for r in runs)  # every rank reports the global loss
    tp_pp, dp_pp, dp_pp_gpipe, dp4 = runs[0]
    assert dp_pp_gpipe == dp_pp
    for losses in (tp_pp, dp_pp, dp4):
        assert len(losses) == steps
        assert max(abs(a - b) for a, b in zip(base, losses, strict=True)) <= LAYOUT_LOSS_TOLERANCE
    assert base[0] != base[-1]  # it trains


def _save_then_resume(save: TrainConfig, resume: TrainConfig) -> tuple:
    saved = train(save)
    resumed = train(resume)
    return saved.losses, resumed.losses


def test_keyed_run_saved_on_one_layout_resumes_on_others(tmp_path):
    """Keyed mode: 10 steps at (tp, dp, pp, microbatches) = (2,2,1,1), save; resumed at (4,1,1,1)
    and at (1,1,2,2) for 10 more, every loss equals the uninterrupted (1,1,1,1) run's within
    LAYOUT_LOSS_TOLERANCE (the masks are the same bits, only fp32 summation order differs)."""
    ckpt = str(tmp_path / "ckpt")
    common = {"rng_mode": "keyed", "recompute": "selective"}
    (straight,) = run_distributed(_losses, world_size=1, args=(config(steps=20, **common),))[0]
    saved, on_tp4 = run_distributed(
        _save_then_resume,
        world_size=4,
        args=(
            config(steps=10, tp=2, save=ckpt, **common),
            config(steps=20, tp=4, resume=ckpt, verify=True, **common),
        ),
        timeout=180,
    )[0]
    (on_pp2,) = run_distributed(
        _losses, world_size=2, args=(config(steps=20, pp=2, microbatches=2, resume=ckpt, **common),)
    )[0]
    # The manifest carries the first 10 losses over (a round-trip check); the resumed steps
    # below are what shows the keyed state resharded.
    assert on_tp4[:10] == saved and on_pp2[:10] == saved
    for losses in (saved, on_tp4[10:], on_pp2[10:]):
        start = 0 if losses is saved else 10
        diffs = [abs(a - b) for a, b in zip(straight[start:], losses)]
        assert len(diffs) == 10 and max(diffs) <= LAYOUT_LOSS_TOLERANCE, diffs
