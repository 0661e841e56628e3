"""rng_tracker.parallel._megatron_state: Megatron's parallel state is enough (a ParallelLayout
beside rng_tracker's own), and init_model_parallel(order=...) is Megatron's layout.

Real megatron-core 0.19.2 ``parallel_state`` on real gloo ranks, in the same processes as
rng_tracker's own parallel state.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _python_probe import run_python

import rng_tracker.megatron as megatron
from rng_tracker import ParallelLayout
from rng_tracker.errors import (
    ParallelConfigError,
    ParallelStateError,
    ParallelStateMismatchError,
)
from rng_tracker.parallel import verify_rng_consistency
from rng_tracker.parallel._megatron_state import (
    MegatronParallelState,
    current_layout,
    megatron_parallel_state_or_none,
)
from rng_tracker.parallel._mesh import destroy_model_parallel, init_model_parallel

# (tensor, pipeline, context, expert) on 8 ranks; data parallel is what is left. Cycling them
# over the 120 orders gives each size every relative order of its axes above size 1, dense and
# expert, and includes sizes for which Megatron refuses orders that do not end in "pp".
_SIZES_8 = ((2, 2, 1, 1), (2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 1, 2), (2, 2, 1, 2))
_ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]
_AXES = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")


def _layout_of(state) -> dict[str, tuple[int, tuple[int, ...]]]:
    """axis -> (this rank's coordinate, the global ranks of its group)."""
    return {
        axis: (state.rank(axis), tuple(dist.get_process_group_ranks(state.group(axis))))
        for axis in _AXES
    }


def _process_groups() -> list[dist.ProcessGroup]:
    # torch has no public list of live groups; its registry is the only way to find the
    # groups Megatron's destroy_model_parallel() forgets without destroying
    return list(dist.distributed_c10d._world.pg_map)


def _destroy_megatron_state(ps, before: list[dist.ProcessGroup]) -> None:
    """ps.destroy_model_parallel() and destroy the groups it leaves alive: each gloo group
    holds threads, and 123 layouts on 8 ranks would pile up thousands of them."""
    ps.destroy_model_parallel()
    dist.barrier()  # every rank has finished connecting Megatron's groups before any closes them
    for group in _process_groups():
        if all(group is not g for g in before):
            dist.destroy_process_group(group)


def _compare_order(ps, order: str, sizes: tuple[int, int, int, int]) -> str:
    tp, pp, cp, ep = sizes
    before = _process_groups()
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            order=order,
            create_gloo_process_groups=False,
        )
    except (AssertionError, RuntimeError) as refusal:
        # Megatron refuses a layout with an assert, or with this RuntimeError for an axis the
        # order leaves out; any other error (a gloo failure, say) is not a refusal
        if isinstance(refusal, RuntimeError) and "specified the order" not in str(refusal):
            raise
        _destroy_megatron_state(ps, before)
        with pytest.raises(ParallelConfigError):
            init_model_parallel(tensor=tp, pipeline=pp, context=cp, expert=ep, order=order)
        return "refused"
    try:
        theirs = _layout_of(MegatronParallelState.from_module(ps))
    finally:
        _destroy_megatron_state(ps, before)
    try:
        ours = _layout_of(
            init_model_parallel(tensor=tp, pipeline=pp, context=cp, expert=ep, order=order)
        )
    finally:
        destroy_model_parallel()
    assert ours == theirs, (order, sizes, ours, theirs)
    assert len(_process_groups()) == len(before)  # ours are gone with destroy_model_parallel
    return "same"


