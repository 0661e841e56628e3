"""rng_tracker.megatron.install(): one call routes megatron-core's own modules to rng_tracker.

Routing is process-wide, so the claims about "imported before / after the call" run in fresh
Python processes (real megatron-core 0.19.2, no mocks); the version check runs here against
a real distribution record placed first on sys.path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rng_tracker.megatron
from rng_tracker.errors import ArgumentTypeError, MegatronVersionError, RNGTrackerError

_ENV = {**os.environ, "NO_VCS_VERSION": "1", "PYTHONWARNINGS": "ignore"}

# Runs in a fresh process: argv[1] is "before" (megatron's modules are imported, then
# install()) or "after" (install() first, then the modules).
_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import rng_tracker.megatron as ours

    # what install() derives (replaced_names) from megatron-core 0.19.2's random.py: every
    # function and class it defines that rng_tracker.megatron provides
    REPLACED_NAMES = [
        "CheckpointFunction", "CheckpointWithoutOutput", "CudaRNGStatesTracker", "_fork_rng",
        "_get_all_rng_states", "_get_cuda_rng_state", "_set_all_rng_states",
        "_set_cuda_rng_state", "checkpoint", "convert_cuda_rng_state", "get_all_rng_states",
        "get_cuda_rng_tracker", "get_data_parallel_rng_tracker_name",
        "get_expert_parallel_rng_tracker_name", "get_gtp_remat_rng_tracker_name",
        "initialize_rng_tracker", "is_checkpointing", "is_graph_safe_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed",
    ]

    MODULES = [
        "megatron.core.tensor_parallel",
        "megatron.core.transformer.cuda_graphs",
        "megatron.core.transformer.moe.moe_utils",
        "megatron.core.full_cuda_graph",
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
    ]

    def megatron_namespaces():
        return {n: dict(vars(m)) for n, m in list(sys.modules.items()) if n.startswith("megatron")}

    def holders(objects):
        ids = {id(o) for o in objects}
        return sorted(
            (n, a) for n, ns in megatron_namespaces().items() for a, v in ns.items() if id(v) in ids
        )

    if sys.argv[1] == "before":
        import importlib
        for name in MODULES:
            importlib.import_module(name)
        random = sys.modules["megatron.core.tensor_parallel.random"]
        originals = [getattr(random, n) for n in REPLACED_NAMES]
        before = megatron_namespaces()
        ours.install()
    else:
        ours.install()
        import importlib
        for name in MODULES:
            importlib.import_module(name)
        from rng_tracker._megatron_install import _SWAPS
        originals = [_SWAPS[n][0] for n in REPLACED_NAMES]
    ours.install()  # idempotent
    assert ours.installed()
    from rng_tracker._megatron_install import _SWAPS
    assert sorted(n for n in _SWAPS if "." not in n) == REPLACED_NAMES, sorted(_SWAPS)
    replacements = [getattr(ours, n) for n in REPLACED_NAMES]
    routed = holders(replacements)
    assert holders(originals) == [], holders(originals)
    # megatron-core's own code now runs on the CPU
    import megatron.core.tensor_parallel as tp
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import cuda_graphs
    tp.model_parallel_cuda_manual_seed(1234)
    with layers.get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    assert cuda_graphs.get_cuda_rng_tracker() is ours.get_cuda_rng_tracker()
    torch.manual_seed(0)
    with torch.random.fork_rng():
        ours.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        with ours.get_cuda_rng_tracker().fork():
            b = torch.rand(4)
    assert torch.equal(a, b)
    ours.uninstall()
    ours.uninstall()  # idempotent
    assert not ours.installed()
    assert holders(replacements) == []
    if sys.argv[1] == "before":
        after = megatron_namespaces()
        changed = [
            (n, a) for n, ns in before.items() for a, v in ns.items() if after[n].get(a) is not v
        ]
        assert changed == [], changed
    else:
        assert holders(originals) == routed, (holders(originals), routed)
    print(len(routed), "attributes routed")
    """
)


def _run(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode],
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_install_routes_every_megatron_module_imported_before_or_after_and_uninstall_restores():
    """Modules imported before install() are patched, modules imported after bind the
    replacements; nothing still holds one of random's originals (41 attributes on 0.19.2),
    Megatron's own calls run on the CPU, and uninstall() restores every original."""
    runs = {mode: _run(mode) for mode in ("before", "after")}
    for mode, process in runs.items():
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, f"{mode}:\n{out}"
        assert "41 attributes routed" in out, f"{mode}:\n{out}"


def test_importing_rng_tracker_never_imports_megatron():
    code = (
        "import sys, rng_tracker, rng_tracker.megatron, rng_tracker.parallel\n"
        "assert callable(rng_tracker.megatron.install)\n"
        "leaked = sorted(m for m in sys.modules if m.startswith('megatron'))\n"
        "assert not leaked, leaked\n"
    )
    subprocess.run([sys.executable, "-c", code], env=_ENV, check=True, timeout=120)


def _fake_distribution(root: Path, version: str) -> None:
    info = root / f"megatron_core-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n"
    )


