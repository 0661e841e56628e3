"""The public surface is what the README says it is, and every path the docs give imports.

- Each of ``rng_tracker``, ``rng_tracker.kernels`` and ``rng_tracker.parallel`` exports exactly
  the names of its table in README.md's "API" section (neither drifts from the other).
- No submodule is shadowed by a name of its package (``import rng_tracker.x as m`` is the module).
- Every dotted ``rng_tracker.…`` path in README.md and docs/*.md resolves, without a deprecation
  warning (the docs never teach a name on its way out).
- Only the public modules carry an ``__all__``; no module imports another's ``_private`` name; the
  modules import each other without a cycle.
- ``import rng_tracker`` (and the test harness) loads no sympy: torch's shape machinery costs
  every process, each rank included, over half a second to import.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest
from _python_probe import run_python

import rng_tracker

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rng_tracker", "rng_tracker.kernels", "rng_tracker.parallel")
_SECTION = re.compile(r"^### `(?P<module>[\w.]+)`\n(?P<body>.*?)(?=^#{2,3} )", re.S | re.M)
_LEADING_NAME = re.compile(r"^([A-Za-z_]\w*)(?:\(|$)")
_DOTTED = re.compile(r"(?<![\w.\"])rng_tracker(?:\.[A-Za-z_]\w*)+")


def _readme_api_tables() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    api = text[text.index("## API\n") :]
    tables = {}
    for match in _SECTION.finditer(api):
        names = []
        for line in match["body"].splitlines():
            if not line.startswith("| `"):
                continue
            first_cell = line[1:].split(" | ", 1)[0]
            for span in re.findall(r"`([^`]+)`", first_cell):
                leading = _LEADING_NAME.match(span)
                assert leading, f"README API row names {span!r}, not a name of the module"
                names.append(leading[1])
        tables[match["module"]] = names
    return tables


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_the_readme_table(package: str) -> None:
    tables = _readme_api_tables()
    assert package in tables, f"README.md's API section has no table for {package}"
    documented = tables[package]
    exported = importlib.import_module(package).__all__
    assert len(set(documented)) == len(documented), f"a name is listed twice: {documented}"
    assert len(set(exported)) == len(exported), f"__all__ repeats a name: {exported}"
    assert set(documented) == set(exported), (
        f"{package}: only in README {sorted(set(documented) - set(exported))}, "
        f"only in __all__ {sorted(set(exported) - set(documented))}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_without_warning(package: str) -> None:
    module = importlib.import_module(package)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in module.__all__:
            assert getattr(module, name) is not None


def _library_modules() -> list[str]:
    # Each package's own __path__: rng_tracker.kernels and rng_tracker.parallel live in folders
    # beside rng_tracker/ (setup.cfg's package_dir), so a walk from rng_tracker alone misses them.
    names, packages = list(PACKAGES[1:]), list(PACKAGES)
    while packages:
        package = packages.pop()
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            names.append(name)
            if info.ispkg:
                packages.append(name)
    return sorted(set(names))


def test_no_module_is_shadowed_by_a_name_of_its_package() -> None:
    modules = _library_modules()
    assert (
        "rng_tracker.activation_checkpoint" in modules
        and "rng_tracker.kernels._fused_dropout" in modules
    )
    shadowed = []
    for name in modules:
        module = importlib.import_module(name)
        parent, _, short = name.rpartition(".")
        if getattr(importlib.import_module(parent), short) is not module:
            shadowed.append(name)
    assert not shadowed, f"a name of the package hides these modules: {shadowed}"


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def _doc_paths() -> dict[str, str]:
    found: dict[str, str] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for match in _DOTTED.finditer(text):
            if text[max(0, match.start() - 4) : match.start()] == "ops.":
                continue  # torch.ops.rng_tracker.<op>: a registered op, checked by the kernel tests
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(match[0].rstrip("."), f"{doc.relative_to(ROOT)}:{line}")
    return found


def test_every_path_in_the_docs_resolves() -> None:
    paths = _doc_paths()
    assert "rng_tracker.megatron" in paths and "rng_tracker.parallel.dtensor" in paths
    broken = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path, where in sorted(paths.items()):
            try:
                _resolve(path)
            except (ImportError, AttributeError, DeprecationWarning) as exc:
                broken.append(f"{where}: {path} ({type(exc).__name__}: {exc})")
    assert not broken, "\n".join(broken)


def test_the_top_level_package_is_small_and_grouped() -> None:
    assert isinstance(rng_tracker, ModuleType)
    errors = [name for name in rng_tracker.__all__ if name.endswith(("Error", "Warning"))]
    # 22: the 0.1 surface of 20 plus ParallelLayout, the Protocol every layout= takes, and
    # batch_position, the training loop's one call for data parallelism and microbatches
    assert len(rng_tracker.__all__) <= 22 and len(errors) <= 6, rng_tracker.__all__


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def _readme_public_modules() -> set[str]:
    """The modules README.md's API section documents: its table headings and the modules named
    in the first column of its "Other modules" table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    api = text[text.index("## API\n") : text.index("\n## ", text.index("## API\n") + 1)]
    public = set(re.findall(r"^### `(rng_tracker[\w.]*)`", api, re.M))
    for line in api.splitlines():
        if line.startswith("| `rng_tracker"):
            for span in re.findall(r"`(rng_tracker[\w.]*)", line.split(" | ", 1)[0]):
                parts = span.split(".")
                for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
                    try:
                        importlib.import_module(".".join(parts[:cut]))
                    except ModuleNotFoundError:
                        continue
                    public.add(".".join(parts[:cut]))
                    break
    return public


