"""The demo job's pipeline split: one stage's part of TinyGPT and its torch.distributed.pipelining schedule.

Every rank builds the full TinyGPT (so parameter init is identical on every layout) and keeps
its stage's part: the embedding on the first stage, a contiguous run of layers, and the final
norm, head and loss on the last. Layers keep their index in the whole model, so parameter
names (``layers.3.fc1.weight``) and dropout sites do not depend on the pipeline split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rng_tracker.errors import MissingBatchPositionError, ParallelConfigError
from rng_tracker.parallel.sites import batch_position
from rng_tracker.parallel.transformer import TinyGPT

__all__ = ["GPTStage", "Schedule", "SingleStage", "build_schedule", "split_layers"]

Schedule = Literal["gpipe", "1f1b"]


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[first, end) layer range per stage: as even as possible, earlier stages one longer."""
    if not 1 <= stages <= layers:
        raise ParallelConfigError(
            f"pipeline size {stages} must be between 1 and the number of layers ({layers}); "
            "use fewer stages or more layers"
        )
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for stage in range(stages):
        end = start + base + (stage < extra)
        bounds.append((start, end))
        start = end
    return bounds


class GPTStage(torch.nn.Module):
    """Stage ``stage`` of ``stages`` cut from a full :class:`TinyGPT`.

    Input: tokens (microbatch, seq) on the first stage, else the hidden state
    (seq, microbatch, hidden), (seq/tp, ...) under sequence parallelism. Output: the hidden
    state, or logits (seq, microbatch, vocab) on the last stage. Each forward runs under
    ``batch_position`` of its microbatch (set by :meth:`set_positions`), so keyed dropout sees
    the microbatch's place in the global batch.
    """

    def __init__(self, model: TinyGPT, *, stage: int, stages: int) -> None:
        super().__init__()
        self.config, self.group = model.config, model.group
        self.first_layer, self.end_layer = split_layers(model.config.layers, stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        if self.is_first:
            self.embed, self.pos = model.embed, model.pos
        self.layers = torch.nn.ModuleDict(
            {str(i): model.layers[i] for i in range(self.first_layer, self.end_layer)}
        )
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head
        self.last_hidden: torch.Tensor | None = None  # the final layer's output, for checks
        self._offsets: list[int] = [0]
        self._global_batch = 1
        self._calls = 0

    def set_positions(self, offsets: list[int], global_batch: int) -> None:
        """First sample (in the global batch) of each microbatch of the coming step, in order.

        torch's schedules run a stage's forwards in microbatch order, so the n-th forward of the
        step is microbatch n. A stage built without ``input_args``/``output_args`` runs one
        forward more in its first step (torch infers the shapes): :func:`build_schedule` gives
        them, and a forward beyond the step's microbatches raises instead of guessing.
        """
        self._offsets, self._global_batch, self._calls = list(offsets), global_batch, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._calls >= len(self._offsets):
            raise MissingBatchPositionError(
                f"forward {self._calls + 1} of a step of {len(self._offsets)} microbatch(es): its "
                "place in the global batch is unknown. Call set_positions before each step, and "
                "build the PipelineStage with input_args/output_args (without them torch runs an "
                "extra forward to infer the shapes)"
            )
        offset = self._offsets[self._calls]
        self._calls += 1
        with batch_position(offset, self._global_batch):
            # TinyGPT's own embedding and head code, run on this stage's modules: the stage
            # holds the attributes they use (config, group, embed, pos, ln_f, head).
            if self.is_first:
                x = TinyGPT.embed_tokens(self, x)  # type: ignore[arg-type]
            for layer in self.layers.values():
                x = layer(x)
            if not self.is_last:
                return x
            return TinyGPT.logits(self, x)  # type: ignore[arg-type]  # (s, b, vocab)


class SingleStage:
    """A one-stage "schedule": each microbatch's forward, loss and backward in turn.

    What a pipeline schedule does with one stage (and what Megatron runs without pipeline
    parallelism), without importing torch.distributed.pipelining. Same ``step`` call.
    """

    def __init__(
        self,
        module: GPTStage,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.module, self.microbatches, self.loss_fn = module, microbatches, loss_fn

    def step(
        self,
        inputs: torch.Tensor,
        *,
        target: torch.Tensor,
        losses: list[torch.Tensor],
        return_outputs: bool = False,
    ) -> None:
        for x, y in zip(
            inputs.chunk(self.microbatches), target.chunk(self.microbatches), strict=True
        ):
            loss = self.loss_fn(self.module(x), y)
            loss.backward()
            losses.append(loss.detach())


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def build_schedule(
    module: GPTStage,
    *,
    stage: int,
    stages: int,
    microbatches: int,
    microbatch_size: int,
    global_batch: int,
    group: dist.ProcessGroup,
    device: torch.device,
    schedule: Schedule = "1f1b",
) -> Any:
    """The schedule running ``module`` as stage ``stage``; its loss sums to the global-batch mean.

    Stage input and output shapes are given up front, so no metadata is exchanged between
    stages (this is what lets the pipeline run on CPU/gloo); one stage runs as a
    :class:`SingleStage`. Each microbatch's loss is its summed token cross-entropy over the
    number of tokens in the *global* batch, and gradients are not rescaled: the microbatches
    of all DP ranks add up to the global mean.
    """
    if schedule == "1f1b" and microbatches < stages:
        raise ParallelConfigError(
            f"schedule '1f1b' needs at least as many microbatches as stages ({microbatches} < "
            f"{stages}); use more microbatches or the 'gpipe' schedule"
        )
    cfg = module.config
    s = cfg.seq_len
    tokens_in_batch = global_batch * s

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits (s, mb, vocab), targets (mb, s)
        summed = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.t().reshape(-1), reduction="sum"
        )
        return summed / tokens_in_batch

    if stages == 1:
        return SingleStage(module, microbatches, loss_fn)
    # imported only here: it takes seconds, and a one-stage run does not need it
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    s_local = s // _tp_size(module.group) if cfg.sequence_parallel else s
    hidden = torch.empty(s_local, microbatch_size, cfg.hidden, device=device, requires_grad=True)
    tokens = torch.empty(microbatch_size, s, dtype=torch.long, device=device)
    logits = torch.empty(s, microbatch_size, cfg.vocab, device=device, requires_grad=True)
    pipe_stage = PipelineStage(
        module,
        stage,
        stages,
        device,
        input_args=tokens if module.is_first else hidden,
        output_args=logits if module.is_last else hidden,
        group=group,
    )
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return kind(pipe_stage, microbatches, loss_fn=loss_fn, scale_grads=False)