@pytest.mark.timeout(420)  # ~60 s on 2 idle cores; 8 ranks crawl on a loaded machine
@pytest.mark.distributed(world_size=8, timeout=360)
def test_every_megatron_order_gives_megatron_coordinates_and_groups(rank):
    """For all 120 orders of Megatron's five axes (and orders that leave size-1 axes out),
    init_model_parallel gives every rank Megatron's coordinate and group on tp, pp, dp, cp,
    ep, etp and edp, and refuses exactly the orders Megatron refuses."""
    import megatron.core.parallel_state as ps

    # gloo connects each of the ~7,000 groups below when first used, not when made (none is)
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    outcomes = {"same": 0, "refused": 0}
    cases = [(order, _SIZES_8[i % len(_SIZES_8)]) for i, order in enumerate(_ORDERS)]
    cases += [("tp-pp-dp", (2, 2, 1, 1)), ("tp-dp-pp", (2, 2, 1, 1)), ("pp-tp", (4, 2, 1, 1))]
    for order, sizes in cases:
        outcomes[_compare_order(ps, order, sizes)] += 1
    # both branches are exercised: megatron-core 0.19.2 accepts 65 of these layouts and refuses
    # 58 (pp-last rule and pipeline groups that differ between dense and expert layers)
    assert outcomes == {"same": 65, "refused": 58}, outcomes
    with pytest.raises(ParallelConfigError, match="leaves out 'tp'"):
        init_model_parallel(tensor=2, order="cp-ep-dp-pp")
    with pytest.raises(ParallelConfigError, match="at most once"):
        init_model_parallel(order="tp-tp-dp")


def _dropout_block(x: torch.Tensor) -> torch.Tensor:
    with megatron.get_cuda_rng_tracker().fork():
        return torch.nn.functional.dropout(x * 2.0, 0.5)


@pytest.mark.distributed(world_size=4, timeout=120)
def test_megatron_parallel_state_alone_serves_seeding_checkpoints_and_verification(rank):
    """With only Megatron's parallel_state initialised (tp2 ep2 dp2, order "dp-tp-ep"):
    seeding takes Megatron's tp/ep/etp ranks, distribute_saved_activations its TP group,
    CheckpointWithoutOutput replays the streams, verify_rng_consistency places every rank by
    Megatron's coordinates; rng_tracker's own state takes precedence where both agree, and where
    they disagree every edge raises ParallelStateMismatchError; without either state nothing is
    guessed."""
    import megatron.core.parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        order="dp-tp-ep",
        create_gloo_process_groups=False,
    )
    tp, ep, etp = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
    )
    assert isinstance(current_layout(), MegatronParallelState)
    assert isinstance(current_layout(), ParallelLayout)  # what every layout= takes

    # seeding: Megatron's ranks, never a guess
    plan = megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    assert (plan.coordinates["tp"], plan.coordinates["ep"], plan.coordinates["etp"]) == (
        tp,
        ep,
        etp,
    )
    assert plan.coordinates["dp"] == ps.get_data_parallel_rank()
    states = megatron.get_cuda_rng_tracker().get_states()
    megatron.model_parallel_cuda_manual_seed(
        1234, tp_rank=tp, ep_rank=ep, etp_rank=etp, force_reset_rng=True
    )
    explicit = megatron.get_cuda_rng_tracker().get_states()
    assert all(torch.equal(states[name], explicit[name]) for name in explicit)

    # verify_rng_consistency: coordinates from Megatron
    report = verify_rng_consistency(plan=plan, strict=True)
    assert report.coordinates[rank]["tp"] == tp and report.coordinates[rank]["ep"] == ep

    # distribute_saved_activations: Megatron's TP group
    x = torch.randn(4, 6, requires_grad=True)
    reference = x.detach().clone().requires_grad_()
    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    out = megatron.checkpoint(_dropout_block, True, x)
    assert x.data.shape == (24 // 2,)  # this rank keeps 1/tp of args[0]
    out.sum().backward()
    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    expected = _dropout_block(reference)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, reference.grad)

    # CheckpointWithoutOutput replays the Megatron-seeded streams
    y = torch.randn(4, 6, requires_grad=True)
    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    ckpt = megatron.CheckpointWithoutOutput()
    h = ckpt.checkpoint(_dropout_block, y)
    z = h * y
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward()
    y2 = y.detach().clone().requires_grad_()
    megatron.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    (_dropout_block(y2) * y2).sum().backward()
    assert torch.equal(y.grad, y2.grad)

    # rng_tracker's own parallel state comes first where both agree; where they disagree
    # neither is trusted (it used to answer with rng_tracker's silently)
    ours = init_model_parallel(tensor=2, expert=2, order="dp-tp-ep")
    assert current_layout() is ours and isinstance(ours, ParallelLayout)
    destroy_model_parallel()
    init_model_parallel(tensor=4)
    with pytest.raises(ParallelStateMismatchError, match="tp: rng_tracker"):
        current_layout()
    with pytest.raises(ParallelStateMismatchError):
        verify_rng_consistency(plan=plan, strict=True)
    with pytest.raises(ParallelStateMismatchError):
        megatron.model_parallel_cuda_manual_seed(1234)
    destroy_model_parallel()

    # neither state: refused, not guessed
    ps.destroy_model_parallel()
    assert megatron_parallel_state_or_none() is None
    with pytest.raises(ParallelStateError):
        megatron.model_parallel_cuda_manual_seed(1234)


