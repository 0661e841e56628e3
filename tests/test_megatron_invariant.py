"""``rng_tracker.megatron.install(invariant=True)``: megatron-core 0.19.2's own GPTModel draws the
same init and dropout on any layout, on real gloo ranks.

Two distributed tests (4 ranks each) re-initialise megatron's ``parallel_state`` per layout and
run Megatron's own code: ``GPTModel`` (local spec, fp32, hidden and attention dropout 0.1) and
training steps through ``get_forward_backward_func`` with 2 microbatches per data-parallel rank
over a global batch of 8 samples; one compares layouts, the other saves a run at TP=2xPP=2 with
``rng_tracker.dcp.RNGStateful`` and resumes it at TP=4 and TP=1. The CPU shims megatron itself
needs are in tests/_megatron_cpu.py.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _megatron_cpu import (
    CPU_ONLY_CONFIG,
    cuda_means_cpu,
    destroy_megatron_groups,
    process_groups,
    sequence_parallel_spec,
)
from torch.overrides import TorchFunctionMode

import rng_tracker.megatron as rm
from rng_tracker._megatron_invariant.sites import record

_SEQ, _GLOBAL_BATCH, _VOCAB, _MICROBATCHES, _EXPERTS = 16, 8, 64, 2, 4
_DATA = torch.randint(0, _VOCAB, (_GLOBAL_BATCH, _SEQ), generator=torch.Generator().manual_seed(5))
_DENSE = {  # name: (tp, pp, sp)
    "tp1": (1, 1, False),
    "tp2": (2, 1, False),
    "tp4": (4, 1, False),
    "tp2+sp": (2, 1, True),
    "pp2": (1, 2, False),
    "tp2xpp2+sp": (2, 2, True),
}
_RECOMPUTE = {
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}
_MOE = {
    "num_moe_experts": _EXPERTS,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_input_jitter_eps": 0.1,
    "add_bias_linear": False,  # megatron's experts refuse biases in training (in-place on a view)
}
_EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


# -- megatron's model and one training step ---------------------------------------------------
def _config(
    tp: int, pp: int, sp: bool, *, cpu_init: bool, moe: bool = False, ep: int = 1, **extra: Any
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=cpu_init,
        pipeline_dtype=torch.float32,
        **CPU_ONLY_CONFIG,
        # CPU: p2p without batching or CUDA syncs
        batch_p2p_comm=False,
        batch_p2p_sync=False,
        **(_MOE if moe else {}),
        **extra,
    )


def _build(
    tp: int,
    pp: int,
    sp: bool,
    *,
    cpu_init: bool,
    moe: bool = False,
    ep: int = 1,
    seed: int = 1234,
    share: bool = False,
    **extra: Any,
):
    import megatron.core.parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    rm.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = _config(tp, pp, sp, cpu_init=cpu_init, moe=moe, ep=ep, **extra)
    layer = get_gpt_layer_local_spec(num_experts=_EXPERTS if moe else None, moe_grouped_gemm=False)
    spec = sequence_parallel_spec(layer, get_num_layers_to_build(config)) if sp else layer
    with cuda_means_cpu():
        return GPTModel(
            config,
            spec,
            vocab_size=_VOCAB,
            max_sequence_length=_SEQ,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=share,
        )


def _train_step(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """One forward/backward of the global batch through megatron's schedule; returns this rank's
    per-sample losses {sample index: summed token loss} (last stage only)."""
    import megatron.core.parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = _GLOBAL_BATCH // dp
    size = per_rank // _MICROBATCHES
    microbatch = itertools.count()
    losses: dict[int, torch.Tensor] = {}
    positions = torch.arange(_SEQ).expand(size, _SEQ)
    causal = torch.ones(1, 1, _SEQ, _SEQ).tril() < 0.5

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> Any:
        offset = dp_rank * per_rank + next(microbatch) * size
        ids = _DATA[offset : offset + size]
        with rm.batch_position(offset, _GLOBAL_BATCH):
            output = model(ids, positions, causal, labels=ids)

        def loss(per_token: torch.Tensor) -> Any:
            for i, value in enumerate(per_token.detach().sum(dim=1)):
                losses[offset + i] = value
            total = (per_token * torch.linspace(0.5, 1.5, _SEQ)).sum()
            return total, {"loss": total.detach()}

        return output, loss

    model.zero_grad(set_to_none=True)
    with cuda_means_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[model],
            num_microbatches=_MICROBATCHES,
            seq_length=_SEQ,
            micro_batch_size=size,
        )
    return losses


# -- gathering what every rank holds into logical tensors ----------------------------------------
def _place(pieces: list[tuple[str, tuple, tuple, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each key's pieces (global shape, offset, local values) placed in its logical tensor; pieces
    that overlap (replicas, recomputes) must agree bitwise and every element must be covered."""
    placed: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for key, shape, offset, values in pieces:
        if key not in placed:
            placed[key] = torch.zeros(shape, dtype=values.dtype)
            filled[key] = torch.zeros(shape, dtype=torch.bool)
        box = tuple(slice(o, o + n) for o, n in zip(offset, values.shape, strict=True))
        seen = filled[key][box]
        assert torch.equal(placed[key][box][seen], values[seen]), (
            f"{key}: overlapping pieces differ"
        )
        placed[key][box] = values
        filled[key][box] = True
    for key, mask in filled.items():
        assert bool(mask.all()), f"{key}: {int((~mask).sum())} elements no rank holds"
    return placed


