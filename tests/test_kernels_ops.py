"""rng_tracker/kernels/_ops.py: every torch.library registration of the library, in one module.

Invariants: no other library module registers an op, a fake kernel or an autograd formula; the
three fused dropout ops (reference, compiled CPU, Triton where it imports) take one schema, so
the dispatcher can send one call to any of them; ``keyed_seed`` reads the process's keyed words.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rng_tracker.kernels import Chunk, _ops
from rng_tracker.kernels._index_map import index_map_of, to_op_args

ROOT = Path(__file__).resolve().parents[1]
_REGISTERS = re.compile(
    r"torch\.library\.(custom_op|triton_op|Library|define|impl|register_fake|register_autograd)"
    r"|\.register_(fake|autograd|kernel)\("
)


def test_only_the_ops_module_registers_ops() -> None:
    """A registration (custom_op, triton_op, Library, define, impl, register_fake /
    register_autograd / register_kernel) appears in kernels/_ops.py and in no other module."""
    found = []
    for folder in ("rng_tracker", "parallel", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if _REGISTERS.search(code) and path.name != "_ops.py":
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    assert _REGISTERS.search((ROOT / "kernels" / "_ops.py").read_text())


def test_the_fused_dropout_ops_share_one_schema() -> None:
    """Every registered fused dropout op takes the same arguments and returns one tensor."""
    schemas = {
        route: str(op._opoverload._schema).split("(", 1)[1] for route, op in _ops.OPS.items()
    }
    assert {"reference", "cpu"} <= set(schemas)
    assert len(set(schemas.values())) == 1, schemas
    names = {route: str(op._opoverload._schema).split("(", 1)[0] for route, op in _ops.OPS.items()}
    assert names["reference"] == "rng_tracker::fused_dropout"
    assert names["cpu"] == "rng_tracker::fused_dropout_cpu"
    assert torch.ops.rng_tracker.fused_dropout_cpu.default is _ops.OPS["cpu"]._opoverload


def _opcheck_cases() -> list:
    """(x, bias, residual, shard) cases: dtypes, bias and residual present or not, a sharded
    placement, three dims, no elements."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
        cases.append((x, None, None, None))
        bias = torch.randn(8, dtype=dtype, requires_grad=True)
        residual = torch.randn(6, 8, dtype=dtype, requires_grad=True)
        cases.append((x, bias, residual, None))
    cases.append((torch.randn(2, 3, 4, requires_grad=True), None, None, Chunk(1, 1, 2, extent=6)))
    cases.append((torch.randn(0, 8), None, torch.randn(0, 8), None))
    return cases


@pytest.mark.parametrize("route", ["reference", "cpu"])
@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_each_op_passes_torch_library_opcheck(route, case):
    """torch.library.opcheck (torch's own test of a custom op: schema, autograd registration, fake
    kernel against the real one, AOT dispatch with dynamic shapes) passes for every op that runs
    on CPU, across the argument cases the dispatcher sends."""
    x, bias, residual, shard = _opcheck_cases()[case]
    seed = torch.tensor([1234, 5, 0, 0])
    args = (x, bias, residual, seed, 0.3, *to_op_args(index_map_of(x.shape, shard)))
    result = torch.library.opcheck(_ops.OPS[route], args)
    assert set(result.values()) == {"SUCCESS"}, result