def test_megatron_state_is_read_only_if_megatron_was_imported():
    """In a fresh process (other tests here import megatron): without megatron imported the
    state is None and reading it imports nothing; imported but not initialised, still None."""
    code = (
        "import sys\n"
        "from rng_tracker.parallel._megatron_state import megatron_parallel_state_or_none\n"
        "assert megatron_parallel_state_or_none() is None\n"
        "leaked = sorted(m for m in sys.modules if m.startswith('megatron'))\n"
        "assert not leaked, leaked\n"
        "import megatron.core.parallel_state\n"
        "assert megatron_parallel_state_or_none() is None\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_seeding_reads_megatrons_virtual_ranks_as_its_getters_do():
    """Without torch.distributed, ranks set with Megatron's ``parallel_state.set_*_rank`` are
    what its getters return, so they are the ranks model_parallel_cuda_manual_seed seeds with
    (they were read as 0); an explicit rank still wins, and the etp rank falls back to the tp
    rank as Megatron's getter does."""
    import megatron.core.parallel_state as ps

    assert not dist.is_initialized()
    ps.set_tensor_model_parallel_rank(3)
    ps.set_expert_model_parallel_rank(2)
    try:
        tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        etp = ps.get_expert_tensor_parallel_rank()
        assert (tp, ep, etp) == (3, 2, 3)
        plan = megatron.model_parallel_cuda_manual_seed(10, force_reset_rng=True)
        assert plan.stream_seeds["model-parallel-rng"] == 10 + 2718 + tp
        assert plan.stream_seeds["expert-parallel-rng"] == 10 + 1024 + 100 * ep + etp
        ps.set_expert_tensor_parallel_rank(1)
        plan = megatron.model_parallel_cuda_manual_seed(10, tp_rank=0, force_reset_rng=True)
        assert (plan.coordinates["tp"], plan.coordinates["ep"], plan.coordinates["etp"]) == (
            0,
            2,
            1,
        )
    finally:
        ps.set_tensor_model_parallel_rank(None)
        ps.set_expert_model_parallel_rank(None)
        ps.set_expert_tensor_parallel_rank(None)
    plan = megatron.model_parallel_cuda_manual_seed(10, force_reset_rng=True)
    assert (plan.coordinates["tp"], plan.coordinates["ep"], plan.coordinates["etp"]) == (0, 0, 0)


_COMPILED_LOOKUP = """
import sys, tempfile, types, torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from rng_tracker._layout import process_layout

@torch.compile(fullgraph=True)
def data_parallel_size(x):
    layout = process_layout()
    return x + (0 if layout is None else layout.size("dp"))

def later_import(name):
    sys.modules[f"rng_tracker_test_{name}"] = types.ModuleType(name)

dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
data_parallel_size(torch.zeros(1))
later_import("first")
print(int(data_parallel_size(torch.zeros(1))), counters["stats"]["unique_graphs"])
import megatron.core.parallel_state as ps  # after the first compile; nothing eager looks at it
ps.initialize_model_parallel(create_gloo_process_groups=False)
torch._dynamo.reset()
print(int(data_parallel_size(torch.zeros(1))))  # traced anew: Megatron's layout, found then
later_import("second")
print(int(data_parallel_size(torch.zeros(1))), counters["stats"]["unique_graphs"])
dist.destroy_process_group()
"""


def test_compiled_code_finds_megatron_while_tracing_and_no_later_import_recompiles():
    """Traced by torch.compile, the lookup of Megatron's parallel state in sys.modules (where
    Megatron is not imported) made torch guard on the number of imported modules: every import
    after the compile recompiled the graph of each keyed site (torchtitan's compiled blocks;
    after eight, torch stops compiling them). The lookup now runs as the graph is traced:
    a later import keeps the graph, and Megatron imported before a trace is seen by it."""
    out = run_python(_COMPILED_LOOKUP, timeout=300).splitlines()
    assert out == ["0 1", "1", "1 2"]
