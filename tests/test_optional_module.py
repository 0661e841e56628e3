"""OptionalModule: an optional framework's module, found only if imported, and safe to trace.

Invariants: it never imports the module; eager, each call sees the process's modules now; a
compiled caller is not compiled again when unrelated modules are imported (a traced
``sys.modules`` lookup made Dynamo guard on the count of imported modules), and it sees the
module once the module is imported and an eager call has looked again: one compile more.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch._dynamo.utils import counters

from rng_tracker._optional_module import OptionalModule


def _write_module(tmp_path, name: str) -> None:
    (tmp_path / f"{name}.py").write_text("ANSWER = 42\n")


def test_it_finds_a_module_only_once_imported_and_never_imports_it(monkeypatch, tmp_path):
    name = "rng_tracker_test_optional_eager"
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, name)
    look = OptionalModule(name)
    assert look() is None and name not in sys.modules
    try:
        module = importlib.import_module(name)
        assert look() is module
        del sys.modules[name]
        assert look() is None
    finally:
        sys.modules.pop(name, None)


def test_a_compiled_caller_is_not_compiled_again_by_imports_and_sees_a_late_module(
    monkeypatch, tmp_path
):
    name = "rng_tracker_test_optional_late"
    monkeypatch.syspath_prepend(str(tmp_path))
    look = OptionalModule(name)

    def step(x: torch.Tensor) -> torch.Tensor:
        module = look()
        return x + 1 if module is None else x * module.ANSWER

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.ones(3)
    graphs = []
    for i in range(3):
        assert torch.equal(compiled(x), x + 1)
        graphs.append(counters["stats"]["unique_graphs"])
        other = f"rng_tracker_test_optional_other_{i}"
        _write_module(tmp_path, other)
        importlib.import_module(other)  # one unrelated module more, as a first backward imports
    assert graphs == [1, 1, 1]

    _write_module(tmp_path, name)
    importlib.import_module(name)  # stays imported, as a real framework does
    assert torch.equal(compiled(x), x + 1)  # the graph guards the module found by its trace
    assert look() is sys.modules[name]  # an eager look (seeding, the facade) sees it
    assert torch.equal(compiled(x), x * 42)
    assert counters["stats"]["unique_graphs"] == 2
