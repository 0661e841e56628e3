"""The training loop of the end-to-end job: TinyGPT over tp × dp ranks, exact save and resume.

``train`` runs on every rank of an initialised default process group (torchrun, or
``run_distributed`` in tests). Checkpoints are one file per rank holding its parameter
shards, optimizer state and every RNG state (CPU, device, tracker ``state_dict``), so a
resumed run continues bit for bit; in invariant mode a run may resume on another TP degree
(shards are re-cut from the logical tensors).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from rng_tracker.device_rng import device_rng
from rng_tracker.errors import StateDictError
from rng_tracker.parallel.corpus import Corpus
from rng_tracker.parallel.mesh import ParallelState, destroy_model_parallel, init_model_parallel
from rng_tracker.parallel.transformer import GPTConfig, Recompute, RNGMode, TinyGPT, record_masks
from rng_tracker.parallel.verify import RNGReport, verify_rng_consistency
from rng_tracker.seeds import model_parallel_seed
from rng_tracker.tracker import get_rng_tracker

__all__ = ["TrainConfig", "TrainResult", "train"]

CHECKPOINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """One training run; ``steps`` counts from step 0, also when resuming."""

    tp: int = 1
    sp: bool = False
    recompute: Recompute = "none"
    rng_mode: RNGMode = "megatron"
    steps: int = 20
    seed: int = 1234
    batch: int = 8
    lr: float = 3e-3
    save: str | None = None
    resume: str | None = None
    model: GPTConfig = field(default_factory=GPTConfig)
    verify: bool = True
    probe_masks: bool = False
    log_every: int = 1
    quiet: bool = False


@dataclass
class TrainResult:
    """What one rank saw: the global loss per step (equal on all ranks) and checks."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    replicated_equal: bool
    masks: list[tuple[str, torch.Tensor, Any]] | None
    report_start: RNGReport | None
    report_end: RNGReport | None
    tokens_per_s: float
    seconds: float
    coords: dict[str, int]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync_grads(model: TinyGPT, state: ParallelState) -> None:
    """Sum sequence-parallel partial grads over TP, then average every grad over DP."""
    params = [p for p in model.parameters() if p.grad is not None]
    if state.size("tp") > 1:
        partial = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
        if partial:
            flat = torch._utils._flatten_dense_tensors(partial)
            dist.all_reduce(flat, group=state.group("tp"))
            for grad, synced in zip(
                partial, torch._utils._unflatten_dense_tensors(flat, partial), strict=True
            ):
                grad.copy_(synced)
    if state.size("dp") > 1:
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=state.group("dp"))
        flat /= state.size("dp")
        for grad, synced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(synced)


def _replicated_equal(model: TinyGPT, state: ParallelState) -> bool:
    """Whether replicated parameters (and, without SP, the last hidden state) are bitwise equal over TP."""
    if state.size("tp") == 1:
        return True
    tensors = [p.detach() for p in model.parameters() if getattr(p, "tp_shard_dim", None) is None]
    if not model.config.sequence_parallel and model.last_hidden is not None:
        tensors.append(model.last_hidden)
    flat = torch._utils._flatten_dense_tensors(tensors).contiguous()
    gathered = [torch.empty_like(flat) for _ in range(state.size("tp"))]
    dist.all_gather(gathered, flat, group=state.group("tp"))
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def _rng_states(device: torch.device) -> dict[str, Any]:
    rng = device_rng(device)
    return {
        "cpu": torch.get_rng_state(),
        "device": None if device.type == "cpu" else rng.to_bytes(rng.snapshot()),
        "tracker": get_rng_tracker(device).state_dict(),
    }


