"""The private torch entry points in rng_tracker/_torch_private.py behave as their callers need."""

from __future__ import annotations

from typing import Any

import torch

from rng_tracker._torch_private import unchecked_apply


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _ScaledWithSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
        return x * factor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def test_unchecked_apply_is_the_functions_own_apply_without_the_python_wrapper():
    """A Function whose forward takes ctx gets torch's C++ apply: the same output, gradient and
    graph node as Function.apply. One with setup_context keeps Function.apply, whose wrapper
    binds its default arguments."""
    apply = unchecked_apply(_Scaled)
    # a built-in (C++) method bound to the class, not the Python Function.apply
    assert apply != _Scaled.apply and apply.__self__ is _Scaled
    assert type(apply).__name__ == "builtin_function_or_method"
    x = torch.arange(4.0, requires_grad=True)
    out = apply(x, 2.5)
    assert type(out.grad_fn).__name__ == "_ScaledBackward"
    (grad,) = torch.autograd.grad(out.sum(), x)
    want = _Scaled.apply(x, 2.5)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)

    kept = unchecked_apply(_ScaledWithSetupContext)
    assert kept == _ScaledWithSetupContext.apply
    assert torch.equal(kept(x), x * 3.0)  # the default argument, bound by the wrapper


def test_forward_ad_active_is_true_exactly_inside_a_dual_level():
    """The kernels look for tangents only where this says a dual level is open: torch's own
    level counter must still read -1 outside one and >= 0 inside."""
    import torch.autograd.forward_ad as fwAD

    from rng_tracker._torch_private import forward_ad_active

    assert not forward_ad_active()
    with fwAD.dual_level():
        assert forward_ad_active()
    assert not forward_ad_active()


def test_torch_checkpoint_forward_active_sees_both_of_torchs_checkpoints():
    """invariant_random refuses masks drawn where this says torch's checkpoint runs a forward:
    torch's names behind it (its saved-tensor hook, CheckpointFunction) must still say so."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from rng_tracker._torch_private import torch_checkpoint_forward_active

    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch_checkpoint_forward_active())
        return x * x  # saves x: backward recomputes

    x = torch.ones(2, requires_grad=True)
    probe(x)
    torch_checkpoint(probe, x, use_reentrant=False).sum().backward()
    torch_checkpoint(probe, x, use_reentrant=True).sum().backward()
    # [plain, non-reentrant forward, its recompute, reentrant forward, its recompute]
    assert seen == [False, True, False, True, False]


def test_vmap_may_be_active_is_true_exactly_where_a_vmap_runs_at_any_level():
    """A CUDA generator's draw is made a random op only under vmap (whose randomness rules must
    see it), not under jvp or grad alone, which would change CUDA masks for no rule: the helper
    tells vmap from the other transforms, nested either way."""
    from rng_tracker._torch_private import vmap_may_be_active

    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(vmap_may_be_active())
        return x

    x = torch.ones(2, 2)
    torch.func.vmap(probe)(x)
    torch.func.jvp(probe, (x,), (x,))
    torch.func.grad(lambda t: probe(t).sum())(x)
    torch.func.vmap(lambda t: torch.func.jvp(probe, (t,), (t,))[0])(x)
    torch.func.jvp(lambda t: torch.func.vmap(probe)(t), (x,), (x,))
    assert seen == [True, False, False, True, True]
    assert vmap_may_be_active() is False


def test_graph_tracing_active_is_true_under_make_fx_and_not_under_fake_tensors_alone():
    """make_fx's proxy mode records a graph (a host value read there becomes a constant); fake
    tensors alone record nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from rng_tracker._torch_private import graph_tracing_active

    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(graph_tracing_active())
        return x + 1

    make_fx(probe)(torch.zeros(2))
    make_fx(probe, tracing_mode="fake")(torch.zeros(2))
    with FakeTensorMode():
        probe(torch.zeros(2))
    probe(torch.zeros(2))
    assert seen == [True, True, False, False]


