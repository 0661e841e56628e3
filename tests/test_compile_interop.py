"""rng_tracker's dropout under torch.compile: the masks of eager, every step, also in recompute.

Invariants: a compiled model (fused ops, tracker forks, rng_tracker.checkpoint) returns
eager's outputs and gradients bit for bit over several steps, draws a fresh mask each step
and compiles nothing after its first step; where the compiler itself recomputes the op in
backward (a checkpointed region traced whole), the recompute reads the same seed tensor and
replays the forward's mask (pytorch#190758: Inductor's own dropout re-draws there).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from rng_tracker import RNGStatesTracker
from rng_tracker.activation_checkpoint import checkpoint
from rng_tracker.kernels import _cpu_kernel, bias_dropout_add, dropout


class _Block(torch.nn.Module):
    """x @ w1 -> dropout in a tracker fork -> relu -> @ w2, checkpointed; then bias-dropout-add."""

    def __init__(self, tracker: RNGStatesTracker, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g) / 4)
        self.w2 = torch.nn.Parameter(torch.randn(32, 16, generator=g) / 4)
        self.tracker = tracker

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1  # (tokens, 32)
        with self.tracker.fork("model-parallel-rng"):
            h = dropout(h, 0.25)
        return torch.relu(h) @ self.w2  # (tokens, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self._inner, x, use_reentrant=self.reentrant)
        return bias_dropout_add(inner, None, x, 0.1)


def _train(
    compiled: bool, steps: int = 3, reentrant: bool = False, rows: tuple[int, ...] = ()
) -> tuple[list[tuple[torch.Tensor, ...]], list[tuple[int, int]]]:
    """``steps`` steps on one input (or one step per row count in ``rows``, each its own input),
    and after each step (graphs compiled, frames Dynamo traced): a frame traced again without a
    new graph (e.g. the checkpoint's own code, whose ops run eagerly) is a recompile too."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(123)
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 77)
    model = _Block(tracker, reentrant)
    run = torch.compile(model) if compiled else model
    data = torch.Generator().manual_seed(5)
    # the same input and output gradient every step: only the masks can differ between steps
    x0, grad = torch.randn(24, 16, generator=data), torch.randn(24, 16, generator=data)
    results, graphs = [], []
    for n in rows or [None] * steps:
        if n is not None:
            x0, grad = torch.randn(n, 16, generator=data), torch.randn(n, 16, generator=data)
        x = x0.clone().requires_grad_()
        out = run(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, model.w1.grad.clone(), model.w2.grad.clone()))
        model.zero_grad()
        graphs.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    return results, graphs


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_compiled_model_draws_eager_masks_fresh_each_step_without_recompiling(reentrant):
    # impl="auto" runs the compiled CPU kernel in both runs: eager calls it directly, the
    # compiled graph through the rng_tracker::fused_dropout_cpu op. (The reentrant checkpoint
    # recompiled every step while it told its inputs apart by id(): a guard on each new tensor;
    # and both forms traced their own frame again at step 2, guarding the first call's caches.)
    assert _cpu_kernel.available(), _cpu_kernel._state["failed"]
    eager, _ = _train(compiled=False, reentrant=reentrant)
    compiled, graphs = _train(compiled=True, reentrant=reentrant)
    for step_eager, step_compiled in zip(eager, compiled, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            assert torch.equal(a, b)
    # a fresh mask each step: the same input gives another output and other gradients
    for a, b in zip(compiled[0], compiled[1], strict=True):
        assert not torch.equal(a, b)
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0]  # nothing traced after step 1


