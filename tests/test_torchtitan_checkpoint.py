"""torchtitan 0.3.0's own ``CheckpointManager`` carrying ``RNGStateful`` across TP layouts.

Claim: torchtitan's Llama3 debug model (one block), parallelized by torchtitan, trained two
steps with dropout on the first block's ``w1`` output - stream-drawn (``F.dropout`` under
``invariant_random()``) and keyed (``dtensor.dropout(out, p, site=...)``, the keyed step
following torchtitan's ``train_state.step``) - and checkpointed by torchtitan's own
``CheckpointManager`` with ``states={"train_state": ..., "rng": RNGStateful(step=...)}`` at TP=2
(sync) and at TP=2 x FSDP=2 (async mode), resumes at TP=4 and on 1 process: the two steps after
the resume draw masks bitwise equal to the uninterrupted single-device run. The same checkpoints
saved without the RNG state (torchtitan as shipped) replay steps 1-2's stream-drawn masks in
steps 3-4 (asserted too). After each resume the keyed step equals the restored trainer step.

Three spawns (2, 4 and 1 ranks) carry every claim; the model is one block so that each
checkpoint is small.
"""

from __future__ import annotations

from typing import Any

import torch
import torchtitan  # noqa: F401  scripts/test.sh installs it (scripts/frameworks.txt): never skipped
from _torchtitan_model import build_llama3_debug

_BATCH, _SEQ, _P, _SITE = 2, 16, 0.25, "layers.0.feed_forward.w1"


def _build(tp: int, dp_shard: int) -> torch.nn.Module:
    """torchtitan's Llama3 debug model cut to one block, on meta, parallelized by torchtitan."""
    return build_llama3_debug(tp, dp_shard, layers=1)


