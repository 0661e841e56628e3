"""rng_tracker/kernels/_rng_source.py: a drawn seed under torch's tracing machinery.

Claims: under fake tensors a fused dropout is shape-only and leaves the generator as it was (as
torch's F.dropout does); make_fx and torch.export (strict=False) record the draw, so the traced
program reproduces the eager calls bit for bit, call after call, with a fresh mask each time;
strict export, which cannot record a draw from a generator, is refused with the way out; a
``seed=`` input traces under both export modes. A trace with symbolic sizes (make_fx's
"symbolic" mode, an export with a dynamic dim) is one program for every size, as torch's
F.dropout's is: no size is specialised or narrowed by the kernels' checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from rng_tracker.kernels import Chunk, bias_dropout_add, dropout


def _fused(x: torch.Tensor) -> torch.Tensor:
    return bias_dropout_add(dropout(x, 0.25), torch.ones(x.shape[-1]), x, 0.5)


class _Fused(torch.nn.Module):
    def forward(self, x: torch.Tensor, seed: torch.Tensor | None = None) -> torch.Tensor:
        if seed is not None:
            return dropout(x, 0.4, seed=seed)
        return _fused(x)


def _two_runs(function, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(11)
    return function(x), function(x)


def _assert_replays_eager(traced, x: torch.Tensor) -> None:
    """Two runs of ``traced`` from one generator state equal two eager calls bitwise, and the
    second run's masks are not the first's."""
    want = _two_runs(_fused, x)
    got = _two_runs(traced, x)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(got[0], got[1])


@pytest.mark.parametrize("generator", [None, "own"])
def test_under_fake_tensors_a_call_is_shape_only_and_draws_nothing(generator):
    own = torch.Generator().manual_seed(3) if generator else None
    source = own if own is not None else torch.default_generator
    before = source.get_state()
    with FakeTensorMode():
        x = torch.empty(6, 8)
        outs = [
            dropout(x, 0.3, generator=own),
            bias_dropout_add(x, torch.empty(8), x, 0.3, generator=own),
            F.dropout(x, 0.3),  # torch's, for comparison: also shape-only
        ]
    assert all(isinstance(out, FakeTensor) and out.shape == (6, 8) for out in outs)
    assert torch.equal(source.get_state(), before)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_make_fx_records_the_draw_and_replays_eager_bits(tracing_mode):
    x = torch.randn(6, 8)
    graph = make_fx(_fused, tracing_mode=tracing_mode)(x)
    names = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any(name.startswith("aten.randint") for name in names)  # drawn in the graph
    _assert_replays_eager(graph, x)


def test_a_non_strict_export_replays_eager_bits_call_after_call():
    x = torch.randn(6, 8)
    program = torch.export.export(_Fused(), (x,), strict=False).module()
    _assert_replays_eager(program, x)


def test_a_saved_and_loaded_export_follows_manual_seed_like_torchs_dropout(tmp_path):
    """The program draws from the default generator of the time it runs, as torch's F.dropout's
    does, not from a copy of the generator object saved with it: loaded, it follows
    torch.manual_seed and equals eager bitwise under each seed."""
    x = torch.randn(6, 8)
    torch.export.save(torch.export.export(_Fused(), (x,), strict=False), tmp_path / "fused.pt2")
    program = torch.export.load(tmp_path / "fused.pt2").module()
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = _fused(x)
        torch.manual_seed(seed)
        assert torch.equal(program(x).view(torch.int32), want.view(torch.int32))


def test_a_strict_export_of_a_drawn_seed_is_refused_with_the_way_out():
    x = torch.randn(6, 8)
    before = torch.get_rng_state()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Pass seed=") as caught:
        torch.export.export(_Fused(), (x,), strict=True)
    # Dynamo wraps the refusal (a KernelUnavailableError) in its own error; the message is ours
    assert "KernelUnavailableError" in str(caught.value)
    assert "strict=False" in str(caught.value)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("strict", [False, True])
def test_an_export_with_a_seed_input_takes_each_run_s_seed(strict):
    x = torch.randn(6, 8)
    seeds = [torch.tensor([7, 0, 0, 0]), torch.tensor([8, 2, 1, 0])]
    program = torch.export.export(_Fused(), (x, seeds[0]), strict=strict).module()
    outs = [program(x, seed) for seed in seeds]
    for seed, out in zip(seeds, outs):
        assert torch.equal(out.view(torch.int32), dropout(x, 0.4, seed=seed).view(torch.int32))
    assert not torch.equal(outs[0], outs[1])


def test_a_trace_with_symbolic_sizes_replays_eager_bits_at_every_size():
    """make_fx's symbolic mode and an export with a dynamic row dim give one program for every
    row count (the size checks did specialise it: the traced graph refused any other size, and
    export reported the dim as constant)."""
    rows = torch.export.Dim("rows", min=2)
    x = torch.randn(6, 8)
    programs = [
        make_fx(_fused, tracing_mode="symbolic")(x),
        torch.export.export(_Fused(), (x,), dynamic_shapes=({0: rows},), strict=False).module(),
    ]
    for program in programs:
        for n in (3, 10):
            _assert_replays_eager(program, torch.randn(n, 8))


class _Sharded(torch.nn.Module):
    """The second of two row chunks of a logical tensor, keyed: a shard placed by sizes."""

    def forward(self, x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return dropout(x, 0.4, seed=seed, shard=Chunk(0, 1, 2, extent=2 * x.shape[0]))


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("module", [_Fused, _Sharded], ids=["whole", "chunk"])
def test_an_export_with_dynamic_rows_and_a_seed_input_runs_every_size(strict, module):
    rows = torch.export.Dim("rows", min=2)
    seed = torch.tensor([7, 0, 3, 0])
    program = torch.export.export(
        module(), (torch.randn(6, 8), seed), dynamic_shapes=({0: rows}, None), strict=strict
    ).module()
    for n in (3, 10):
        x = torch.randn(n, 8)
        want = module()(x, seed)
        assert torch.equal(program(x, seed).view(torch.int32), want.view(torch.int32))