def _save(
    path: str,
    model: TinyGPT,
    optimizer: torch.optim.Optimizer,
    state: ParallelState,
    cfg: TrainConfig,
    step: int,
    losses: list[float],
    device: torch.device,
) -> None:
    os.makedirs(path, exist_ok=True)
    payload = {
        "version": CHECKPOINT_VERSION,
        "layout": {"tp": state.size("tp"), "dp": state.size("dp"), "sp": cfg.sp},
        "coords": {"tp": state.rank("tp"), "dp": state.rank("dp")},
        "rng_mode": cfg.rng_mode,
        "step": step,
        "losses": losses,
        "model": {name: p.detach().clone() for name, p in model.named_parameters()},
        "shard_dims": {
            name: getattr(p, "tp_shard_dim", None) for name, p in model.named_parameters()
        },
        "optimizer": optimizer.state_dict(),
        "rng": _rng_states(device),
    }
    torch.save(payload, os.path.join(path, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


def _load(
    path: str,
    model: TinyGPT,
    optimizer: torch.optim.Optimizer,
    state: ParallelState,
    cfg: TrainConfig,
    device: torch.device,
) -> tuple[int, list[float]]:
    files = [
        torch.load(os.path.join(path, name), weights_only=True)
        for name in sorted(os.listdir(path))
        if name.startswith("rank") and name.endswith(".pt")
    ]
    if not files or any(f.get("version") != CHECKPOINT_VERSION for f in files):
        raise StateDictError(
            f"{path} holds no rng_tracker training checkpoint of version {CHECKPOINT_VERSION}"
        )
    old = files[0]["layout"]
    tp, dp, tp_rank, dp_rank = (
        state.size("tp"),
        state.size("dp"),
        state.rank("tp"),
        state.rank("dp"),
    )
    by_coords = {(f["coords"]["tp"], f["coords"]["dp"]): f for f in files}
    if old["dp"] != dp:
        raise StateDictError(
            f"checkpoint has dp={old['dp']} but this run has dp={dp}: keep the data-parallel size"
        )
    if old["tp"] == tp:
        mine = by_coords[(tp_rank, dp_rank)]
        model.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])
        get_rng_tracker(device).load_state_dict(mine["rng"]["tracker"])
    else:
        if cfg.rng_mode != "invariant" or files[0]["rng_mode"] != "invariant":
            raise StateDictError(
                f"checkpoint has tp={old['tp']}, this run tp={tp}: only rng_mode='invariant' masks survive "
                "a layout change; resume with the same --tp"
            )
        shards = [by_coords[(r, dp_rank)] for r in range(old["tp"])]
        names = [name for name, _ in model.named_parameters()]

        def recut(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
            dim = shards[0]["shard_dims"][name]
            return (
                pieces[0]
                if dim is None
                else torch.cat(pieces, dim=dim).chunk(tp, dim=dim)[tp_rank].contiguous()
            )

        model.load_state_dict({n: recut(n, [s["model"][n] for s in shards]) for n in names})
        opt_state = shards[0]["optimizer"]
        for index, name in enumerate(names):
            entry = opt_state["state"].get(index)
            if entry is None:
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = recut(name, [s["optimizer"]["state"][index][key] for s in shards])
        optimizer.load_state_dict(opt_state)
    mine = by_coords[(tp_rank if old["tp"] == tp else 0, dp_rank)]
    torch.set_rng_state(mine["rng"]["cpu"])
    if mine["rng"]["device"] is not None:
        rng = device_rng(device)
        rng.install(rng.from_bytes(mine["rng"]["device"]))
    return mine["step"], list(mine["losses"])


def build(cfg: TrainConfig) -> tuple[ParallelState, TinyGPT, torch.optim.Optimizer]:
    """Mesh, seeds, model and optimizer of ``cfg`` on this rank (the default process group)."""
    destroy_model_parallel()
    state = init_model_parallel(tensor=cfg.tp)
    device = _device()
    model_parallel_seed(cfg.seed, tracker=get_rng_tracker(device))
    gpt = replace(
        cfg.model, rng_mode=cfg.rng_mode, recompute=cfg.recompute, sequence_parallel=cfg.sp
    )
    model = TinyGPT(gpt, group=state.group("tp") if cfg.tp > 1 else None).to(device)
    return state, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)


def train_step(
    model: TinyGPT,
    optimizer: torch.optim.Optimizer,
    state: ParallelState,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """Forward, backward, gradient sync and update; returns the loss averaged over DP."""
    loss = model.loss(inputs, targets)
    loss.backward()
    _sync_grads(model, state)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.detach().clone()
    if state.size("dp") > 1:
        dist.all_reduce(value, group=state.group("dp"))
        value /= state.size("dp")
    return value.item()


def train(cfg: TrainConfig) -> TrainResult:
    """Train TinyGPT on the default process group with ``cfg``; every rank returns its result."""
    state, model, optimizer = build(cfg)
    device = next(model.parameters()).device
    tracker = get_rng_tracker(device)
    gpt = model.config
    step, losses = (0, [])
    if cfg.resume:
        step, losses = _load(cfg.resume, model, optimizer, state, cfg, device)
    talk = dist.get_rank() == 0 and not cfg.quiet
    report_start = verify_rng_consistency(state, tracker=tracker) if cfg.verify else None
    if talk and report_start is not None:
        print(report_start, flush=True)
    corpus = Corpus(vocab=gpt.vocab)
    dp, dp_rank = state.size("dp"), state.rank("dp")
    masks = None
    tokens = 0
    start = time.perf_counter()
    while step < cfg.steps:
        inputs, targets = corpus.batch(step, dp_rank, dp, batch=cfg.batch, seq_len=gpt.seq_len)
        probe = record_masks() if cfg.probe_masks and masks is None else None
        with probe if probe is not None else contextlib.nullcontext() as recorded:
            losses.append(
                train_step(model, optimizer, state, inputs.to(device), targets.to(device))
            )
        if recorded is not None:
            masks = list(recorded)
        step += 1
        tokens += cfg.batch * gpt.seq_len * dp
        if talk and (step % cfg.log_every == 0 or step == cfg.steps):
            rate = tokens / (time.perf_counter() - start)
            print(
                f"step {step:4d}/{cfg.steps}  loss {losses[-1]:.4f}  tokens/s {rate:8.0f}",
                flush=True,
            )
    seconds = time.perf_counter() - start
    if cfg.save:
        _save(cfg.save, model, optimizer, state, cfg, step, losses, device)
    report_end = verify_rng_consistency(state, tracker=tracker) if cfg.verify else None
    if talk and report_end is not None:
        print(report_end, flush=True)
    result = TrainResult(
        losses=losses,
        params={name: p.detach().clone() for name, p in model.named_parameters()},
        replicated_equal=_replicated_equal(model, state),
        masks=masks,
        report_start=report_start,
        report_end=report_end,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        coords={"tp": state.rank("tp"), "dp": state.rank("dp")},
    )
    destroy_model_parallel()
    return result
