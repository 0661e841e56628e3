"""DCP checkpoints of the demo job: exact resume, refusals, and saves that a killed rank cannot break."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _small_run import small_run
from gpt_training import dcp_checkpoint
from gpt_training.dcp_checkpoint import FAULT_ENV, RunLayout, read_manifest
from gpt_training.errors import ResumeRefusedError, TrainingCheckpointError
from gpt_training.trainer import TrainConfig, _load, build, train

from rng_tracker import get_rng_tracker
from rng_tracker.parallel._mesh import destroy_model_parallel, init_model_parallel
from rng_tracker.parallel.testing import DistributedTestError, run_distributed

config = functools.partial(small_run, global_batch=4, verify=False)


def _straight_and_half(straight: TrainConfig, half: TrainConfig) -> tuple:
    full = train(straight)
    train(half)
    return full.losses, full.params


def _resume(cfg: TrainConfig) -> tuple:
    result = train(cfg)
    return result.losses, result.params, result.report_start.ok and result.report_end.ok


def test_megatron_resume_on_the_same_pipeline_layout_is_bitwise(tmp_path):
    """pp=2, 2 microbatches, megatron mode: 4 steps straight == 2 steps, save, new processes,
    resume 2; every loss and parameter bitwise, RNG verified after the resume."""
    ckpt = str(tmp_path / "ckpt")
    common = {"pp": 2, "microbatches": 2, "recompute": "selective"}
    straight = run_distributed(
        _straight_and_half,
        world_size=2,
        args=(config(steps=4, **common), config(steps=2, save=ckpt, **common)),
        timeout=120,
    )
    resumed = run_distributed(
        _resume, world_size=2, args=(config(steps=4, resume=ckpt, verify=True, **common),)
    )
    for (losses, params), (got_losses, got_params, ok) in zip(straight, resumed, strict=True):
        assert ok and got_losses == losses
        assert params.keys() == got_params.keys()
        assert all(torch.equal(params[n], got_params[n]) for n in params)


def _layout_ranks_match_the_mesh() -> list[bool]:
    """On each (tp, pp) of 4 ranks: does RunLayout.rank_of name this rank's own mesh place?"""
    matches = []
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)):
        state = init_model_parallel(tensor=tp, pipeline=pp)
        layout = RunLayout(tp=tp, dp=state.size("dp"), pp=pp, microbatches=1, sp=False)
        coords = {axis: state.rank(axis) for axis in ("tp", "dp", "pp")}
        matches.append(layout.rank_of(**coords) == dist.get_rank())
        destroy_model_parallel()
    return matches


def test_a_layouts_rank_of_is_the_meshs_global_rank():
    """Save sends each stage from (tp 0, dp 0) to rank 0, and an invariant-mode resume reads the
    saved (tp 0, dp, pp) rank's RNG state: both use rank_of, which must agree with the mesh."""
    for matches in run_distributed(_layout_ranks_match_the_mesh, world_size=4):
        assert all(matches), matches


def _state(job) -> dict:
    tracker = get_rng_tracker(job.device)
    return {
        "params": {n: p.detach().clone() for n, p in job.stage.named_parameters()},
        "optim": {
            (n, k): v.clone()
            for n, p in job.stage.named_parameters()
            for k, v in job.optimizer.state[p].items()
        },
        "cpu": torch.get_rng_state(),
        "streams": {n: s["state"] for n, s in tracker.state_dict()["streams"].items()},
    }


def _same(a: dict, b: dict) -> bool:
    return all(
        a[part].keys() == b[part].keys()
        and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
        for part in ("params", "optim", "streams")
    ) and torch.equal(a["cpu"], b["cpu"])