def _gathered(pieces: list) -> dict[str, torch.Tensor]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    return _place([piece for rank in everyone for piece in rank])


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its logical tensor, keyed as megatron's sharded_state_dict()."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    pieces = []
    for box in nested_values(state):
        if isinstance(box, ShardedTensor) and box.data is not None:
            data = box.data.detach()[(None,) * box.prepend_axis_num].clone()
            pieces.append((box.key, box.global_shape, box.global_offset, data))
    return _gathered(pieces)


def _masks(records: list) -> dict[str, torch.Tensor]:
    """Every keyed site's draws (keep masks, jitter noise) over the whole global batch."""
    return _gathered([(s, r.global_shape, r.offset, t) for s, r, t in records])


def _losses(local: dict[int, torch.Tensor]) -> torch.Tensor:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged: dict[int, torch.Tensor] = {}
    for part in everyone:
        for sample, value in part.items():
            assert sample not in merged or torch.equal(merged[sample], value), sample
            merged[sample] = value
    assert sorted(merged) == list(range(_GLOBAL_BATCH)), sorted(merged)
    return torch.stack([merged[i] for i in range(_GLOBAL_BATCH)])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Within fp32 summation order: TP's all-reduces and microbatch sizes reorder sums.
    return bool(((a - b).abs() <= 1e-5 * b.abs()).all())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose logical tensors differ (all keys must be present in both)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [k for k in a if not torch.equal(a[k], b[k])]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _LargestAllocation(TorchFunctionMode):
    """The largest tensor a factory call (``torch.empty`` & co.) makes off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            isinstance(out, torch.Tensor)
            and out.device.type != "meta"
            and not (args and args[0] is out)
        ):
            self.largest = max(self.largest, out.numel())
        return out


# -- one layout ------------------------------------------------------------------------------
@contextlib.contextmanager
def _megatron_layout(tp: int = 1, pp: int = 1, ep: int = 1) -> Iterator[None]:
    """Megatron's parallel_state for one layout; every group it made is destroyed afterwards."""
    import megatron.core.parallel_state as ps

    before = process_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,
    )
    # Megatron allocates attention's scratch buffer on torch.cuda.current_device(): a CPU one
    ps.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(1 << 16)
    try:
        yield
    finally:
        destroy_megatron_groups(ps, before)


