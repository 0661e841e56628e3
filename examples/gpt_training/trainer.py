"""The training loop of the end-to-end job: TinyGPT over tp × dp × pp ranks with microbatches.

``train`` runs on every rank of an initialised default process group (torchrun, or
``run_distributed`` in tests). Each step takes the corpus's global batch (the same samples in
the same order on every layout); DP rank r and microbatch m take a fixed slice of it, and the
loss is the mean token cross-entropy over the whole global batch on every layout. Pipeline
stages run under torch.distributed.pipelining; checkpoints go through DCP
(:mod:`gpt_training.dcp_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker._device_rng import device_rng
from rng_tracker._keyed import get_keyed_rng
from rng_tracker._seeds import SeedPlan, model_parallel_seed
from rng_tracker._tracker import STATE_DICT_VERSION, get_rng_tracker
from rng_tracker.parallel._mesh import ParallelState, destroy_model_parallel, init_model_parallel
from rng_tracker.parallel._verify import RNGReport, verify_rng_consistency
from rng_tracker.parallel.sites import RNGMode, record_masks
from rng_tracker.parallel.transformer import GPTConfig, Recompute, TinyGPT

from .corpus import Corpus
from .dcp_checkpoint import (
    COMMITTED,
    FORMAT,
    LogicalTensor,
    Manifest,
    RunLayout,
    check_resume,
    is_save_directory,
    load_checkpoint,
    local_shard,
    new_run_id,
    parse_pointer,
    rank_rng_states,
    read_manifest,
    save_checkpoint,
    tracker_state_of,
)
from .errors import SaveTargetError, TrainArgumentError, TrainingCheckpointError
from .pipeline import GPTStage, Schedule, build_schedule, split_layers

__all__ = [
    "Job",
    "TrainConfig",
    "TrainResult",
    "build",
    "check_save_target",
    "preflight",
    "train",
    "train_step",
    "validate_config",
]


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training run; ``steps`` counts from step 0, also when resuming.

    The data-parallel size is what remains of the world after tp × pp; ``global_batch``
    sequences per step are split over dp ranks and then ``microbatches``. ``model`` is the one
    place of TinyGPT's shape and randomness: its rng mode, recompute and sequence parallelism
    are read from it (:attr:`rng_mode`, :attr:`recompute`, :attr:`sp`), never overridden.
    """

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    global_batch: int = 8
    schedule: Schedule = "1f1b"
    steps: int = 20
    seed: int = 1234
    lr: float = 3e-3
    save: str | None = None
    resume: str | None = None
    model: GPTConfig = field(default_factory=GPTConfig)
    verify: bool = True
    probe_masks: bool = False
    log_every: int = 1
    quiet: bool = False
    overwrite: bool = False  # let ``save`` replace another run's checkpoint in that directory

    @property
    def rng_mode(self) -> RNGMode:
        """``model.rng_mode``: how the dropout sites draw their masks."""
        return self.model.rng_mode

    @property
    def recompute(self) -> Recompute:
        """``model.recompute``: which activations the backward recomputes."""
        return self.model.recompute

    @property
    def sp(self) -> bool:
        """``model.sequence_parallel``."""
        return self.model.sequence_parallel


@dataclass
class TrainResult:
    """What one rank saw: the global loss per step (equal on all ranks) and checks."""

    losses: list[float]
    params: dict[str, torch.Tensor]  # this rank's shards of its stage, by full-model name
    replicated_equal: bool
    masks: list[tuple[str, torch.Tensor, Any]] | None
    report_start: RNGReport | None
    report_end: RNGReport | None
    tokens_per_s: float
    seconds: float
    coords: dict[str, int]
    run_id: str


@dataclass
class Job:
    """Everything one rank trains with."""

    cfg: TrainConfig
    state: ParallelState
    stage: GPTStage
    schedule: Any
    optimizer: torch.optim.Optimizer
    plan: SeedPlan
    layout: RunLayout
    specs: list[LogicalTensor]
    device: torch.device

    @property
    def coords(self) -> dict[str, int]:
        return {axis: self.state.rank(axis) for axis in ("tp", "dp", "pp")}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _owner_stage(name: str, bounds: list[tuple[int, int]]) -> int:
    if name.startswith("layers."):
        index = int(name.split(".")[1])
        return next(s for s, (a, b) in enumerate(bounds) if a <= index < b)
    return len(bounds) - 1 if name.startswith(("ln_f.", "head.")) else 0


