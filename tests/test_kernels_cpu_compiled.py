"""The compiled CPU dropout kernel (Inductor C++) against the plain-torch reference.

Invariant: for every dtype, op variant, size and placement, ``impl="cpu"`` (and ``"auto"``
on CPU, once warm) returns the reference's output bit for bit, forward and backward, and a
new size costs no recompile. Where no C++ compiler runs, the reference runs after one warning.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from rng_tracker.errors import KernelUnavailableError
from rng_tracker.kernels import Region, Shard, bias_dropout_add, cpu_compiled, dropout

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    # A failed compile falls back to the reference, which would then be compared with itself.
    assert cpu_compiled.compiled_cpu_available(), cpu_compiled._state["failed"]
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _inputs(shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g).to(dtype)
    x.view(-1)[:8] = torch.tensor(
        [-0.0, 0.0, float("inf"), -float("inf"), 1e-30, -1e-30, 3.0, -3.0]
    )
    bias = torch.randn(shape[-1], generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    residual.view(-1)[:4] = -0.0  # a dropped element must give +0.0 + -0.0 = +0.0, not -0.0
    return x, bias, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_variant_equals_the_reference_bitwise(dtype):
    """dropout, residual-only and bias+residual at an odd size (185 = 37 x 5, not a multiple of 4)."""
    x, bias, residual = _inputs((37, 5), dtype)
    for impl_args in (
        lambda impl: dropout(x, 0.3, generator=_gen(), impl=impl),
        lambda impl: bias_dropout_add(x, None, residual, 0.3, generator=_gen(), impl=impl),
        lambda impl: bias_dropout_add(x, bias, residual, 0.3, generator=_gen(), impl=impl),
    ):
        _assert_bitwise(impl_args("cpu"), impl_args("torch"))


@pytest.mark.parametrize(
    ("shape", "placement"),
    [
        ((5, 8), Shard(1, 1, 2, extent=16)),  # aligned, one division per group
        ((6, 4), Shard(-1, 1, 3, extent=10)),  # torch.chunk split of 10 (4, 4, 2): not aligned
        ((3, 5), Shard(0, 1, 3, extent=7)),  # a contiguous block at an unaligned offset
        ((2, 3, 6), Region((4, 5, 8), (1, 2, 1))),  # a 3-d box: two divisions, not aligned
        ((2, 2, 8), Region((3, 4, 16), (1, 1, 4))),  # a 3-d box, aligned
    ],
)
def test_shards_and_regions_equal_the_reference_bitwise(shape, placement):
    """Every placement draws the reference's mask of its global indices."""
    x, bias, residual = _inputs(shape, torch.float32)
    for op in (
        lambda impl: dropout(x, 0.4, shard=placement, generator=_gen(3), impl=impl),
        lambda impl: bias_dropout_add(
            x, bias, residual, 0.4, shard=placement, generator=_gen(3), impl=impl
        ),
    ):
        _assert_bitwise(op("cpu"), op("torch"))


def test_explicit_seed_words_equal_the_reference():
    """Counter words c2, c3 and a negative (high-bit) key reach the compiled Philox."""
    x, _, _ = _inputs((16, 9), torch.float32)
    seed = torch.tensor([-(2**63) + 12345, 2**40 + 7, 2**32 - 1, 99], dtype=torch.int64)
    _assert_bitwise(
        dropout(x, 0.5, seed=seed, impl="cpu"), dropout(x, 0.5, seed=seed, impl="torch")
    )


def test_backward_equals_the_reference_and_saves_only_the_seed():
    """Gradients of x and bias regenerate the forward's mask; the saved tensors are the seed."""
    x, bias, residual = _inputs((12, 8), torch.bfloat16)
    grad = torch.randn(12, 8).to(torch.bfloat16)
    grads = {}
    for impl in ("cpu", "torch"):
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t) or t, lambda t: t
        ):
            out = bias_dropout_add(*leaves, 0.3, generator=_gen(9), impl=impl)
        out.backward(grad)
        grads[impl] = [leaf.grad for leaf in leaves]
        assert [tuple(t.shape) for t in saved] == [(4,)]  # [key, base, c2, c3]
    for a, b in zip(grads["cpu"], grads["torch"], strict=True):
        _assert_bitwise(a, b)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_auto_switches_to_the_compiled_kernel_once_the_reference_has_cost_enough(monkeypatch):
    """impl="auto" on CPU runs the reference until AUTO_REFERENCE_SECONDS were spent in it."""
    x = torch.randn(8, 8)
    monkeypatch.setattr(cpu_compiled, "AUTO_REFERENCE_SECONDS", float("inf"))
    with _OpNames() as seen:
        cold = dropout(x, 0.5, generator=_gen())
    assert "rng_tracker.fused_dropout.default" in seen.names
    monkeypatch.setattr(cpu_compiled, "AUTO_REFERENCE_SECONDS", 0.0)
    with _OpNames() as seen:
        warm = dropout(x, 0.5, generator=_gen())
    assert "rng_tracker.fused_dropout_cpu.default" in seen.names
    _assert_bitwise(cold, warm)


def test_impl_cpu_refuses_other_devices_before_drawing():
    with pytest.raises(KernelUnavailableError, match="impl='cpu'"):
        dropout(torch.randn(8, device="meta"), 0.5, impl="cpu")


def test_new_sizes_do_not_recompile():
    """Dynamic shapes: after the first call, other sizes reuse the compiled graphs."""
    dropout(torch.randn(40, 8), 0.2, impl="cpu")
    graphs = counters["stats"]["unique_graphs"]
    for shape in ((100, 8), (3, 77), (1001,), (2, 3, 50)):
        x = torch.randn(shape)
        _assert_bitwise(
            dropout(x, 0.2, generator=_gen(5), impl="cpu"),
            dropout(x, 0.2, generator=_gen(5), impl="torch"),
        )
    assert counters["stats"]["unique_graphs"] == graphs


def test_without_a_cxx_compiler_the_reference_runs_after_one_warning(tmp_path):
    """A real missing compiler (CXX points nowhere, empty Inductor cache) in a fresh process."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from rng_tracker.kernels import dropout
        from rng_tracker.kernels.cpu_compiled import CompiledKernelFallbackWarning

        x = torch.randn(16, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [
                dropout(x, 0.5, generator=torch.Generator().manual_seed(s), impl="cpu")
                for s in (1, 2)
            ]
        fallbacks = [w for w in caught if issubclass(w.category, CompiledKernelFallbackWarning)]
        assert len(fallbacks) == 1, [str(w.message) for w in caught]
        assert "C++ compiler" in str(fallbacks[0].message)
        for s, out in zip((1, 2), outs):
            ref = dropout(x, 0.5, generator=torch.Generator().manual_seed(s), impl="torch")
            assert torch.equal(out, ref)
        print("fallback ok")
        """
    )
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallback ok" in result.stdout