def test_an_unknown_megatron_core_version_is_refused_by_name_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _fake_distribution(tmp_path, "0.99.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = {m for m in sys.modules if m.startswith("megatron")}
    with pytest.raises(MegatronVersionError) as caught:
        rng_tracker.megatron.install()
    assert isinstance(caught.value, RNGTrackerError) and isinstance(caught.value, RuntimeError)
    message = str(caught.value)
    assert "0.99.0" in message and "0.19.2" in message
    assert not rng_tracker.megatron.installed()
    assert {m for m in sys.modules if m.startswith("megatron")} == loaded


@pytest.mark.parametrize("flag", ["invariant", "allow_unknown_version"])
def test_install_flags_must_be_bools_and_a_refused_call_installs_nothing(flag: str):
    """install(invariant="no") would have installed invariant mode (a non-empty str is true)."""
    loaded = {m for m in sys.modules if m.startswith("megatron")}
    with pytest.raises(ArgumentTypeError, match=f"install\\({flag}=...\\) must be a bool"):
        rng_tracker.megatron.install(**{flag: "no"})
    assert not rng_tracker.megatron.installed()
    assert {m for m in sys.modules if m.startswith("megatron")} == loaded


def test_known_versions_include_the_tested_one():
    assert "0.19.2" in rng_tracker.megatron.KNOWN_MEGATRON_CORE_VERSIONS


def test_migrating_guide_shows_the_one_line_first_and_keeps_megatrons_parallel_state():
    text = (Path(__file__).resolve().parents[1] / "docs" / "migrating.md").read_text()
    first_code = text.split("```python", 1)[1].split("```", 1)[0]
    assert "rng_tracker.megatron.install()" in first_code
    sentences = " ".join(text.split()).split(". ")
    told_to_replace = [
        s
        for s in sentences
        if "initialize_model_parallel" in s
        and ("call `rng_tracker.parallel.init_model_parallel" in s or "replace" in s.lower())
    ]
    assert not told_to_replace, told_to_replace


def test_an_unknown_key_scheme_is_refused_for_invariant_mode_even_when_unknown_versions_are_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Invariant: install(invariant=True) keys every parameter by megatron-core's
    sharded_state_dict() scheme, so a release whose scheme it does not know is refused with
    MegatronVersionError naming the feature, whatever allow_unknown_version says; nothing
    changes."""
    _fake_distribution(tmp_path, "0.99.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = {m for m in sys.modules if m.startswith("megatron")}
    with pytest.raises(MegatronVersionError, match="key scheme") as caught:
        rng_tracker.megatron.install(invariant=True, allow_unknown_version=True)
    assert "0.99.0" in str(caught.value) and "invariant=True" in str(caught.value)
    assert not rng_tracker.megatron.installed()
    assert {m for m in sys.modules if m.startswith("megatron")} == loaded


def test_a_megatron_package_without_megatron_core_is_a_version_error(tmp_path: Path):
    """Invariant: a 'megatron' package that is not megatron-core (here one without
    megatron.core, first on sys.path) makes install() raise MegatronVersionError, not
    ModuleNotFoundError, and nothing is installed."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import rng_tracker.megatron as ours
        from rng_tracker.errors import MegatronVersionError
        try:
            ours.install()
        except MegatronVersionError as error:
            assert "megatron.core" in str(error) and {str(tmp_path)!r} in str(error), error
            assert not ours.installed()
            print("refused")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "refused" in out.stdout, out.stdout + out.stderr


_FORK_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import rng_tracker._megatron_install as machinery
    import rng_tracker.megatron as ours
    import megatron.core.tensor_parallel.random as random  # imported now: install() only swaps

    megatrons = random.get_cuda_rng_tracker
    swapping, swap = threading.Event(), machinery._swap_everywhere

    def slow_swap(table):  # a swap that takes a while, so the fork lands inside install()
        swapping.set()
        time.sleep(0.5)
        swap(table)

    machinery._swap_everywhere = slow_swap
    installer = threading.Thread(target=ours.install)
    installer.start()
    swapping.wait()
    pid = os.fork()
    if pid == 0:  # the child: its only thread must be able to use install() and uninstall()
        signal.alarm(20)  # a deadlocked child ends itself instead of outliving the test
        machinery._swap_everywhere = swap
        seen = ours.installed() and random.get_cuda_rng_tracker is ours.get_cuda_rng_tracker
        ours.uninstall()
        restored = random.get_cuda_rng_tracker is megatrons
        ours.install()
        ours.uninstall()
        os._exit(0 if seen and restored and random.get_cuda_rng_tracker is megatrons else 3)
    installer.join()
    _, status = os.waitpid(pid, 0)  # a child killed by its alarm exits -14
    print("child exit", os.waitstatus_to_exitcode(status))
    """
)


def test_a_fork_during_install_in_another_thread_leaves_the_child_a_whole_install():
    """Invariant: os.fork() while another thread is inside install() waits for it, so the child
    sees megatron either untouched or wholly routed, never holds a lock no thread of it owns (it
    used to deadlock), and its uninstall() puts megatron's own objects back (never rng_tracker's
    recorded as megatron's)."""
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT], env=_ENV, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "child exit 0" in out.stdout, out.stdout + out.stderr


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_install_code_does_not_import_the_facade_back():
    """rng_tracker.megatron imports _megatron_install (and, through it, _megatron_invariant);
    none of those imports rng_tracker.megatron, even lazily: the facade hands install() its
    replacements, so the arrows run one way and there is no import cycle."""
    package = Path(rng_tracker.megatron.__file__).parent
    paths = [
        package / "_megatron_install.py",
        *sorted((package / "_megatron_invariant").glob("*.py")),
    ]
    back = {
        f"{path.relative_to(package.parent)}: {module}"
        for path in paths
        for module in _imported_modules(path)
        if module == "rng_tracker.megatron"
    }
    assert not back, sorted(back)
