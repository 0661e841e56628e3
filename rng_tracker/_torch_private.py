"""Every private torch API rng_tracker uses, each named here with its guard.

torch offers no public equivalent of these. Keeping them in one module means a torch
release that moves one breaks a single import site, and each guard below says what the
library does when the name is gone.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.overrides
import torch.utils.checkpoint

# torch._subclasses.fake_tensor.is_fake: whether a tensor is fake, also inside functional and
# functorch wrappers. Required (import torch loads the module itself).
from torch._subclasses.fake_tensor import is_fake

_F = TypeVar("_F", bound=Callable[..., Any])

# torch.autograd.forward_ad._current_level: the innermost open dual_level, -1 where none is open.
# The kernels look for forward-mode tangents only inside one. Without it, every call looks.
_forward_ad = getattr(torch.autograd, "forward_ad", None)


def forward_ad_active() -> bool:
    """Whether a forward-mode AD ``dual_level`` is open (True where torch cannot say)."""
    level = getattr(_forward_ad, "_current_level", None)
    return True if level is None else level >= 0


# torch.autograd._is_checkpoint_valid: False inside torch.autograd.grad(), where a
# reentrant checkpoint cannot recompute. Without it, every backward is taken as valid.
_is_checkpoint_valid = getattr(torch.autograd, "_is_checkpoint_valid", None)


def checkpoint_valid() -> bool:
    """Whether a reentrant recompute may run here (False inside ``torch.autograd.grad``)."""
    return True if _is_checkpoint_valid is None else bool(_is_checkpoint_valid())


# torch._C._storage_Use_Count: how many tensors share a storage. Without it, selective
# recompute frees no output storage (it cannot tell whether another tensor uses it).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """References to ``storage`` (one per tensor on it, plus each storage object), or None
    where torch cannot say."""
    if _storage_use_count is None:
        return None
    return int(_storage_use_count(storage._cdata))


def storage_identity(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage object: the same for every view of it and for
    ``.data``, and distinct between storages even when empty (every empty storage has data
    pointer 0)."""
    return int(tensor.untyped_storage()._cdata)


# torch._C._len_torch_dispatch_stack and _are_functorch_transforms_active: whether any
# dispatch mode or functorch transform is active. Without them, the CPU kernel always goes
# through its registered op (correct, about 50 us slower per call).
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def dispatch_mode_depth() -> int | None:
    """How many torch dispatch modes are active, or None where torch cannot say."""
    return None if _dispatch_stack_len is None else int(_dispatch_stack_len())


# torch._C._get_dispatch_mode and _TorchDispatchModeKey: the slots of torch's own tracing modes
# (fake tensors, make_fx's proxy, functionalization), which the dispatch stack counts with the
# user's modes. Without them, every mode counts as torch's.
_get_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", None)
_MODE_KEY = getattr(torch._C, "_TorchDispatchModeKey", None)
_TRACING_MODE_KEYS = tuple(getattr(_MODE_KEY, "__members__", {}).values())
_PROXY = getattr(_MODE_KEY, "PROXY", None)
_FAKE = getattr(_MODE_KEY, "FAKE", None)


def tracing_mode_active() -> bool:
    """Whether one of torch's own tracing dispatch modes is active (True where torch cannot say)."""
    if _get_dispatch_mode is None or not _TRACING_MODE_KEYS:
        return True
    return any(_get_dispatch_mode(key) is not None for key in _TRACING_MODE_KEYS)


_pre_dispatch_mode = getattr(torch._ops, "_get_dispatch_mode_pre_dispatch", None)


def _proxy_mode_read() -> Any | None:
    return _get_dispatch_mode(_PROXY) or _pre_dispatch_mode(_PROXY)


def _proxy_mode_imported() -> Any | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode()


# make_fx's proxy mode, also where it records before dispatch (torch.export's non-strict trace),
# or None: torch.fx.experimental.proxy_tensor.get_proxy_mode's two reads, without importing it
# on every fork (where this torch lacks one of them, that function itself)
_proxy_mode = (
    _proxy_mode_read
    if _PROXY is not None and _get_dispatch_mode is not None and _pre_dispatch_mode is not None
    else _proxy_mode_imported
)