def _specs(model: TinyGPT, stages: int, tp: int) -> list[LogicalTensor]:
    """Every saved logical tensor of the full model: parameters and their AdamW state."""
    bounds = split_layers(model.config.layers, stages)
    specs = []
    for name, param in model.named_parameters():
        dim = getattr(param, "tp_shard_dim", None)
        shape = list(param.shape)
        if dim is not None:
            shape[dim] *= tp
        stage = _owner_stage(name, bounds)
        specs.append(LogicalTensor(f"model.{name}", stage, tuple(shape), dim))
        for moment in ("exp_avg", "exp_avg_sq"):
            specs.append(LogicalTensor(f"optim.{name}.{moment}", stage, tuple(shape), dim))
        specs.append(LogicalTensor(f"optim.{name}.step", stage, (), None))
    return specs


# --- checks before any work: every rank reaches the same verdict from the same inputs -------

_CHOICES = {
    "schedule": ("1f1b", "gpipe"),
    "recompute": ("none", "full", "selective"),
    "rng_mode": ("megatron", "invariant", "keyed"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _tp_fits(model: GPTConfig, tp: int, sp: bool) -> bool:
    """Whether TinyGPT's vocab, heads, widths (and, with SP, its sequence) divide by ``tp``."""
    sizes = [model.vocab, model.heads, model.hidden, model.ffn] + ([model.seq_len] if sp else [])
    return all(size % tp == 0 for size in sizes)


# The largest global batch: torch's samplers take sizes as 64-bit ints, and far below that no
# CPU or GPU holds the batch anyway.
_MAX_GLOBAL_BATCH = 2**31 - 1


def validate_config(cfg: TrainConfig, *, world: int | None = None, dp: int | None = None) -> int:
    """Refuse a run that cannot work, before any rank builds or trains anything.

    ``world`` is the number of processes (unknown: None) and ``dp`` the data-parallel size asked
    for (None: what remains of the world). Returns the data-parallel size (1 if ``world`` is
    None). Raises :class:`TrainArgumentError` saying which setting to change and to what.
    """
    counts = ("tp", "pp", "microbatches", "global_batch", "steps", "log_every")
    for name in counts:
        value = getattr(cfg, name)
        if type(value) is not int or value < 1:
            raise TrainArgumentError(f"{_flag(name)} must be a positive integer, got {value!r}")
    if type(cfg.seed) is not int or not 0 <= cfg.seed < 2**64:
        raise TrainArgumentError(f"--seed must be an integer in [0, 2**64), got {cfg.seed!r}")
    if cfg.global_batch > _MAX_GLOBAL_BATCH:
        raise TrainArgumentError(
            f"--global-batch must be at most {_MAX_GLOBAL_BATCH} (2**31 - 1), got {cfg.global_batch}"
        )
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise TrainArgumentError(
                f"{_flag(name)} must be one of {', '.join(choices)}; got {getattr(cfg, name)!r}"
            )
    if not (type(cfg.lr) is float and cfg.lr > 0):
        raise TrainArgumentError(f"lr must be a positive float, got {cfg.lr!r}")
    model = cfg.model
    if not _tp_fits(model, cfg.tp, cfg.sp):
        fits = [t for t in range(1, model.heads + 1) if _tp_fits(model, t, cfg.sp)]
        parts = f"vocab {model.vocab}, heads {model.heads}, hidden {model.hidden}, ffn {model.ffn}"
        if cfg.sp:
            parts += f", and with --sp the sequence length {model.seq_len}"
        choices = " or ".join(filter(None, [", ".join(map(str, fits[:-1])), str(fits[-1])]))
        raise TrainArgumentError(
            f"--tp {cfg.tp} cannot split TinyGPT ({parts} must all divide by it); "
            f"use --tp {choices}"
        )
    if cfg.pp > model.layers:
        raise TrainArgumentError(
            f"--pp {cfg.pp} exceeds TinyGPT's {model.layers} layers (a stage needs one); "
            f"use --pp 1 to {model.layers}"
        )
    if cfg.pp > 1 and cfg.schedule == "1f1b" and cfg.microbatches < cfg.pp:
        raise TrainArgumentError(
            f"--schedule 1f1b needs at least as many microbatches as pipeline stages "
            f"({cfg.microbatches} < --pp {cfg.pp}); use --microbatches {cfg.pp} or more, or "
            "--schedule gpipe"
        )
    if dp is not None and (type(dp) is not int or dp < 1):
        raise TrainArgumentError(f"--dp must be a positive integer, got {dp!r}")
    if world is None:
        dp = dp or 1
    else:
        if world % (cfg.tp * cfg.pp):
            raise TrainArgumentError(
                f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} does not divide the "
                f"{world} processes; choose sizes whose product divides {world}"
            )
        if dp is not None and cfg.tp * dp * cfg.pp != world:
            raise TrainArgumentError(
                f"--tp {cfg.tp} x --dp {dp} x --pp {cfg.pp} must equal the number of processes "
                f"({world}); leave out --dp to use {world // (cfg.tp * cfg.pp)}"
            )
        dp = world // (cfg.tp * cfg.pp)
    if cfg.global_batch % (dp * cfg.microbatches):
        raise TrainArgumentError(
            f"--global-batch {cfg.global_batch} must divide into dp={dp} ranks x "
            f"{cfg.microbatches} microbatches; choose a multiple of {dp * cfg.microbatches}"
        )
    return dp


def _committed_run(path: str) -> str | None:
    """The run id ``path/COMMITTED`` names; "" for a pointer that cannot be read; None: no file."""
    pointer = os.path.join(path, COMMITTED)
    if not os.path.lexists(pointer):
        return None
    try:
        with open(pointer, "rb") as f:
            return parse_pointer(f.read(), pointer)["run_id"]
    except (OSError, TrainingCheckpointError):
        return ""


def _probe_writable(save: str, directory: str) -> None:
    """Create and remove an entry in ``directory``: the only proof of writability that holds for
    root too (``os.access`` says yes to root even on read-only and virtual filesystems)."""
    try:
        probe = tempfile.mkdtemp(prefix=".rng-tracker-probe-", dir=directory)
        os.rmdir(probe)
    except OSError as exc:
        raise SaveTargetError(
            f"--save {save} cannot be written: creating an entry in {directory} failed "
            f"({exc.strerror or exc}); give a directory on a writable filesystem"
        ) from None


def check_save_target(save: str, *, overwrite: bool = False, resume: str | None = None) -> None:
    """Refuse a ``save`` directory the job could not commit into, before training starts.

    It must be a non-empty path of a directory (or creatable as one) in which this process can
    create an entry (a probe is created and removed). If it holds a committed checkpoint of
    another run than the one ``resume`` continues, saving would replace that run's checkpoint:
    refused unless ``overwrite``. Raises :class:`SaveTargetError`.
    """
    if not save:
        raise SaveTargetError(
            "--save is empty, so the run would train and save nothing; give the directory to "
            "commit the checkpoint to, or leave --save out"
        )
    if os.path.lexists(save) and not os.path.isdir(save):
        raise SaveTargetError(
            f"--save {save} exists and is not a directory; a checkpoint is a directory - "
            "give a new or existing directory"
        )
    inside = os.path.abspath(save)
    while os.path.dirname(inside) != inside:
        holder = os.path.dirname(inside)
        if is_save_directory(os.path.basename(inside)) and _committed_run(holder) is not None:
            raise SaveTargetError(
                f"--save {save} is inside {inside}, a step directory of the checkpoint "
                f"{holder}: a save there would change that checkpoint's files, so no resume "
                f"could load it; save to {holder} itself (its committed step stays until the "
                "new one commits) or to another directory"
            )
        inside = holder
    existing = os.path.abspath(save)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SaveTargetError(
            f"--save {save} cannot be created: {existing} is a file, not a directory"
        )
    _probe_writable(save, existing)
    if existing != os.path.abspath(save) or overwrite:
        return
    held = _committed_run(save)
    if held is None or (resume is not None and held and held == _committed_run(resume)):
        return  # empty of checkpoints, or this run's own checkpoint that the resume continues
    whose = f"run {held[:8]}" if held else "an unreadable checkpoint"
    raise SaveTargetError(
        f"--save {save} holds {whose}'s committed checkpoint, which this run would replace; "
        "pass --overwrite to replace it, or save to another directory"
    )


def preflight(cfg: TrainConfig, *, world: int, dp: int | None = None) -> Manifest | None:
    """Every check a run can make before any rank starts: arguments, save target, resume point.

    Returns the manifest of ``cfg.resume`` (None without one). Raises
    :class:`TrainArgumentError`, :class:`SaveTargetError`, or for the checkpoint to resume,
    :class:`TrainingCheckpointError` / :class:`ResumeRefusedError`.
    """
    dp = validate_config(cfg, world=world, dp=dp)
    if cfg.save is not None:
        check_save_target(cfg.save, overwrite=cfg.overwrite, resume=cfg.resume)
    if cfg.resume is None:
        return None
    if not os.path.exists(cfg.resume):
        raise TrainArgumentError(f"--resume {cfg.resume} does not exist; check the path")
    manifest = read_manifest(cfg.resume)
    _check_steps_left(cfg, manifest)
    layout = RunLayout(tp=cfg.tp, dp=dp, pp=cfg.pp, microbatches=cfg.microbatches, sp=cfg.sp)
    check_resume(
        manifest, rng_mode=cfg.rng_mode, seed=cfg.seed, global_batch=cfg.global_batch, layout=layout
    )
    return manifest


def _check_steps_left(cfg: TrainConfig, manifest: Manifest) -> None:
    if cfg.steps <= manifest.step:
        raise TrainArgumentError(
            f"--resume {cfg.resume} is at step {manifest.step} and --steps {cfg.steps} counts "
            f"from step 0, so this run would train nothing; pass --steps above {manifest.step}"
        )


def build(cfg: TrainConfig) -> Job:
    """Mesh, seeds, this rank's pipeline stage, schedule and optimizer (the default group)."""
    validate_config(cfg, world=dist.get_world_size())
    destroy_model_parallel()
    state = init_model_parallel(tensor=cfg.tp, pipeline=cfg.pp)
    dp = state.size("dp")
    device = _device()
    tracker = get_rng_tracker(device)
    plan = model_parallel_seed(cfg.seed, tracker=tracker)
    if cfg.rng_mode == "keyed":
        get_keyed_rng(device).manual_seed(cfg.seed)  # the same seed on every rank
    tp_group = state.group("tp") if cfg.tp > 1 else None
    full = TinyGPT(cfg.model, group=tp_group).to(device)  # identical init on every layout
    specs = _specs(full, cfg.pp, cfg.tp)
    stage = GPTStage(full, stage=state.rank("pp"), stages=cfg.pp)
    micro = cfg.global_batch // (dp * cfg.microbatches)
    schedule = build_schedule(
        stage,
        stage=state.rank("pp"),
        stages=cfg.pp,
        microbatches=cfg.microbatches,
        microbatch_size=micro,
        global_batch=cfg.global_batch,
        group=state.group("pp"),
        device=device,
        schedule=cfg.schedule,
    )
    optimizer = torch.optim.AdamW(stage.parameters(), lr=cfg.lr, weight_decay=0.0)
    layout = RunLayout(tp=cfg.tp, dp=dp, pp=cfg.pp, microbatches=cfg.microbatches, sp=cfg.sp)
    return Job(cfg, state, stage, schedule, optimizer, plan, layout, specs, device)


def _sync_grads(stage: GPTStage, state: ParallelState) -> None:
    """Sum sequence-parallel partial grads over TP, then sum every grad over DP.

    Each microbatch's loss is already divided by the global batch's token count, so the sum
    over DP ranks is the gradient of the global-batch mean.
    """
    params = [p for p in stage.parameters() if p.grad is not None]
    groups = []
    if state.size("tp") > 1:
        groups.append(
            ([p.grad for p in params if getattr(p, "sequence_parallel", False)], state.group("tp"))
        )
    if state.size("dp") > 1:
        groups.append(([p.grad for p in params], state.group("dp")))
    for grads, group in groups:
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(synced.view_as(grad))


def train_step(job: Job, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One optimizer step on the global batch (inputs, targets: (global_batch, seq)).

    Returns the global-batch mean loss, the same number on every rank.
    """
    cfg, state, stage = job.cfg, job.state, job.stage
    dp, dp_rank = state.size("dp"), state.rank("dp")
    per_rank = cfg.global_batch // dp
    micro = per_rank // cfg.microbatches
    start = dp_rank * per_rank
    stage.set_positions([start + m * micro for m in range(cfg.microbatches)], cfg.global_batch)
    x = inputs[start : start + per_rank].to(job.device)  # (global_batch/dp, seq)
    y = targets[start : start + per_rank].to(job.device)
    losses: list[torch.Tensor] = []
    args = (x,) if stage.is_first else ()
    extra = {"target": y, "losses": losses} if stage.is_last else {}
    job.schedule.step(*args, return_outputs=False, **extra)
    _sync_grads(stage, state)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    value = torch.stack(losses).sum().detach() if losses else torch.zeros(())
    value = value.to(job.device).reshape(1)
    if dp > 1:
        dist.all_reduce(value, group=state.group("dp"))
    if state.size("pp") > 1:
        dist.all_reduce(value, group=state.group("pp"))  # only the last stage's is non-zero
    return value.item()


def _replicated_equal(stage: GPTStage, state: ParallelState) -> bool:
    """Whether replicated parameters (and, without SP, the last hidden state) are bitwise equal over TP."""
    if state.size("tp") == 1:
        return True
    tensors = [p.detach() for p in stage.parameters() if getattr(p, "tp_shard_dim", None) is None]
    if not stage.config.sequence_parallel and stage.last_hidden is not None:
        tensors.append(stage.last_hidden)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(state.size("tp"))]
    dist.all_gather(gathered, flat, group=state.group("tp"))
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# --- checkpoints -------------------------------------------------------------------------


def _local_tensors(job: Job) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in job.stage.named_parameters():
        out[f"model.{name}"] = param.detach()
        for key, value in job.optimizer.state[param].items():
            out[f"optim.{name}.{key}"] = value
    return out


def _rng_states(job: Job) -> dict[str, Any]:
    rng = device_rng(job.device)
    device = None if job.device.type == "cpu" else rng.to_bytes(rng.snapshot())
    tracker = get_rng_tracker(job.device).state_dict()
    return rank_rng_states(tracker, torch.get_rng_state(), device)


def _saved_specs(job: Job, *, has_optimizer: bool) -> list[LogicalTensor]:
    """Parameters, and their AdamW state once a step has created it."""
    return [s for s in job.specs if has_optimizer or s.key.startswith("model.")]


def _keyed_state(job: Job) -> str | None:
    """The keyed RNG's logical state (seed, step, sites) as JSON: one entry, any layout."""
    if job.cfg.rng_mode != "keyed":
        return None
    return json.dumps(get_keyed_rng(job.device).state_dict(), sort_keys=True)


def _save(job: Job, path: str, step: int, losses: list[float], run_id: str) -> None:
    cfg = job.cfg
    manifest = Manifest(
        format=FORMAT,
        run_id=run_id,
        step=step,
        rng_mode=cfg.rng_mode,
        seed=cfg.seed,
        global_batch=cfg.global_batch,
        layout=job.layout,
        losses=list(losses),
        has_optimizer=step > 0,
    )
    save_checkpoint(
        path,
        specs=_saved_specs(job, has_optimizer=step > 0),
        local=_local_tensors(job),
        rng=_rng_states(job),
        keyed=_keyed_state(job),
        manifest=manifest,
        coords=job.coords,
        tp_group=job.state.group("tp") if job.state.size("tp") > 1 else None,
    )


def _load(job: Job, path: str) -> Manifest:
    """Restore model, optimizer and RNG from the committed checkpoint in ``path``."""
    cfg = job.cfg
    manifest = read_manifest(path)
    check_resume(
        manifest,
        rng_mode=cfg.rng_mode,
        seed=cfg.seed,
        global_batch=cfg.global_batch,
        layout=job.layout,
    )
    old, coords = manifest.layout, job.coords
    if cfg.rng_mode == "keyed":
        rng_ranks: list[int] = []
    elif old == job.layout:
        rng_ranks = [dist.get_rank()]
    else:  # invariant mode, another tp/sp: the default stream is replicated over TP
        rng_ranks = [old.rank_of(tp=0, dp=coords["dp"], pp=coords["pp"])]
    mine = _rng_states(job)
    specs = _saved_specs(job, has_optimizer=manifest.has_optimizer)
    tensors, rng = load_checkpoint(
        manifest,
        specs=specs,
        stage=coords["pp"],
        rng_ranks=rng_ranks,
        rng_template=lambda: mine,
        keyed_template=_keyed_state(job),
    )
    if rng.keyed:  # validates everything before it changes anything, so it goes first
        get_keyed_rng(job.device).load_state_dict(json.loads(rng.keyed))
    tp, tp_rank = job.state.size("tp"), coords["tp"]
    shard_dims = {s.key: s.shard_dim for s in specs}
    with torch.no_grad():
        for name, param in job.stage.named_parameters():
            key = f"model.{name}"
            param.copy_(local_shard(tensors[key], shard_dims[key], tp_rank, tp))
            if manifest.has_optimizer:
                job.optimizer.state[param] = {
                    moment: local_shard(
                        tensors[f"optim.{name}.{moment}"],
                        shard_dims[f"optim.{name}.{moment}"],
                        tp_rank,
                        tp,
                    ).clone()
                    for moment in ("step", "exp_avg", "exp_avg_sq")
                }
    if rng_ranks:
        states = rng.per_rank[rng_ranks[0]]
        torch.set_rng_state(states["cpu"])
        if "device" in states:
            generator = device_rng(job.device)
            generator.install(generator.from_bytes(states["device"]))
        if old == job.layout:
            get_rng_tracker(job.device).load_state_dict(
                tracker_state_of(states, version=STATE_DICT_VERSION, device_type=job.device.type)
            )
    return manifest


def train(cfg: TrainConfig) -> TrainResult:
    """Train TinyGPT on the default process group with ``cfg``; every rank returns its result.

    ``cfg`` and its save target are checked first (:func:`validate_config`,
    :func:`check_save_target`), so a run that could not finish or save fails before training.
    """
    if cfg.save is not None:
        check_save_target(cfg.save, overwrite=cfg.overwrite, resume=cfg.resume)
    job = build(cfg)
    tracker = get_rng_tracker(job.device)
    gpt = job.stage.config
    step, losses = 0, []
    talk = dist.get_rank() == 0 and not cfg.quiet
    if cfg.resume:
        manifest = _load(job, cfg.resume)
        _check_steps_left(cfg, manifest)
        step, losses, run_id = manifest.step, list(manifest.losses), manifest.run_id
        if talk:
            old = manifest.layout
            print(
                f"resumed step {step} of run {run_id[:8]} from {cfg.resume}, saved on tp={old.tp} "
                f"dp={old.dp} pp={old.pp} microbatches={old.microbatches} sp={old.sp}",
                flush=True,
            )
    else:
        run_id = new_run_id()

    def report() -> RNGReport | None:
        if not cfg.verify:
            return None
        result = verify_rng_consistency(job.state, tracker=tracker, plan=job.plan)
        if talk:
            print(result, flush=True)
        return result

    report_start = report()
    corpus = Corpus(vocab=gpt.vocab)
    masks = None
    tokens = 0
    start = time.perf_counter()
    while step < cfg.steps:
        inputs, targets = corpus.global_batch(step, batch=cfg.global_batch, seq_len=gpt.seq_len)
        if cfg.rng_mode == "keyed":
            get_keyed_rng(job.device).set_step(step)
        probe = record_masks() if cfg.probe_masks and masks is None else None
        with probe if probe is not None else contextlib.nullcontext() as recorded:
            losses.append(train_step(job, inputs, targets))
        if recorded is not None:
            masks = list(recorded)
        step += 1
        tokens += cfg.global_batch * gpt.seq_len
        if talk and (step % cfg.log_every == 0 or step == cfg.steps):
            rate = tokens / (time.perf_counter() - start)
            print(
                f"step {step:4d}/{cfg.steps}  loss {losses[-1]:.6f}  tokens/s {rate:8.0f}",
                flush=True,
            )
    seconds = time.perf_counter() - start
    if cfg.save is not None:
        _save(job, cfg.save, step, losses, run_id)
    report_end = report()
    result = TrainResult(
        losses=losses,
        params={name: p.detach().clone() for name, p in job.stage.named_parameters()},
        replicated_equal=_replicated_equal(job.stage, job.state),
        masks=masks,
        report_start=report_start,
        report_end=report_end,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        coords=job.coords,
        run_id=run_id,
    )
    destroy_model_parallel()
    return result