def test_a_compiled_model_takes_new_sizes_with_one_recompile_as_torchs_dropout():
    """Token counts that change between steps (the last batch, packed sequences): after the
    second size the compiler makes the size symbolic and compiles nothing more, as it does for
    torch's F.dropout, and each step equals eager bitwise. The kernels' size checks did
    specialise it: each new size compiled again, until Dynamo's recompile limit ran the rest
    eagerly."""
    rows = (24, 20, 28, 36, 12)
    eager, _ = _train(compiled=False, rows=rows)
    compiled, graphs = _train(compiled=True, rows=rows)
    for step_eager, step_compiled in zip(eager, compiled, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            assert torch.equal(a, b)
    assert graphs[1][0] > graphs[0][0] and graphs[2:] == [graphs[1]] * (len(rows) - 2)


def test_compiler_recompute_replays_the_forward_mask():
    """A checkpointed region traced whole (keyed seed: no graph break): Inductor's partitioner
    recomputes our op in backward from the same seed tensor, and the gradients equal eager's."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 32, generator=g, requires_grad=True)
    w2 = torch.randn(32, 16, generator=g, requires_grad=True)

    def block(h: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return torch.relu(dropout(h, 0.5, seed=seed)) @ w2

    def step(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(block, x @ w1, seed, use_reentrant=False)

    compiled_step = torch.compile(step, fullgraph=True)
    compiled_step(torch.randn(24, 16), torch.tensor([5, 0, 0, 0])).sum().backward()  # compile
    w1.grad = w2.grad = None
    for s in (1, 2):
        x = torch.randn(24, 16, generator=torch.Generator().manual_seed(s))
        seed = torch.tensor([1000 * s + 1, 0, 0, 0])
        grads, calls = [], []
        for fn in (step, compiled_step):
            with torch.profiler.profile() as prof:
                out = fn(x, seed)
                out.backward(torch.ones_like(out))
            calls.append(
                sum(
                    e.count
                    for e in prof.key_averages()
                    if e.key in ("rng_tracker::fused_dropout_cpu", "rng_tracker::fused_dropout")
                )
            )
            grads.append((out.detach(), w1.grad, w2.grad))
            w1.grad = w2.grad = None
        assert calls == [3, 3]  # forward, recompute in backward, gradient
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)


def _compiled_dropout_on_a_strided_shard() -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from rng_tracker.parallel import dtensor

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(32.0).reshape(8, 4) + 1
    x = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    seed = torch.tensor([1, 0, 2, 0])
    eager = dtensor.dropout(x, 0.5, seed=seed)
    compiled = torch.compile(lambda t: dtensor.dropout(t, 0.5, seed=seed), backend="aot_eager")(x)
    return torch.equal(compiled.full_tensor(), eager.full_tensor())


def test_dtensor_dropout_compiles_on_an_fsdp_tp_strided_shard():
    """Dynamo fails reading a _StridedShard's split_factor (torch's own code too: "cls_source must
    not be None"), so DTensor dropout on FSDP2 + TP's strided placement did not compile. It is
    read outside the graph now; the compiled call draws eager's mask."""
    from rng_tracker.parallel.testing import run_distributed

    assert (
        run_distributed(_compiled_dropout_on_a_strided_shard, world_size=4, timeout=300)
        == [True] * 4
    )


def _compiled_dtensor_ops_over_new_sizes() -> list[int]:
    """Keyed and drawn DTensor dropout and bias-dropout-add, compiled, over row counts that
    split evenly and unevenly between the two ranks: eager's bits at each; the graph count
    after each size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from rng_tracker.parallel import dtensor

    mesh = init_device_mesh("cpu", (2,))
    seed = torch.tensor([1, 0, 2, 0])
    bias = distribute_tensor(torch.linspace(-1, 1, 4), mesh, [Replicate()])

    def step(x: torch.Tensor) -> torch.Tensor:
        keyed = dtensor.dropout(x, 0.5, seed=seed)
        return dtensor.bias_dropout_add(keyed, bias, x, 0.25)  # drawn

    compiled = torch.compile(step, backend="aot_eager")
    graphs = []
    for rows in (6, 10, 7, 13, 14, 9, 18):
        x = distribute_tensor(
            torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows)), mesh, [Shard(0)]
        )
        state = torch.get_rng_state()
        want = step(x).full_tensor()
        torch.set_rng_state(state)
        assert torch.equal(compiled(x).full_tensor(), want)
        graphs.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    return graphs


def test_dtensor_ops_take_new_sizes_with_one_recompile():
    """DTensor ops placed a shard by index lists, which pinned the local size: each new row
    count compiled again. Placed by spans of symbolic sizes, the second size compiles again
    (Dynamo makes the size symbolic; the third once more, for a guard of Dynamo's on placement
    objects), and later sizes compile nothing, even and uneven splits alike."""
    from rng_tracker.parallel.testing import run_distributed

    for graphs in run_distributed(_compiled_dtensor_ops_over_new_sizes, world_size=2, timeout=300):
        assert graphs[1][0] > graphs[0][0] and graphs[3:] == [graphs[2]] * 4


def _compiled_dtensor_keyed_site() -> list[tuple[bool, int, int]]:
    """(compiled == eager, graphs, graph breaks) per step of a keyed DTensor dropout by site."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rng_tracker import get_keyed_rng
    from rng_tracker.parallel import dtensor

    torch._dynamo.reset()
    counters.clear()
    rng = get_keyed_rng("cpu")
    rng.manual_seed(3)
    rng.register("test.compile.dtensor")
    mesh = init_device_mesh("cpu", (2,))
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(0)])

    def drop(t):
        return dtensor.dropout(t, 0.5, site="test.compile.dtensor")

    compiled = torch.compile(drop, fullgraph=True, backend="aot_eager")
    steps = []
    for step in range(3):
        rng.set_step(step)
        same = torch.equal(compiled(x).full_tensor(), drop(x).full_tensor())
        breaks = sum(counters["graph_break"].values())
        steps.append((same, counters["stats"]["unique_graphs"], breaks))
    return steps