def test_public_modules_are_the_readme_ones_and_only_they_have_an_all() -> None:
    """Every library module is either public (documented in README's API section, with an
    ``__all__``) or private by name (an ``_`` in its path, and no ``__all__``)."""
    documented = _readme_public_modules()
    undocumented, private_with_all = [], []
    for name in _library_modules():
        module = importlib.import_module(name)
        if _is_private(name):
            if hasattr(module, "__all__"):
                private_with_all.append(name)
        elif name not in documented and name != "rng_tracker.parallel.testing.pytest_plugin":
            undocumented.append(name)
    assert not undocumented, f"public by name but not in README's API section: {undocumented}"
    assert not private_with_all, f"private modules that declare an __all__: {private_with_all}"


def _is_submodule(package: str, name: str) -> bool:
    """``from package import name`` names a module (imported yet or not), not an attribute."""
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except ModuleNotFoundError:  # ``package`` is a module, not a package
        return False


def _imported_private_names(path: Path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
            "rng_tracker"
        ):
            continue
        for alias in node.names:
            if not alias.name.startswith("_") or alias.name.startswith("__"):
                continue
            if not _is_submodule(node.module, alias.name):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    """What two modules share has a real name in its one home: importing a private module is how
    the library's parts meet, importing another module's ``_name`` is not."""
    found = []
    for folder in ("rng_tracker", "parallel", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += _imported_private_names(path)
    assert not found, "\n".join(found)


def _module_paths() -> dict[str, Path]:
    """Every module of the library (``rng_tracker`` included) by its import name, with its file."""
    names = ["rng_tracker", *_library_modules()]
    return {name: Path(importlib.util.find_spec(name).origin) for name in names}


def _imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` imports anywhere in its text (lazy imports included)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the module's package
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return (found & modules.keys()) - {name}


def test_the_library_has_no_import_cycle() -> None:
    """The arrows between modules run one way: no module reaches itself through the modules it
    imports, counting imports inside functions (the lazy import that hides a cycle)."""
    modules = _module_paths()
    graph = {name: sorted(_imports_of(name, path, modules)) for name, path in modules.items()}
    state: dict[str, str] = {}
    path: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module], _ = "open", path.append(module)
        for imported in graph[module]:
            if state.get(imported) == "open":
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported)
        state[module], _ = "done", path.pop()

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert sum(map(len, graph.values())) > 100, "the import graph came out nearly empty"
    assert not cycles, "\n".join(cycles)


def test_importing_the_library_loads_no_sympy() -> None:
    """A size check made ``import rng_tracker`` import torch.fx.experimental.symbolic_shapes and
    so sympy (0.6 s here, in every process and rank); the check now finds it where a symbolic
    size exists, and only there."""
    probe = (
        "import sys, rng_tracker, rng_tracker.parallel.testing\n"
        "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') "
        "if m in sys.modules))"
    )
    assert run_python(probe).strip() == "[]"