def test_run_while_tracing_marks_what_assume_constant_result_marks_and_dynamo_runs_it_once():
    """run_while_tracing sets exactly the attribute torch.compiler.assume_constant_result sets
    (a torch that marks otherwise fails here), and Dynamo then calls the function eagerly while
    tracing, with the real object, once: not in the compiled graph's later runs."""
    from rng_tracker._torch_private import run_while_tracing

    def public(x):
        return x

    def ours(x):
        return x

    before = set(vars(public))
    torch.compiler.assume_constant_result(public)
    assert {name: vars(public)[name] for name in set(vars(public)) - before} == vars(
        run_while_tracing(ours)
    )

    @run_while_tracing
    def host_work(log: list) -> int:
        log.append(len(log))
        return 3

    class Log(list):  # a user object: Dynamo passes the real one (guarded by identity)
        pass

    log = Log()
    compiled = torch.compile(lambda x: x * host_work(log), fullgraph=True, backend="eager")
    outs = [compiled(torch.ones(2)) for _ in range(3)]
    assert all(torch.equal(out, torch.full((2,), 3.0)) for out in outs)
    assert log == [0]


def test_dynamo_traced_checkpoint_body_is_the_subgraph_dynamo_traced_for_torchs_checkpoint():
    """While Dynamo traces, after a torch.utils.checkpoint, the accessor returns the body's
    traced graph (what invariant_random reads to warn only for a body that draws); outside a
    trace it returns None."""
    from torch.utils.checkpoint import checkpoint

    from rng_tracker._torch_private import dynamo_traced_checkpoint_body, run_while_tracing

    seen = []

    @run_while_tracing
    def look() -> bool:
        seen.append(dynamo_traced_checkpoint_body())
        return True

    def body(h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h) * 3

    def step(x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(body, x, use_reentrant=False)
        look()
        return y

    torch._dynamo.reset()
    torch.compile(step, backend="eager")(torch.ones(2, requires_grad=True))
    assert dynamo_traced_checkpoint_body() is None
    [graph_module] = seen
    assert isinstance(graph_module, torch.fx.GraphModule)
    called = [node.target for node in graph_module.graph.nodes if node.op == "call_function"]
    assert torch.relu in called


def test_run_eagerly_under_compile_is_one_graph_break_and_the_caller_compiles_once():
    """The wrapped function runs as itself in eager code and eagerly where torch.compile traces
    a call of it: the caller's graph breaks there once (a graph on each side), and a second
    call compiles nothing again (the disabled wrapper is made outside the trace)."""
    from torch._dynamo.utils import counters

    from rng_tracker._torch_private import run_eagerly_under_compile

    ran_compiling = []

    def host_step(x: torch.Tensor) -> torch.Tensor:
        ran_compiling.append(torch.compiler.is_compiling())
        return x + 1

    wrapped = run_eagerly_under_compile(host_step, reason="reads host state")
    assert torch.equal(wrapped(torch.zeros(2)), torch.ones(2)) and ran_compiling == [False]

    def caller(x: torch.Tensor) -> torch.Tensor:
        return wrapped(x * 2) * 3

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(caller, backend="eager")
    frames = []
    for _ in range(2):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 9.0))
        frames.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    assert ran_compiling == [False, False, False]  # never traced: run by the compiled code
    assert frames[0][0] == 2 and frames[1] == frames[0]


def test_dynamo_allows_no_graph_break_reads_the_trace_it_runs_in():
    """Read while Dynamo traces: True under fullgraph=True and error_on_graph_break(True), False
    under a plain torch.compile and outside any trace (what a fork reads to refuse a trace it
    cannot break)."""
    from rng_tracker._torch_private import dynamo_allows_no_graph_break

    seen = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(dynamo_allows_no_graph_break())
        return x + 1

    def strict_step(x: torch.Tensor) -> torch.Tensor:
        with torch._dynamo.error_on_graph_break(True):
            return step(x)

    for compiled in (
        torch.compile(step, backend="eager", fullgraph=True),
        torch.compile(step, backend="eager"),
        torch.compile(strict_step, backend="eager"),
    ):
        torch._dynamo.reset()
        compiled(torch.ones(2))
    assert seen == [True, False, True]
    assert dynamo_allows_no_graph_break() is False