def test_a_keyed_dtensor_dropout_by_site_compiles_whole():
    """``dtensor.dropout(x, p, site=...)`` reads the site's words through seed_tensor, which
    Dynamo could not trace (fullgraph raised): now one graph on each rank, eager's mask at each
    step, nothing compiled again as the step moves."""
    from rng_tracker.parallel.testing import run_distributed

    for steps in run_distributed(_compiled_dtensor_keyed_site, world_size=2, timeout=300):
        assert steps == [(True, 1, 0)] * 3


class _KeyedSites(torch.nn.Module):
    """Two keyed sites, as a torchtitan block would hold them: a dropout, then bias-dropout-add."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rng_tracker.parallel.sites import site_dropout

        h = site_dropout("test.compile.a", x * 2, 0.5, rng_mode="keyed", batch_dim=0)
        return site_dropout(
            "test.compile.b", h, 0.25, rng_mode="keyed", batch_dim=0, bias=self.bias, residual=x
        )


def test_keyed_sites_compile_whole_with_fullgraph_and_follow_the_step(monkeypatch, tmp_path):
    """torchtitan compiles each block with fullgraph=True. A keyed site there failed: reading
    the fake mode and registering a new site (a BLAKE2b hash, device tensors) cannot be traced,
    so the first step raised (without fullgraph, these two sites split the forward into five
    graphs). Now a model whose sites are met first inside the compiled call is one graph: no
    graph break, nothing compiled again as the step moves (set_step, advance), outputs and input
    gradients bitwise eager's, a new mask at each step, and a module imported between steps
    (as a fresh process's first backward imports some) compiles nothing again: the layout
    lookup once made torch guard on the count of imported modules. A new seed compiles once
    more (a guard on it)."""
    import rng_tracker._keyed as keyed_module
    from rng_tracker import KeyedRNG

    rng = KeyedRNG("cpu", seed=7)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    torch._dynamo.reset()
    counters.clear()
    model = _KeyedSites()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    outs, graphs = [], []
    monkeypatch.syspath_prepend(str(tmp_path))
    for step in (0, 1, None, 5):
        if step is None:
            rng.advance()
        else:
            rng.set_step(step)
        module = f"rng_tracker_test_imported_at_step_{step}"
        (tmp_path / f"{module}.py").write_text("")
        importlib.import_module(module)  # one module more: stays imported, as a real one does
        results = []
        for run in (compiled, model):
            leaf = x.clone().requires_grad_()
            out = run(leaf)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), leaf.grad))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), rng.step
        outs.append(results[0][0])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 1] and not counters["graph_break"]
    assert "test.compile.a" in rng and "test.compile.b" in rng
    assert all(not torch.equal(outs[i], outs[i + 1]) for i in range(3))
    rng.manual_seed(8)
    assert torch.equal(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] == 2


def test_keyed_table_errors_stay_typed_under_compile(monkeypatch):
    """The table's lookups run while Dynamo traces and hand their verdict back to traced code,
    which raises: an unknown site, a colliding id and an unseeded table reach the caller of a
    compiled function as rng_tracker's own errors (an error raised inside the traced-time
    lookup would reach it as Dynamo's InternalTorchDynamoError), and nothing is registered."""
    import rng_tracker._keyed as keyed_module
    from rng_tracker import KeyedRNG
    from rng_tracker.errors import KeyedUnseededError, SiteCollisionError, UnknownSiteError

    rng = KeyedRNG("cpu", seed=7)
    rng.register("test.compile.taken", site_id=5)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    x = torch.zeros(4, dtype=torch.int64)
    calls = {
        UnknownSiteError: lambda t: t + rng.seed_tensor("test.compile.unknown"),
        SiteCollisionError: lambda t: t + rng.register("test.compile.other", site_id=5),
    }
    for error, call in calls.items():
        torch._dynamo.reset()
        with pytest.raises(error):
            torch.compile(call, backend="eager")(x)
    assert rng.sites == {"test.compile.taken": 5}
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), KeyedRNG("cpu"))
    torch._dynamo.reset()
    with pytest.raises(KeyedUnseededError):
        torch.compile(_KeyedSites(), backend="eager")(torch.ones(6, 16))
    assert keyed_module._KEYED_RNGS[torch.device("cpu")].sites == {}