def _invariant(tp: int, pp: int, sp: bool, *, moe: bool = False, ep: int = 1) -> dict:
    """One layout in invariant mode: parameters (use_cpu_initialization False and True alike),
    one step's site draws and per-sample losses; every recompute mode gives the same gradients,
    losses and draws (forward and recompute) bitwise."""
    kw = {"moe": moe, "ep": ep}
    model = _build(tp, pp, sp, cpu_init=False, **kw)
    params = _parameters(model)
    cpu_initialised = _parameters(_build(tp, pp, sp, cpu_init=True, **kw))
    assert not _same(params, cpu_initialised), "use_cpu_initialization changes the values"
    with record() as records:
        losses = _train_step(model)
    grads, masks = _grads(model), _masks(records)
    for name, recompute in _RECOMPUTE.items():
        again = _build(tp, pp, sp, cpu_init=False, **kw, **recompute)
        with record() as recomputed:  # the recompute's draws land on the forward's: equal
            losses_again = _train_step(again)
        assert losses_again.keys() == losses.keys()
        assert all(torch.equal(losses[k], losses_again[k]) for k in losses), name
        grads_again = _grads(again)
        assert grads.keys() == grads_again.keys() and grads, name
        assert [n for n in grads if not torch.equal(grads[n], grads_again[n])] == [], name
        assert not _same(masks, _masks(recomputed)), name
    return {"params": params, "masks": masks, "losses": _losses(losses)}


def _plain(tp: int, pp: int, sp: bool, *, cpu_init: bool = False, **kw: Any) -> dict:
    model = _build(tp, pp, sp, cpu_init=cpu_init, **kw)
    return {"params": _parameters(model), "losses": _losses(_train_step(model))}


def _distinct_experts(params: dict[str, torch.Tensor]) -> bool:
    fc1 = params[_EXPERT_FC1]  # (layers, global experts, 2 ffn, hidden)
    return all(
        not torch.equal(fc1[layer, i], fc1[layer, j])
        for layer in range(fc1.shape[0])
        for i, j in itertools.combinations(range(fc1.shape[1]), 2)
    )


def _largest_local_parameter(model: torch.nn.Module) -> int:
    return max(p.numel() for p in model.parameters())


@pytest.mark.timeout(600)
@pytest.mark.distributed(world_size=4, timeout=540)
def test_megatron_gpt_model_draws_the_same_init_masks_and_losses_on_every_layout(rank):
    """Invariant: with one seed, megatron-core's own GPTModel under install(invariant=True) has
    every parameter's logical tensor bitwise equal to TP=1's at TP=2, TP=4, TP=2+SP, PP=2 and
    TP=2xPP=2+SP (use_cpu_initialization True and False), and MoE EP=2 to EP=1 (jitter on);
    every dropout and jitter site draws TP=1's global tensor bitwise; one step through
    get_forward_backward_func (2 microbatches) gives TP=1's per-sample losses within fp32
    summation order (1e-5 relative); full and selective recompute give gradients bitwise equal
    to no recompute on each layout. Plain install() in the same processes differs (parameters
    and losses), draws duplicate experts with use_cpu_initialization=True no longer, and builds
    full master weights where invariant mode builds none."""
    warnings.simplefilter("ignore")  # Megatron's warnings about TE/Apex and deprecations
    from rng_tracker.errors import MissingBatchPositionError

    rm.install(invariant=True)
    results = {}
    for name, (tp, pp, sp) in _DENSE.items():
        with _megatron_layout(tp, pp):
            results[name] = _invariant(tp, pp, sp)
            if name == "tp2":  # O(local): no rank builds a master weight (TP=2, CPU init)
                with _LargestAllocation() as allocated:
                    model = _build(tp, pp, sp, cpu_init=True)
                assert allocated.largest <= _largest_local_parameter(model), allocated.largest
                model.train()  # DP=2: a forward without a batch position is refused
                with pytest.raises(MissingBatchPositionError, match="batch_position"):
                    model(_DATA[:2], torch.arange(_SEQ).expand(2, _SEQ), None, labels=_DATA[:2])
    reference = results["tp1"]
    for name, result in results.items():
        assert _same(result["params"], reference["params"]) == [], name
        assert _same(result["masks"], reference["masks"]) == [], name
        assert _close(result["losses"], reference["losses"]), (name, result["losses"])
    assert len(reference["masks"]) == 7, sorted(reference["masks"])  # embedding + 3 per layer

    moe = {}
    for name, ep in (("ep1", 1), ("ep2", 2)):
        with _megatron_layout(ep=ep):
            moe[name] = _invariant(1, 1, False, moe=True, ep=ep)
    assert _same(moe["ep2"]["params"], moe["ep1"]["params"]) == []
    assert _same(moe["ep2"]["masks"], moe["ep1"]["masks"]) == []
    assert any(key.endswith("jitter") for key in moe["ep1"]["masks"])
    assert _close(moe["ep2"]["losses"], moe["ep1"]["losses"])
    assert _distinct_experts(moe["ep2"]["params"])

    rm.uninstall()
    rm.install()  # plain: megatron's values, which depend on the layout
    plain = {}
    for name in ("tp1", "tp2"):
        tp, pp, sp = _DENSE[name]
        with _megatron_layout(tp, pp):
            plain[name] = _plain(tp, pp, sp)
            if name == "tp2":
                with _LargestAllocation() as allocated:
                    model = _build(tp, pp, sp, cpu_init=True)
                assert allocated.largest > _largest_local_parameter(model)  # the probe sees it
    assert _same(plain["tp2"]["params"], plain["tp1"]["params"]) != []
    assert not _close(plain["tp2"]["losses"], plain["tp1"]["losses"])
    with _megatron_layout(ep=2):  # every global expert distinct, CPU init included
        for cpu_init in (False, True):
            experts = _plain(1, 1, False, cpu_init=cpu_init, moe=True, ep=2)["params"]
            assert _distinct_experts(experts), cpu_init
    rm.uninstall()