def graph_tracing_active() -> bool:
    """Whether make_fx's proxy mode records ops into a graph (torch.export's non-strict trace
    runs it too)."""
    return _proxy_mode() is not None


def recording_graph() -> Any | None:
    """The graph that make_fx's proxy mode (torch.export's non-strict trace runs it) records
    into, or None where none records."""
    mode = _proxy_mode()
    return None if mode is None else getattr(getattr(mode, "tracer", None), "graph", None)


def last_node(graph: Any) -> Any | None:
    """The node ``graph`` recorded last (None: none yet), to read what it records after."""
    return next(iter(reversed(graph.nodes)), None)


def records_a_draw(graph: Any, after: Any | None) -> bool:
    """Whether ``graph`` holds, after node ``after`` (None: from its start), an op torch tags as
    drawing from a generator (``torch.Tag.nondeterministic_seeded``: rand, dropout, randint,
    bernoulli_, ...). Reads only the nodes recorded since."""
    node = next(iter(graph.nodes), None) if after is None else after.next
    while node is not None and node.op != "root":  # the node list is a ring through its root
        tags = getattr(node.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags and not _in_eval(node):
            return True
        node = node.next
    return False


def _in_eval(node: Any) -> bool:
    """Whether ``node`` is a dropout recorded with ``train=False`` (an eval trace's: no draw)."""
    names = [argument.name for argument in node.target._schema.arguments]
    if "train" not in names:
        return False
    at = names.index("train")
    train = node.args[at] if at < len(node.args) else node.kwargs.get("train", True)
    return train is False


def active_fake_mode() -> Any | None:
    """The FakeTensorMode that is active, or None."""
    return None if _get_dispatch_mode is None or _FAKE is None else _get_dispatch_mode(_FAKE)


def holds_no_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no memory to read or write: on the meta device, or a fake tensor
    (``is_fake`` sees through functional and functorch wrappers)."""
    return tensor.device.type == "meta" or is_fake(tensor)


def functorch_transforms_active() -> bool | None:
    """Whether a functorch transform (vmap, grad, ...) is active, or None where torch cannot say."""
    return None if _functorch_active is None else bool(_functorch_active())


# torch._C._functorch.get_interpreter_stack: the active functorch transforms, outermost first
# (None when there are none), each with key() its TransformType. Without it, vmap_may_be_active
# answers as functorch_transforms_active does.
_functorch_c = getattr(torch._C, "_functorch", None)
_interpreter_stack = getattr(_functorch_c, "get_interpreter_stack", None)
_VMAP = getattr(getattr(_functorch_c, "TransformType", None), "Vmap", None)


def vmap_may_be_active() -> bool:
    """Whether a ``torch.func.vmap`` is active at any level (where torch cannot say which
    transforms are, whether any is)."""
    if _interpreter_stack is None or _VMAP is None:
        return bool(functorch_transforms_active())
    return any(interpreter.key() == _VMAP for interpreter in _interpreter_stack() or ())


# torch._C._FunctionBase.apply: an autograd.Function's apply in C++, which torch's Python
# Function.apply calls once it has found no functorch transform active. The straight kernel
# routes have found that already, and call it directly, without the wrapper's Python (its
# effect on the fixed cost: docs/benchmarks.md, "Fixed cost: the C++ apply"). Without the base
# class, they call Function.apply.
_function_base = getattr(torch._C, "_FunctionBase", None)


def unchecked_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` without torch's Python wrapper and its functorch checks, for callers
    that have found no functorch transform active (``function`` takes ctx in forward: with a
    ``setup_context`` the wrapper also binds default arguments, so it is kept)."""
    if (
        _function_base is None
        or not issubclass(function, _function_base)
        or function.setup_context is not torch.autograd.Function.setup_context
    ):
        return function.apply
    return super(torch.autograd.Function, function).apply


# torch._C._autograd._profiler_enabled: whether a torch profiler records. The CPU kernel names
# its eager calls in a trace only then (record_function costs microseconds per call). Without
# it, the calls are always named.
_profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (True where torch cannot say)."""
    return True if _profiler_enabled is None else bool(_profiler_enabled())


# torch.overrides._get_current_function_mode: the innermost torch function mode, which
# disable_invariant_random checks to refuse closing a mode out of order. Without it the
# check is skipped.
_get_current_function_mode = getattr(torch.overrides, "_get_current_function_mode", None)


def is_innermost_function_mode(mode: Any) -> bool:
    """Whether ``mode`` is the innermost active ``TorchFunctionMode`` (True where torch cannot say)."""
    return _get_current_function_mode is None or _get_current_function_mode() is mode


# torch.overrides._get_current_function_mode_stack: the active torch function modes, outermost
# first. A checkpoint reads it at the forward to enter invariant_random again around a recompute
# (autograd's engine runs backward without the caller's function modes). Without it nothing is
# entered again (docs/compile.md says what then differs).
_get_function_mode_stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)


def function_mode_stack() -> list[Any]:
    """The active torch function modes, outermost first (none where torch cannot say)."""
    return [] if _get_function_mode_stack is None else list(_get_function_mode_stack())


# torch._C._autograd._top_saved_tensors_default_hooks and the names of torch.utils.checkpoint's
# internals: whether torch's own checkpoint is running a forward (its non-reentrant form installs
# _checkpoint_hook's saved-tensor hooks; its reentrant form runs CheckpointFunction.forward under
# no_grad). invariant_random refuses to draw there, since torch's recompute runs without the mode.
# Without them the check answers False (the draw is not refused).
_top_saved_tensors_hooks = getattr(
    getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None
)
_reentrant_forward_code = getattr(
    getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None),
    "__code__",
    None,
)


def innermost_pack_hook() -> Any | None:
    """The pack hook of the innermost saved-tensor hooks (None: none, or torch cannot say)."""
    if _top_saved_tensors_hooks is None:
        return None
    hooks = _top_saved_tensors_hooks(False)
    return hooks[0] if hooks else None


def is_torch_checkpoint_hook(hook: Any) -> bool:
    """Whether ``hook`` is the pack hook of a forward of torch's non-reentrant checkpoint."""
    return getattr(hook, "__qualname__", "").startswith("_checkpoint_hook.")


def torch_checkpoint_forward_active() -> bool:
    """Whether a forward of ``torch.utils.checkpoint`` is running here (False where torch
    cannot say): its non-reentrant hooks are the innermost, or, under no_grad, its reentrant
    ``CheckpointFunction.forward`` is on the stack."""
    return (
        is_torch_checkpoint_hook(innermost_pack_hook())
        or torch_reentrant_checkpoint_forward_active()
    )


def torch_reentrant_checkpoint_forward_active() -> bool:
    """Whether, under no_grad, torch's reentrant ``CheckpointFunction.forward`` is on the stack
    (a stack walk: kept off paths that run where no_grad is common)."""
    if torch.is_grad_enabled() or _reentrant_forward_code is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _reentrant_forward_code:
            return True
        frame = frame.f_back
    return False


def run_while_tracing(function: _F) -> _F:
    """Mark ``function`` as ``torch.compiler.assume_constant_result`` does, without importing
    Dynamo with the core: Dynamo calls it eagerly while it traces (real arguments, its side
    effects done once) and keeps its result as a constant of the graph. The public function
    sets this attribute and nothing else (``tests/test_torch_private.py`` checks it). Without
    the attribute Dynamo would trace the function (a graph break where it cannot)."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


# torch._dynamo's InstructionTranslator.current_tx().output: the graph Dynamo is building and
# its submodules; torch.utils.checkpoint enters it as a tag_activation_checkpoint node whose first
# argument names its body's graph. Without them the body is unknown (None).
def dynamo_traced_checkpoint_body() -> torch.fx.GraphModule | None:
    """While Dynamo traces: the body of the last torch.utils.checkpoint in the graph it is
    building (the subgraph it traced for it), else None, also where torch's internals differ."""
    checkpoint_op = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
        for node in reversed(output.graph.nodes):
            if node.op == "call_function" and node.target is checkpoint_op:
                body = node.args[0] if node.args else None
                if getattr(body, "op", None) != "get_attr":
                    return None
                found = output.nn_modules.get(body.target)
                return found if isinstance(found, torch.fx.GraphModule) else None
    except (ImportError, AttributeError, TypeError):
        return None
    return None


@run_while_tracing
def dynamo_allows_no_graph_break() -> bool:
    """While Dynamo traces: whether this trace allows no graph break (``torch.compile(...,
    fullgraph=True)``, strict export, ``torch._dynamo.error_on_graph_break(True)``); read from
    its InstructionTranslator. False outside a trace and where torch's internals differ."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        translator = InstructionTranslator.current_tx()
        return bool(translator.one_graph or getattr(translator, "error_on_graph_break", False))
    except (ImportError, AttributeError, TypeError):
        return False


def run_eagerly_under_compile(function: _F, reason: str) -> _F:
    """``function`` (a function or a class), run eagerly where torch.compile traces a call of it
    (one graph break), as ``torch.compiler.disable(function, reason=reason)`` does: ``reason``,
    why it cannot be traced, is in Dynamo's graph-break log and its errors. That wrapper is made
    at the first traced call, since making it imports Dynamo (seconds, and numpy, which the base
    install lacks). It is made while Dynamo traces, not traced: a traced look at whether it
    exists would be a guard that the first call fails, and the caller would compile again at its
    second call."""
    made: list[Callable[..., Any]] = []

    @run_while_tracing
    def make_while_tracing() -> bool:
        if not made:
            made.append(torch.compiler.disable(function, reason=reason))
        return True

    @functools.wraps(function, updated=())  # a class's __dict__ is not the wrapper's
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return function(*args, **kwargs)
        make_while_tracing()
        return made[0](*args, **kwargs)

    return call  # type: ignore[return-value]


def disable_current_dispatch_modes() -> Any:
    """torch.utils._python_dispatch._disable_current_modes: the checkpoint's recompute runs
    with the caller's dispatch modes popped, as torch.utils.checkpoint's does, and the CPU
    kernel's load measures torch on real tensors. Required."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def strided_shard_type() -> type:
    """torch.distributed.tensor.placement_types._StridedShard, FSDP2 + TP's placement.

    Required by the DTensor path (torch >= 2.5); loaded on call so the core never imports
    DTensor.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def correct_fan(tensor: torch.Tensor, mode: str) -> int:
    """torch.nn.init._calculate_correct_fan: the fan ``kaiming_*`` scales by, with torch's
    own checks, so an invariant init's bound is torch's to the bit. Required."""
    return torch.nn.init._calculate_correct_fan(tensor, mode)  # type: ignore[arg-type]


# torch.nn.init.trunc_normal_ hands its work to this module function, looked up at call time; a
# keyed invariant_random() block swaps it for one draw per element, which reaches callers that
# bound trunc_normal_ before the block (torchtitan's partial(nn.init.trunc_normal_, ...)). Where
# a torch lays trunc_normal_ out otherwise, the swap is skipped and keyed mode takes torch's
# resampling loop through its uniform_/normal_ routes (the same values on every layout, slower).
_TRUNC_NORMAL_IMPL = "_no_grad_trunc_normal_"


def trunc_normal_impl() -> Any | None:
    """torch's function behind ``nn.init.trunc_normal_``, or None where it has no such part."""
    init = torch.nn.init
    if _TRUNC_NORMAL_IMPL not in init.trunc_normal_.__code__.co_names:
        return None
    return getattr(init, _TRUNC_NORMAL_IMPL, None)


def set_trunc_normal_impl(function: Any) -> None:
    """Make ``nn.init.trunc_normal_`` call ``function`` (see :func:`trunc_normal_impl`)."""
    setattr(torch.nn.init, _TRUNC_NORMAL_IMPL, function)