def test_a_keyed_site_in_torchs_checkpoint_compiles_whole_and_recomputes_its_mask(monkeypatch):
    """The compiled-body recipe of docs/compile.md with a keyed site rather than a seed input:
    torch.utils.checkpoint around site_dropout under fullgraph=True is one graph, and outputs
    and gradients equal eager's bitwise at each step (the recompute draws the forward's mask)."""
    import rng_tracker._keyed as keyed_module
    from rng_tracker import KeyedRNG
    from rng_tracker.parallel.sites import site_dropout

    rng = KeyedRNG("cpu", seed=4)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        return torch.relu(
            site_dropout("test.compile.ckpt", h @ w, 0.5, rng_mode="keyed", batch_dim=0)
        )

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    for s in (0, 1):
        rng.set_step(s)
        results = []
        for run in (step, compiled):
            out = run(x)
            out.sum().backward()
            results.append((out.detach(), w.grad))
            w.grad = None
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), s
    assert counters["stats"]["unique_graphs"] == 1


def test_a_fork_in_a_compiled_frame_compiles_the_code_before_it_and_a_forked_call_the_code_around():
    """Dynamo cannot trace a fork's swap of generator states, nor resume in the entry of a
    ``with`` it cannot trace. ``tracker.fork()`` called in a compiled frame is a graph break at
    that call: the code before it compiles (one graph) and the rest of the frame runs eagerly.
    A fork object made outside the frame breaks at the ``with``: the frame runs eagerly (no
    graph). A fork in a function of its own, or the fork as a decorator, breaks the graph at
    that call only: the block around it compiles (two graphs). No form makes torch warn (the
    entry breaks before it reaches a builtin Dynamo cannot trace). Every form draws the
    stream's masks: outputs and gradients equal eager's bitwise at each step, and each step
    draws a fresh mask."""
    tracker = RNGStatesTracker("cpu")
    w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def fork_written_inline(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        with tracker.fork("model-parallel-rng"):
            h = F.dropout(h, 0.5)
        return (h * 2) @ w

    fork_made_outside = tracker.fork("model-parallel-rng")

    def fork_entered_inline(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        with fork_made_outside:
            h = F.dropout(h, 0.5)
        return (h * 2) @ w

    def forked_dropout(h: torch.Tensor) -> torch.Tensor:
        with tracker.fork("model-parallel-rng"):
            return F.dropout(h, 0.5)

    def fork_in_a_function(x: torch.Tensor) -> torch.Tensor:
        return (forked_dropout(x @ w) * 2) @ w

    decorated_dropout = tracker.fork("model-parallel-rng")(lambda h: F.dropout(h, 0.5))

    def fork_as_a_decorator(x: torch.Tensor) -> torch.Tensor:
        return (decorated_dropout(x @ w) * 2) @ w

    def steps(block: Any, compiled: bool) -> tuple[list[tuple[torch.Tensor, ...]], int]:
        torch._dynamo.reset()
        counters.clear()
        tracker.reset()
        tracker.add("model-parallel-rng", 77)
        run = torch.compile(block) if compiled else block
        results = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                x = torch.ones(4, 8, requires_grad=True)
                out = run(x)
                out.sum().backward()
                results.append((out.detach(), x.grad, w.grad.clone()))
                w.grad = None
        assert [str(warning.message) for warning in caught] == [], block.__name__
        # Dynamo warns once per process, so also: no break traced into the hooks the warning named
        breaks = list(counters["graph_break"])
        assert not [b for b in breaks if "saved_tensors" in b], (block.__name__, breaks)
        return results, counters["stats"]["unique_graphs"]

    for block, graphs in (
        (fork_written_inline, 1),
        (fork_entered_inline, 0),
        (fork_in_a_function, 2),
        (fork_as_a_decorator, 2),
    ):
        eager, _ = steps(block, compiled=False)
        compiled, compiled_graphs = steps(block, compiled=True)
        for step_eager, step_compiled in zip(eager, compiled, strict=True):
            for a, b in zip(step_eager, step_compiled, strict=True):
                assert torch.equal(a, b), block.__name__
        assert not torch.equal(compiled[0][0], compiled[1][0]), block.__name__
        assert compiled_graphs == graphs, block.__name__


def test_a_fork_where_no_graph_break_is_allowed_is_refused_with_the_way_out():
    """fullgraph=True (torchtitan compiles its blocks so) and error_on_graph_break allow no graph
    break, and a fork is one: Dynamo's error named a torch.compiler.disable()d function of
    rng_tracker. A fork written in the frame and a decorated call are refused with
    ForkTracedError, naming fullgraph and the keyed seed. A fork object made outside the frame
    Dynamo refuses itself, before any code of the fork runs (its error names the ``_Fork``
    context manager). The streams are left as they were and no fork stays open. Without
    fullgraph the same frames run (the test above)."""
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 77)
    before = tracker.get_states()["model-parallel-rng"]
    made_outside = tracker.fork("model-parallel-rng")
    decorated = tracker.fork("model-parallel-rng")(lambda h: F.dropout(h, 0.5))

    def written_inline(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("model-parallel-rng"):
            return F.dropout(x * 2, 0.5)

    def entered_inline(x: torch.Tensor) -> torch.Tensor:
        with made_outside:
            return F.dropout(x * 2, 0.5)

    def called(x: torch.Tensor) -> torch.Tensor:
        return decorated(x * 2) + 1

    def no_graph_break_allowed(block: Any) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            with torch._dynamo.error_on_graph_break(True):
                return block(x)

        return run

    for block, refused_by in (
        (written_inline, "ForkTracedError"),
        (called, "ForkTracedError"),
        (entered_inline, "`_Fork` context manager"),
    ):
        for compiled in (
            torch.compile(block, fullgraph=True),
            torch.compile(no_graph_break_allowed(block)),
        ):
            torch._dynamo.reset()
            with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
                compiled(torch.ones(4, 8))
            # Dynamo wraps our refusal in its own error; the message is ours
            assert refused_by in str(caught.value), block.__name__
            if refused_by == "ForkTracedError":
                assert "fullgraph" in str(caught.value) and "keyed seed" in str(caught.value)
            assert tracker.open_forks() == ()
            assert torch.equal(tracker.get_states()["model-parallel-rng"], before)


def test_a_checkpoint_where_no_graph_break_is_allowed_is_refused_with_the_way_out():
    """rng_tracker.checkpoint runs eagerly under torch.compile (a graph break), so fullgraph=True
    (torchtitan compiles its checkpoint-wrapped blocks so) failed with Dynamo's "HOP: Unsafe side
    effect" (non-reentrant), a disabled function of rng_tracker (reentrant, Megatron's form) or
    "torch.Generator method" (CheckpointWithoutOutput). Each is refused with
    CheckpointUsageError, naming fullgraph and the ways out; every generator and stream is left
    as it was."""
    from rng_tracker import CheckpointWithoutOutput
    from rng_tracker.activation_checkpoint import reentrant_checkpoint

    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 77)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def body(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.relu(x @ w), 0.1)

    def without_output(x: torch.Tensor) -> torch.Tensor:
        checkpointed = CheckpointWithoutOutput()
        out = checkpointed.checkpoint(body, x) * 2
        checkpointed.discard_output_and_register_recompute(out)
        return out

    forms = {
        "non-reentrant": lambda x: checkpoint(body, x, use_reentrant=False) * 2,
        "reentrant": lambda x: checkpoint(body, x, use_reentrant=True) * 2,
        "megatron's reentrant": lambda x: reentrant_checkpoint(body, x) * 2,
        "CheckpointWithoutOutput": without_output,
    }
    for name, step in forms.items():
        torch._dynamo.reset()
        streams, default = tracker.get_states(), torch.get_rng_state()
        with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
            torch.compile(step, fullgraph=True)(torch.ones(2, 8, requires_grad=True))
        assert "CheckpointUsageError" in str(caught.value), name
        assert "fullgraph" in str(caught.value) and "keyed sites" in str(caught.value), name
        assert torch.equal(torch.get_rng_state(), default), name
        after = tracker.get_states()
        assert all(torch.equal(after[key], streams[key]) for key in streams), name


def test_a_drawn_dropout_where_no_graph_break_is_allowed_names_the_keyed_seed():
    """A dropout that draws from a generator is one untraced step under torch.compile; under
    fullgraph=True Dynamo's error named only a disabled function of rng_tracker. The step now
    carries its reason, which Dynamo's error and graph-break log show: the keyed seed
    (``seed=``) for kernels.dropout, keyed sites for invariant_random's routed dropout."""
    from rng_tracker.parallel.invariant import invariant_random

    x = torch.ones(4, 8)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"with seed= .* compiles whole"):
        torch.compile(lambda t: dropout(t, 0.5) * 2, fullgraph=True)(x)
    torch._dynamo.reset()
    with invariant_random(), pytest.raises(torch._dynamo.exc.Unsupported, match="keyed sites"):
        torch.compile(lambda t: F.dropout(t, 0.5) * 2, fullgraph=True)(x)
    # with seed= the same call compiles whole, fullgraph included
    seed = torch.tensor([7, 0, 0, 0])
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: dropout(t, 0.5, seed=seed) * 2, fullgraph=True)
    assert torch.equal(compiled(x), dropout(x, 0.5, seed=seed) * 2)