@pytest.mark.distributed(world_size=2, timeout=240)
def test_a_tied_embeddings_copy_on_the_last_stage_starts_as_the_embedding(rank):
    """share_embeddings_and_output_weights at PP=2, the embedding with an init of its own
    (embedding_init_method_std 0.05, the other weights 0.02): megatron starts the last stage's
    copy equal to the first stage's embedding; invariant mode filled the copy from the output
    layer's init (std 0.02) under the embedding's key. Both copies now equal PP=1's embedding."""
    warnings.simplefilter("ignore")
    rm.install(invariant=True)
    try:
        with _megatron_layout(pp=2):
            model = _build(1, 2, False, cpu_init=False, share=True, embedding_init_method_std=0.05)
            weight = model.shared_embedding_or_output_weight().detach()
            copies = [torch.empty_like(weight) for _ in range(2)]
            dist.all_gather(copies, weight)
        with _megatron_layout():  # PP=1 (DP=2): one stage holds the embedding and the head
            one = _build(1, 1, False, cpu_init=False, share=True, embedding_init_method_std=0.05)
            embedding = one.shared_embedding_or_output_weight().detach()
    finally:
        rm.uninstall()
    assert torch.equal(copies[0], embedding) and torch.equal(copies[1], embedding)


# -- a run saved at TP=2xPP=2 and resumed on other layouts ---------------------------------------
def _boxes(model: torch.nn.Module) -> list[Any]:
    """The model's ShardedTensors (factories built), each viewing this rank's box of a parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return [b for b in nested_values(state) if isinstance(b, ShardedTensor) and b.data is not None]


def _save(path: str, model: torch.nn.Module, iteration: int, rng: Any) -> None:
    """DCP checkpoint of the model (each parameter as its logical tensor, written once), the
    trainer's iteration and the RNG state."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": _parameters(model), "iteration": torch.tensor(iteration), "rng": rng},
        checkpoint_id=path,
    )


def _load(path: str, model: torch.nn.Module, rng: Any | None) -> int:
    """Load ``_save``'s checkpoint into ``model`` (each rank copies its boxes out of the logical
    tensors) and, when given, the RNG state; returns the trainer's iteration."""
    import torch.distributed.checkpoint as dcp

    boxes = _boxes(model)
    logical = {box.key: torch.empty(box.global_shape) for box in boxes}
    state = {"model": logical, "iteration": torch.tensor(-1)}
    if rng is not None:
        state["rng"] = rng
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for box in boxes:
            view = box.data.detach()[(None,) * box.prepend_axis_num]
            where = tuple(
                slice(o, o + n) for o, n in zip(box.global_offset, view.shape, strict=True)
            )
            view.copy_(logical[box.key][where])
    return int(state["iteration"])