def _bad_op_calls() -> dict[str, list[str]]:
    """Each op called straight with what a kernel would read out of bounds or misread: the
    error's type and message per call (or what the op returned)."""
    from rng_tracker.kernels import _ops

    x, seed = torch.ones(4, 8), torch.tensor([1, 2, 0, 0])
    whole = to_op_args(index_map_of(x.shape, None))
    calls = {
        "index map of more elements": (x, None, None, seed, 0.5, *to_op_args(index_map_of((400, 800), None))),
        "short residual": (x, torch.ones(8), torch.ones(1), seed, 0.5, *whole),
        "short bias": (x, torch.ones(2), torch.ones(4, 8), seed, 0.5, *whole),
        "bias of another dtype": (x, torch.ones(8, dtype=torch.float16), x, seed, 0.5, *whole),
        "residual of another dtype": (x, None, x.double(), seed, 0.5, *whole),
        "seed of 2 words": (x, None, None, seed[:2], 0.5, *whole),
        "p above 1": (x, None, None, seed, 1.5, *whole),
    }  # fmt: skip
    seen: dict[str, list[str]] = {}
    for route, op in _ops.OPS.items():
        for name, args in calls.items():
            try:
                out = op(*args)
                seen.setdefault(name, []).append(f"{route}: returned {tuple(out.shape)}")
            except Exception as error:
                seen.setdefault(name, []).append(f"{route}: {type(error).__name__}: {error}")
    return seen


def test_the_ops_refuse_calls_their_kernels_would_read_out_of_bounds() -> None:
    """torch.ops.rng_tracker.* are public, but only the public functions checked their calls:
    the compiled CPU op read past a short residual (returning other memory's bytes) and, given an
    index map of more elements than x, wrote past its output (the process died of SIGSEGV).
    Every op now refuses such a call with a typed error. Run on a rank of the harness, so a
    kernel that still crashes fails this test alone."""
    from rng_tracker.parallel.testing import run_distributed

    (seen,) = run_distributed(_bad_op_calls, world_size=1, timeout=120)
    expected_words = {
        "index map of more elements": "the IndexMap covers 320000 local elements but x has 32",
        "short residual": "residual must have shape (4, 8), got (1,)",
        "short bias": "bias must have shape (8,), got (2,)",
        "bias of another dtype": "bias is torch.float16 on cpu but x is torch.float32",
        "residual of another dtype": "residual is torch.float64 on cpu but x is torch.float32",
        "seed of 2 words": "seed must be an int64 tensor of 4 words",
        "p above 1": "dropout probability p must be in [0, 1], got 1.5",
    }
    for name, words in expected_words.items():
        assert len(seen[name]) == len(_ops.OPS), seen[name]
        for outcome in seen[name]:
            assert "KernelInputError: " in outcome and words in outcome, (name, outcome)


def test_the_keyed_seed_op_passes_opcheck_and_reads_the_process_keyed_rng(monkeypatch):
    """``keyed_seed`` (what an exported keyed site calls) passes torch.library.opcheck and
    returns the words seed_tensor gives, read from get_keyed_rng(device) at each call."""
    import rng_tracker._keyed as keyed_module
    from rng_tracker import KeyedRNG

    rng = KeyedRNG("cpu", seed=5)
    monkeypatch.setitem(keyed_module._KEYED_RNGS, torch.device("cpu"), rng)
    site = rng.register("test.ops.site")
    op = torch.ops.rng_tracker.keyed_seed.default
    assert torch.Tag.nondeterministic_seeded in op.tags  # never folded into a constant
    result = torch.library.opcheck(op, (torch.device("cpu"), site))
    assert set(result.values()) == {"SUCCESS"}, result
    for step in (0, 3):
        rng.set_step(step)
        assert torch.equal(op(torch.device("cpu"), site), rng.seed_tensor("test.ops.site"))
    assert op(torch.device("cpu"), site).tolist()[2:] == [site, 3]


@pytest.mark.skipif("triton" not in _ops.OPS, reason="needs triton (the test extras install it)")
def test_the_triton_op_called_where_triton_cannot_run_is_refused(monkeypatch) -> None:
    """torch.ops.rng_tracker.fused_dropout_triton on a CPU tensor without the interpreter raised
    Triton's own '0 active drivers'; dispatch never sends it there, but the op is public: now a
    KernelUnavailableError naming the ops that run there."""
    from rng_tracker.errors import KernelUnavailableError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.ones(4, 8)
    with pytest.raises(KernelUnavailableError, match="rng_tracker::fused_dropout"):
        torch.ops.rng_tracker.fused_dropout_triton(
            x, None, None, torch.zeros(4, dtype=torch.int64), 0.5, 0, [32, 1], 32
        )