class _TrainState:
    """The trainer's step as torchtitan's Trainer checkpoints it (a ``Stateful``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class _NoOptimizer:
    """The optimizers' slot of the manager's states, empty: the test trains no parameter.
    (torchtitan's OptimizersContainer.state_dict() first runs an AdamW step with lr 0, and that
    step's in-place update segfaults on these CPU FSDP2 parameters in torch 2.13; the optimizer's state is not
    what this test is about.)"""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class _Run:
    """One process's model, keyed RNG and trainer step, with both dropout sites on w1's output."""

    def __init__(self, tp: int, dp_shard: int) -> None:
        import torch.nn.functional as F
        from torch.distributed.tensor import DTensor

        from rng_tracker import get_keyed_rng
        from rng_tracker.kernels import dropout as kernel_dropout
        from rng_tracker.parallel import dtensor

        self.model = _build(tp, dp_shard)
        self.tp, self.dp_shard = tp, dp_shard
        self.layout: Any = None
        torch.manual_seed(0)  # a run's start-up seeding, the same on every rank, after the build
        self.keyed = get_keyed_rng("cpu")
        self.keyed.manual_seed(7)
        self.keyed.register(_SITE)
        self.train_state = _TrainState()
        self.masks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.invariant = False

        def site(module: Any, inputs: Any, out: torch.Tensor) -> torch.Tensor:
            drawn = F.dropout(out, _P, training=True)  # stream-drawn: the CPU generator
            if isinstance(out, DTensor):
                keyed = dtensor.dropout(out, _P, site=_SITE)  # keyed, on the DTensor itself
            else:
                keyed = kernel_dropout(out, _P, seed=self.keyed.seed_tensor(_SITE))
            self.masks.append((_full(drawn) != 0, _full(keyed) != 0))
            return drawn

        self.model.layers["0"].feed_forward.w1.register_forward_hook(site)
        self.open()
        with torch.no_grad():
            self.model.init_weights(buffer_device=None)

    def open(self) -> None:
        from rng_tracker.parallel.invariant import enable_invariant_random

        enable_invariant_random()
        self.invariant = True

    def steps(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokens = torch.arange(_BATCH * _SEQ).reshape(_BATCH, _SEQ) * 37 % 2048
        positions = torch.arange(_SEQ).repeat(_BATCH, 1)
        start = len(self.masks)
        with torch.no_grad():
            for _ in range(count):
                self.train_state.step += 1
                self.keyed.set_step(self.train_state.step)  # the keyed step follows the trainer's
                self.model(tokens, positions=positions)
        return self.masks[start:]

    def manager(self, folder: str, *, rng: bool, async_mode: str = "disabled"):
        from torchtitan.components.checkpointer.dcp import CheckpointManager

        from rng_tracker.dcp import RNGStateful

        states: dict[str, Any] = {"train_state": self.train_state}
        if rng:
            if self.layout is None:  # the ranks laid out as torchtitan's ParallelDims lays them
                from torch.distributed.device_mesh import init_device_mesh

                sizes = (1, self.dp_shard, 1, self.tp)
                self.layout = init_device_mesh(
                    "cpu", sizes, mesh_dim_names=("pp", "dp", "cp", "tp")
                )
            states["rng"] = RNGStateful(step=lambda: self.train_state.step, layout=self.layout)
        config = CheckpointManager.Config(
            enable=True, folder=folder, interval=1, async_mode=async_mode, keep_latest_k=0
        )
        return CheckpointManager(
            config,
            dataloader=None,
            model_parts=[self.model],
            optimizers=_NoOptimizer(),
            lr_schedulers=None,
            states=states,
            sd_adapter=None,
        )

    def close(self) -> None:
        from rng_tracker.parallel.invariant import disable_invariant_random

        if self.invariant:
            disable_invariant_random()
            self.invariant = False


def _save(tp: int, dp_shard: int, folder: str, async_mode: str) -> list:
    """Two steps, then torchtitan saves step 2 with the RNG state and, elsewhere, without it."""
    run = _Run(tp, dp_shard)
    try:
        masks = run.steps(2)
        for where, rng in ((folder, True), (folder + "-no-rng", False)):
            manager = run.manager(where, rng=rng, async_mode=async_mode)
            manager.save(curr_step=2)
            manager.maybe_wait_for_saving()
            manager.close()
    finally:
        run.close()
    return masks


def _resume(tp: int, dp_shard: int, folders: list[str]) -> list[dict]:
    """A fresh run per checkpoint: torchtitan loads it, then two more steps."""
    out = []
    for folder in folders:
        run = _Run(tp, dp_shard)
        try:
            manager = run.manager(folder, rng=not folder.endswith("-no-rng"))
            assert manager.load()
            manager.close()
            out.append(
                {
                    "trainer": run.train_state.step,
                    "keyed": run.keyed.step,
                    "masks": run.steps(2),
                }
            )
        finally:
            run.close()
    return out


def _uninterrupted() -> list:
    run = _Run(1, 1)
    try:
        return run.steps(4)
    finally:
        run.close()


def test_checkpoint_manager_resumes_dropout_at_tp4_and_on_one_process(tmp_path) -> None:
    from rng_tracker.parallel.testing import run_distributed

    tp2, tp2_fsdp2 = str(tmp_path / "tp2"), str(tmp_path / "tp2-fsdp2")
    saved_tp2 = run_distributed(_save, world_size=2, args=(2, 1, tp2, "disabled"), timeout=600)
    folders = [tp2, tp2 + "-no-rng", tp2_fsdp2, tp2_fsdp2 + "-no-rng"]

    four = run_distributed(_four_ranks, world_size=4, args=(tp2_fsdp2, folders), timeout=600)
    one = run_distributed(_one_rank, world_size=1, args=(folders,), timeout=600)[0]
    want = one["uninterrupted"]
    assert len(want) == 4
    for saved in (saved_tp2[0], four[0]["saved"]):
        for got, expected in zip(saved, want[:2], strict=True):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for where, resumed in (("TP=4", four[0]["resumed"]), ("1 process", one["resumed"])):
        for folder, result in zip(folders, resumed, strict=True):
            with_rng = not folder.endswith("-no-rng")
            assert result["trainer"] == 2, (where, folder)
            assert result["keyed"] == (2 if with_rng else 0), (where, folder)  # restored by us
            stream = [m[0] for m in result["masks"]]
            keyed = [m[1] for m in result["masks"]]
            for step in range(2):  # keyed masks follow the trainer's step either way
                assert torch.equal(keyed[step], want[2 + step][1]), (where, folder, step)
            if not with_rng:  # torchtitan as shipped: steps 3-4 replay steps 1-2
                for step in range(2):
                    assert torch.equal(stream[step], want[step][0]), (where, folder, step)
                    assert not torch.equal(stream[step], want[2 + step][0])
            else:
                for step in range(2):
                    assert torch.equal(stream[step], want[2 + step][0]), (where, folder, step)


def _four_ranks(tp2_fsdp2: str, folders: list[str]) -> dict:
    """Save at TP=2 x FSDP=2 through torchtitan's async mode, then resume every checkpoint at TP=4."""
    saved = _save(2, 2, tp2_fsdp2, "async")
    return {"saved": saved, "resumed": _resume(4, 1, folders)}


def _one_rank(folders: list[str]) -> dict:
    return {"uninterrupted": _uninterrupted(), "resumed": _resume(1, 1, folders)}