def _rng_states() -> dict[str, Any]:
    """Every RNG state seeding touches: the CPU generator, the tracker's streams, the keyed state."""
    from rng_tracker._keyed import get_keyed_rng

    streams = rm.get_cuda_rng_tracker().get_states()
    return {
        "cpu": torch.get_rng_state(),
        "streams": {name: torch.as_tensor(state) for name, state in streams.items()},
        "keyed": get_keyed_rng().state_dict(),
    }


def _equal_states(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["cpu"], b["cpu"])
        and a["streams"].keys() == b["streams"].keys()
        and all(torch.equal(a["streams"][k], b["streams"][k]) for k in a["streams"])
        and a["keyed"] == b["keyed"]
    )


def _refused_seed(seed: Any, error: type[Exception] | None = None) -> str:
    """The message of the error (default InvariantSeedError) seeding with ``seed`` raises;
    asserts every RNG state is unchanged."""
    from rng_tracker.errors import InvariantSeedError

    before = _rng_states()
    with pytest.raises(error or InvariantSeedError) as refused:
        rm.model_parallel_cuda_manual_seed(seed)
    assert _equal_states(before, _rng_states())
    return str(refused.value)


@pytest.mark.timeout(300)
@pytest.mark.distributed(world_size=4, timeout=240)
def test_megatron_invariant_run_saved_at_tp2xpp2_resumes_at_tp4_and_tp1_with_the_uninterrupted_masks(
    rank, tmp_path
):
    """Invariant: in install(invariant=True), a megatron-core GPTModel run seeded as Megatron-LM's
    loop seeds it (seed + 100 * pipeline rank) keys everything by the base seed; trained one step
    through get_forward_backward_func at TP=2xPP=2 and saved by DCP with the model and
    rng_tracker.dcp.RNGStateful, it resumes in fresh state (megatron's groups re-initialised, the
    tracker reset and reseeded, the model rebuilt and loaded) at TP=4 and at TP=1 (DP=4), and its
    next step draws every site's global mask bitwise equal to the uninterrupted run's (losses
    within fp32 summation order), the per-rank streams re-derived with one warning. The same
    resume without the RNG state (reseeded from the config seed, as megatron-core ships) draws
    the first step's masks again, in a loop that advances the keyed step after each optimizer
    step; one that sets the step from the restored iteration before the forward does not. Seeds
    that are neither one seed nor Megatron-LM's pattern (per rank, data_parallel_random_init's
    + 10 * dp rank) are refused on every rank, changing no RNG state; a rank whose own seed is
    invalid, or a pipeline stage that cannot finish its model, makes the other ranks raise
    instead of wait."""
    warnings.simplefilter("ignore")  # Megatron's warnings about TE/Apex and deprecations
    import megatron.core.parallel_state as ps

    from rng_tracker._keyed import get_keyed_rng
    from rng_tracker.dcp import RNGStateful
    from rng_tracker.errors import (
        InvalidSeedError,
        MegatronInvariantInitError,
        MegatronInvariantUnsupportedError,
        RNGStateRederivedWarning,
    )

    path = str(tmp_path / "iteration1")
    rm.install(invariant=True)

    def rng_state(tp: int, pp: int, step: Callable[[], int] | None = None) -> RNGStateful:
        dp = dist.get_world_size() // (tp * pp)  # megatron's layout: RNGStateful compares it
        return RNGStateful(layout={"tp": tp, "pp": pp, "dp": dp}, step=step)

    # The run that saves: TP=2 x PP=2, Megatron-LM's per-stage seeds
    with _megatron_layout(2, 2):
        pp_rank = ps.get_pipeline_model_parallel_rank()
        assert "same seed" in _refused_seed(1234 + rank)
        # a rank whose own seed is refused: it raises its error, the others say so, none waits
        bad = _refused_seed(-1 if rank == 0 else 1234, InvalidSeedError if rank == 0 else None)
        assert rank == 0 or "rank 0 refused" in bad
        # a stage that cannot finish its model (an init invariant mode cannot key): the other
        # stage raises too instead of waiting in the all-gather of the stages' sites
        init = {"init_method": torch.nn.init.orthogonal_} if pp_rank == 1 else {}
        failed = MegatronInvariantInitError if pp_rank == 0 else MegatronInvariantUnsupportedError
        with pytest.raises(failed):
            _build(2, 2, False, cpu_init=False, **init)
        model = _build(2, 2, False, cpu_init=False, seed=1234 + 100 * pp_rank)
        assert get_keyed_rng().seed == 1234 and get_keyed_rng().step == 0
        initial = _parameters(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # no state to checkpoint
        iteration = 0
        with record() as records:
            _train_step(model)
        optimizer.step()
        iteration += 1
        rm.set_step(iteration)  # the loop advances the keyed step with its iteration
        _save(path, model, iteration, rng_state(2, 2, lambda: iteration))
        with record() as records_next:  # the uninterrupted run's next step
            losses = _losses(_train_step(model))
        first, uninterrupted = _masks(records), _masks(records_next)
    assert len(first) == 7 and all(not torch.equal(first[k], uninterrupted[k]) for k in first)

    for tp in (4, 1):  # resumed in fresh state, with the RNG state
        with _megatron_layout(tp, 1):
            if tp == 1:  # data_parallel_random_init's seeds (+ 10 * dp rank): refused
                dp_rank = ps.get_data_parallel_rank()
                assert "data_parallel_random_init" in _refused_seed(1234 + 10 * dp_rank)
            model = _build(tp, 1, False, cpu_init=False, seed=1234)
            assert _same(_parameters(model), initial) == [], tp  # the same init as the saved run
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                iteration = _load(path, model, rng_state(tp, 1))
            rederived = [w for w in caught if w.category is RNGStateRederivedWarning]
            assert len(rederived) == 1 and "model-parallel-rng" in str(rederived[0].message)
            assert iteration == 1 and get_keyed_rng().step == 1
            with record() as records_resumed:
                resumed_losses = _losses(_train_step(model))
            assert _same(_masks(records_resumed), uninterrupted) == [], tp
            assert _close(resumed_losses, losses), (tp, resumed_losses, losses)

            # the same resume without the RNG state: reseeded, the keyed step is 0 again
            model = _build(tp, 1, False, cpu_init=False, seed=1234)
            assert _load(path, model, None) == 1 and get_keyed_rng().step == 0
            with record() as records_reseeded:
                _train_step(model)
            assert _same(_masks(records_reseeded), first) == [], tp  # the first step's masks
            rm.set_step(1)  # a loop that sets the restored iteration's step before the forward
            with record() as records_set:
                _train_step(model)
            assert _same(_masks(records_set), uninterrupted) == [], tp
    rm.uninstall()


def _block(config: Any) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    return TransformerBlock(config, get_gpt_layer_local_spec())


@pytest.mark.distributed(world_size=1, timeout=240)
def test_megatron_invariant_mode_refuses_what_it_cannot_key_and_its_loop_calls_check_their_input(
    rank,
):
    """Invariant: what cannot be invariant is refused with a typed error naming the feature
    (TransformerEngine attention, context parallelism, RandomSTE, an init it cannot key, a
    parameter unfilled at the first forward, a model built before seeding); batch_position
    refuses positions outside the batch; a forward without one is refused under several
    microbatches and is the whole batch under one; set_step moves every mask; uninstall() puts
    megatron's own classes and functions back and keeps built models keyed."""
    warnings.simplefilter("ignore")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rng_tracker.errors import (
        BatchPositionError,
        BatchPositionTypeError,
        KeyedUnseededError,
        MegatronInstallError,
        MegatronInvariantInitError,
        MegatronInvariantUnsupportedError,
        MissingBatchPositionError,
    )

    originals = (
        GPTModel.__init__,
        TransformerConfig.__post_init__,
        layers._initialize_affine_weight_cpu,
        layers._initialize_affine_weight_gpu,
        schedules.forward_step,
    )
    rm.install(invariant=True)
    with pytest.raises(MegatronInstallError, match="uninstall"):
        rm.install()
    with _megatron_layout():
        with (
            pytest.raises(KeyedUnseededError, match="model_parallel_cuda_manual_seed"),
            cuda_means_cpu(),
        ):  # (_build seeds: build without it)
            GPTModel(_config(1, 1, False, cpu_init=True), get_gpt_layer_local_spec(), 64, _SEQ)
        with pytest.raises(MegatronInvariantUnsupportedError, match="context parallelism"):
            _config(1, 1, False, cpu_init=True, context_parallel_size=2)
        with pytest.raises(MegatronInvariantUnsupportedError, match="RandomSTE"):
            _config(1, 1, False, cpu_init=True, moe=True, moe_router_force_load_balancing=True)
        te_attention = get_gpt_layer_local_spec()
        te_attention.submodules.self_attention.submodules.core_attention = TEDotProductAttention
        with pytest.raises(MegatronInvariantUnsupportedError, match="TransformerEngine"):
            GPTModel(_config(1, 1, False, cpu_init=True), te_attention, _VOCAB, _SEQ)
        with pytest.raises(MegatronInvariantUnsupportedError, match="orthogonal_"):
            _build(1, 1, False, cpu_init=True, init_method=torch.nn.init.orthogonal_)
        block = _block(_config(1, 1, False, cpu_init=True))  # built outside a GPTModel
        with pytest.raises(MegatronInvariantInitError, match="never filled"):
            block(torch.randn(_SEQ, 2, 32), attention_mask=None)

        model = _build(1, 1, False, cpu_init=True)
        ids, positions = _DATA[:2], torch.arange(_SEQ).expand(2, _SEQ)
        causal = torch.ones(1, 1, _SEQ, _SEQ).tril() < 0.5

        def forward() -> tuple[torch.Tensor, list]:
            with record() as records:
                return model(ids, positions, causal, labels=ids).detach(), records

        for bad, error in (((-1, 8), BatchPositionError), ((8, 8), BatchPositionError)):
            with pytest.raises(error), rm.batch_position(*bad):
                pass
        with pytest.raises(BatchPositionTypeError), rm.batch_position("0", 8):
            pass
        with pytest.raises(BatchPositionError, match="does not fit"), rm.batch_position(7, 8):
            forward()
        whole, records = forward()  # one rank, one microbatch: the batch is the whole batch
        with rm.batch_position(0, 2):
            placed, placed_records = forward()
        assert torch.equal(whole, placed)
        assert not _same(_masks(records), _masks(placed_records))
        with pytest.raises(MissingBatchPositionError, match="2 microbatch"), cuda_means_cpu():
            schedules.forward_backward_no_pipelining(
                forward_step_func=lambda _, m: (m(ids, positions, causal, labels=ids), None),
                data_iterator=None,
                model=[model],
                num_microbatches=2,
                seq_length=_SEQ,
                micro_batch_size=2,
                forward_only=True,
            )
        rm.set_step(1)
        step1, step1_records = forward()
        assert not torch.equal(step1, whole)
        assert all(not torch.equal(a[2], b[2]) for a, b in zip(records, step1_records))
        rm.set_step(0)
        assert torch.equal(forward()[0], whole)
        model.eval()  # no dropout: no position needed, nothing drawn
        with record() as drawn:
            model(ids, positions, causal, labels=ids)
        assert drawn == []
        model.train()

        rm.uninstall()
        now = (
            GPTModel.__init__,
            TransformerConfig.__post_init__,
            layers._initialize_affine_weight_cpu,
            layers._initialize_affine_weight_gpu,
            schedules.forward_step,
        )
        assert all(a is b for a, b in zip(now, originals, strict=True))
        rm.install()  # plain routing: a model built invariant stays keyed
        rm.model_parallel_cuda_manual_seed(99)
        assert torch.equal(forward()[0], whole)
        rm.uninstall()