def _refusals(good: str, megatron_pp2: str, bad: dict[str, str]) -> dict:
    """One rank: each bad checkpoint raises its typed error and leaves the job untouched."""
    train(config(rng_mode="invariant", steps=2, save=good))
    for path in bad.values():
        shutil.copytree(good, path)
    os.remove(os.path.join(bad["uncommitted"], "COMMITTED"))
    step_dir = os.path.basename(read_manifest(good).directory)
    flipped = Path(bad["flipped"], step_dir, "__0_0.distcp")
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    # a truncated data file whose manifest and pointer were re-hashed: only DCP's read can notice
    truncated = Path(bad["truncated"], step_dir, "__0_0.distcp")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 3])
    manifest = read_manifest(good)
    files = {**manifest.files, "__0_0.distcp": dcp_checkpoint._sha256(str(truncated))}
    rehashed = replace(manifest, files=files, directory=step_dir)
    digest = dcp_checkpoint.write_manifest(str(truncated.parent), rehashed)
    dcp_checkpoint.commit_pointer(bad["truncated"], rehashed, digest)
    # a pointer, hashed as the job hashes one, that names step 1 of a directory holding step 2
    mixed = replace(manifest, step=1, directory=step_dir)
    digest = hashlib.sha256(Path(bad["mixed"], step_dir, "manifest.json").read_bytes())
    dcp_checkpoint.commit_pointer(bad["mixed"], mixed, digest.hexdigest())

    errors = {}
    cases = [("invariant", path, name) for name, path in bad.items()]
    cases += [("megatron", megatron_pp2, "other layout"), ("invariant", megatron_pp2, "other mode")]
    for mode, path, name in cases:
        job = build(config(rng_mode=mode, steps=3))
        torch.manual_seed(7)  # some state that a partial load would change
        before = _state(job)
        try:
            _load(job, path)
            errors[name] = None
        except (TrainingCheckpointError, ResumeRefusedError) as exc:
            errors[name] = (type(exc).__name__, str(exc), _same(before, _state(job)))
        destroy_model_parallel()
    return errors


def test_bad_checkpoints_raise_typed_errors_and_load_nothing(tmp_path):
    """Uncommitted, bit-flipped, truncated, mixed-step checkpoints raise TrainingCheckpointError;
    another rng mode or (megatron) another layout raise ResumeRefusedError; in every case the
    parameters, optimizer state and RNG states are exactly as before the attempt."""
    megatron_pp2 = str(tmp_path / "megatron")
    run_distributed(
        train, world_size=2, args=(config(pp=2, microbatches=2, steps=1, save=megatron_pp2),)
    )
    bad = {name: str(tmp_path / name) for name in ("uncommitted", "flipped", "truncated", "mixed")}
    errors = run_distributed(
        _refusals, world_size=1, args=(str(tmp_path / "good"), megatron_pp2, bad), timeout=120
    )[0]
    expected = {
        "uncommitted": ("TrainingCheckpointError", "no committed checkpoint"),
        "flipped": ("TrainingCheckpointError", "does not match its recorded hash"),
        "truncated": ("TrainingCheckpointError", "could not be loaded"),
        "mixed": ("TrainingCheckpointError", "mixes checkpoints"),
        "other layout": ("ResumeRefusedError", "resume on the saved layout"),
        "other mode": ("ResumeRefusedError", "rng_mode='megatron'"),
    }
    for name, (kind, words) in expected.items():
        assert errors[name] is not None, name
        got_kind, message, untouched = errors[name]
        assert got_kind == kind and words in message, (name, message)
        assert untouched, name


def _steps_of(path: str) -> int:
    return read_manifest(path).step


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """pp=2, saving over a step-2 checkpoint: rank 1 SIGKILLed while the pieces are gathered, or
    rank 0 killed with the new checkpoint fully written but the commit pointer not yet replaced,
    leaves the step-2 checkpoint committed and intact (never step 4, never a mix); killed just
    after the commit, the step-4 checkpoint is committed and complete."""
    ckpt = str(tmp_path / "ckpt")
    common = {"pp": 2, "microbatches": 2}
    run_distributed(train, world_size=2, args=(config(steps=2, save=ckpt, **common),))
    first = read_manifest(ckpt)
    assert first.step == 2
    cfg = config(steps=4, resume=ckpt, save=ckpt, **common)
    for fault in ("1:gather", "0:commit", "0:cleanup"):
        monkeypatch.setenv(FAULT_ENV, fault)
        with pytest.raises(DistributedTestError, match="SIGKILL"):
            run_distributed(train, world_size=2, args=(cfg,))
        now = read_manifest(ckpt)  # checks every file against its hash
        if fault != "0:cleanup":
            assert (now.step, now.run_id, now.files) == (2, first.run_id, first.files), fault
    assert now.step == 4 and now.run_id == first.run_id and now.losses[:2] == first.losses
    assert len(now.losses) == 4
