"""rng_tracker/kernels/_ops.py: every torch.library registration of the library, in one module.

Invariants: no other library module registers an op, a fake kernel or an autograd formula; the
three fused dropout ops (reference, compiled CPU, Triton where it imports) take one schema, so
the dispatcher can send one call to any of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rng_tracker.kernels import _ops

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
