"""``invariant_random()`` (rng_tracker.parallel.invariant): torch's own dropout and init calls,
routed, draw the same values on one device and on any mesh.

Claims: every routed function still reaches the mode; enable/disable keep torch's mode stack,
per thread; under the mode every routed dropout and init op on a plain tensor gives bitwise the
full tensor the same op gives on a DTensor of any placements (1-D and 2-D meshes, FSDP-style
strided shards), from the same generator state, and leaves the generator in the same state - in
the default init mode (keyed: O(local shard), nothing drawn) and in the opt-in full-tensor mode
(torch's values); a ``parallelize_module`` block inits and drops as the unsharded one; keyed
``trunc_normal_`` is one keyed draw per element, so a rank initialises its shard alone; init
arguments torch refuses are refused (typed) in both init modes, and a refused keyed call takes no
name from later draws; ops without an invariant route are a typed error on a DTensor; the 0.1 names in
``rng_tracker.parallel.dtensor`` still resolve, warning.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rng_tracker import batch_position, checkpoint
from rng_tracker._torch_private import trunc_normal_impl
from rng_tracker.errors import (
    BatchPositionError,
    BatchPositionTypeError,
    InvariantRandomConfigError,
    InvariantRandomUnsupportedError,
    KernelInPlaceError,
    KernelInputError,
    KernelInputTypeError,
    MissingBatchPositionError,
    RNGTrackerError,
)
from rng_tracker.kernels import dropout as kernel_dropout
from rng_tracker.kernels._keyed_fill import keyed_trunc_normal_
from rng_tracker.parallel.invariant import (
    disable_invariant_random,
    enable_invariant_random,
    invariant_random,
)

_P = 0.3


# --- the mode itself -------------------------------------------------------------------


def test_mode_sees_every_routed_function() -> None:
    """Guard against torch changes: each routed function still reaches a torch function mode.
    On plain tensors the init routes (init="full") run torch's own op (same values, same
    generator state); the dropout routes run the layout-invariant kernel
    (test_one_device_equals_any_mesh checks their values)."""
    import torch.nn.functional as F

    from rng_tracker.parallel.invariant import _ROUTES, _InvariantRandomMode

    seen = []

    class Recording(_InvariantRandomMode):
        def __init__(self) -> None:
            super().__init__(init="full")  # the opt-in mode whose init is torch's own

        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    def inits() -> list[torch.Tensor]:
        return [
            torch.nn.init.uniform_(torch.empty(64), -1.0, 1.0),
            torch.nn.init.normal_(torch.empty(64), 0.0, 2.0),
            torch.nn.init.kaiming_uniform_(torch.empty(8, 8), a=0.5),
            torch.empty(64).uniform_(-1.0, 1.0),
            torch.empty(64).normal_(0.0, 2.0),
        ]

    def drops() -> None:
        x = torch.ones(4, 8, 6)
        F.dropout(x, 0.5)
        torch.nn.Dropout(0.5)(x)
        torch.dropout(x, 0.5, True)
        F.dropout1d(x, 0.5)
        F.dropout2d(x.unsqueeze(-1), 0.5)
        F.dropout3d(x.unsqueeze(-1).unsqueeze(-1), 0.5)
        F.alpha_dropout(x, 0.5, training=True)
        F.feature_alpha_dropout(x, 0.5, training=True)
        for name in ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
            getattr(torch, name)(x, 0.5, True)
            getattr(torch, name + "_")(x.clone(), 0.5, True)
        torch.empty(8).bernoulli_(0.5)

    torch.manual_seed(3)
    expected = inits()
    state = torch.get_rng_state()
    torch.manual_seed(3)
    with Recording():
        got = inits()
        assert torch.equal(torch.get_rng_state(), state)
        drops()
    assert set(_ROUTES) <= set(seen), set(_ROUTES) - set(seen)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_enable_disable_pair_keeps_the_mode_stack() -> None:
    """enable/disable push and pop exactly one mode, idempotently, and refuse to pop another mode."""
    from torch.overrides import TorchFunctionMode, _len_torch_function_stack

    from rng_tracker.errors import InvariantRandomModeError

    base = _len_torch_function_stack()
    enable_invariant_random()
    enable_invariant_random()
    assert _len_torch_function_stack() == base + 1
    with TorchFunctionMode(), pytest.raises(InvariantRandomModeError, match="exit it first"):
        disable_invariant_random()
    disable_invariant_random()
    disable_invariant_random()
    assert _len_torch_function_stack() == base
    with pytest.raises(ZeroDivisionError), invariant_random():
        assert _len_torch_function_stack() == base + 1
        _ = 1 / 0
    assert _len_torch_function_stack() == base


def test_enable_is_per_thread() -> None:
    """enable_invariant_random() turns the mode on in the calling thread only (torch's
    function-mode stack is per thread): another thread enables and disables its own, and the
    first thread's mode stays on until that thread disables it."""
    from torch.overrides import _len_torch_function_stack

    x = torch.ones(64, 32)
    base = _len_torch_function_stack()
    seen: dict[str, object] = {}

    def other_thread() -> None:
        seen["stack before"] = _len_torch_function_stack()  # the mode is not on here
        enable_invariant_random()
        torch.manual_seed(5)
        seen["routed"] = F.dropout(x, 0.3)
        disable_invariant_random()
        seen["stack after"] = _len_torch_function_stack()

    enable_invariant_random()
    try:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert _len_torch_function_stack() == base + 1  # still on in this thread
    finally:
        disable_invariant_random()
    assert _len_torch_function_stack() == base
    assert seen["stack before"] == seen["stack after"] == 0
    torch.manual_seed(5)
    assert torch.equal(seen["routed"], kernel_dropout(x, 0.3))  # the thread's call was routed


# --- plain tensors: one device draws what any mesh draws --------------------------


def _ops() -> dict[str, object]:
    """name -> op(x) for each routed random op; x is (4, 6, 8), float32."""
    return {
        "F.dropout": lambda x: F.dropout(x, 0.3),
        "nn.Dropout": lambda x: torch.nn.Dropout(0.4)(x),
        "torch.dropout": lambda x: torch.dropout(x, 0.5, True),
        "dropout1d": lambda x: F.dropout1d(x, 0.5),
        "dropout2d": lambda x: F.dropout2d(x.unsqueeze(-1), 0.5).squeeze(-1),
        "dropout3d": lambda x: F.dropout3d(x.unsqueeze(-1).unsqueeze(-1), 0.5).flatten(2),
        "alpha_dropout": lambda x: F.alpha_dropout(x, 0.2, training=True),
        "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x, 0.2, training=True),
        "torch.dropout_": lambda x: torch.dropout_(x.clone(), 0.5, True),
        "torch.feature_dropout_": lambda x: torch.feature_dropout_(x.clone(), 0.5, True),
        "torch.alpha_dropout": lambda x: torch.alpha_dropout(x, 0.2, True),
        "torch.feature_alpha_dropout": lambda x: torch.feature_alpha_dropout(x, 0.2, True),
        "bernoulli_": lambda x: torch.empty_like(x).bernoulli_(0.7),
        "uniform_": lambda x: torch.nn.init.uniform_(torch.empty_like(x), -2.0, 3.0),
        "normal_": lambda x: torch.nn.init.normal_(torch.empty_like(x), 0.5, 2.0),
        "trunc_normal_": lambda x: torch.nn.init.trunc_normal_(torch.empty_like(x), std=0.02),
        # torch's rejection samplers: resample while mask.any() (made global on a DTensor)
        "trunc_normal_ resampled": lambda x: torch.nn.init.trunc_normal_(
            torch.empty_like(x), a=-1.0, b=1.0
        ),
        "trunc_normal_ narrow": lambda x: torch.nn.init.trunc_normal_(
            torch.empty_like(x), a=-0.2, b=0.2
        ),
        "kaiming_uniform_": lambda x: torch.nn.init.kaiming_uniform_(torch.empty_like(x), a=1.0),
        "kaiming_normal_": lambda x: torch.nn.init.kaiming_normal_(torch.empty_like(x)),
        "xavier_uniform_": lambda x: torch.nn.init.xavier_uniform_(torch.empty_like(x)),
        "xavier_normal_": lambda x: torch.nn.init.xavier_normal_(torch.empty_like(x)),
        "Tensor.uniform_": lambda x: torch.empty_like(x).uniform_(-1.0, 1.0),
        "Tensor.normal_": lambda x: torch.empty_like(x).normal_(1.0, 0.5),
    }


_INIT_OPS = frozenset(
    {
        "uniform_",
        "normal_",
        "trunc_normal_",
        "trunc_normal_ resampled",
        "trunc_normal_ narrow",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "Tensor.uniform_",
        "Tensor.normal_",
    }
)


def test_plain_dropout_is_the_invariant_kernel_and_init_full_is_torch() -> None:
    """On a plain tensor, F.dropout draws rng_tracker.kernels.dropout's mask (torch's own
    F.dropout draws another), and init="full" draws torch's own values."""
    x = torch.randn(64, 32)
    torch.manual_seed(5)
    want = kernel_dropout(x, 0.3)
    want_state = torch.get_rng_state()
    torch.manual_seed(5)
    with invariant_random(init="full"):
        got = F.dropout(x, 0.3)
        assert torch.equal(torch.get_rng_state(), want_state)
        init = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02)
    torch.manual_seed(5)
    assert not torch.equal(F.dropout(x, 0.3), got)  # torch's own mask is another one
    torch.manual_seed(5)
    kernel_dropout(x, 0.3)
    assert torch.equal(got, want)
    assert torch.equal(init, torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02))


def test_the_default_init_is_keyed_and_draws_nothing() -> None:
    """The default init mode is keyed: with no model= it keys each draw by its place among the
    block's init draws and the seed (torch.initial_seed() by default), computes in place, draws
    nothing from the generator, and is the same on every call order-alike block (not torch's
    values)."""
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with invariant_random():
        a = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03)
        b = torch.nn.init.normal_(torch.empty(16, 8))
        c = torch.nn.init.kaiming_uniform_(torch.empty(16, 8), a=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # keyed: nothing drawn
    with invariant_random(init="keyed", seed=5):
        again = [
            torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03),
            torch.nn.init.normal_(torch.empty(16, 8)),
            torch.nn.init.kaiming_uniform_(torch.empty(16, 8), a=1.0),
        ]
    for got, want in zip((a, b, c), again, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(a, b)  # distinct draws, distinct names
    assert a.abs().max() <= 0.03  # truncated to [a, b]
    torch.manual_seed(5)
    torch_values = torch.nn.init.trunc_normal_(torch.empty(16, 8), std=0.02, a=-0.03, b=0.03)
    assert not torch.equal(a, torch_values)


def test_config_and_unsupported_errors_are_typed() -> None:
    with pytest.raises(InvariantRandomConfigError, match="init must be"):
        enable_invariant_random(init="sharded")  # type: ignore[arg-type]
    with pytest.raises(InvariantRandomConfigError, match="model must be an nn") as info:
        enable_invariant_random(model="model")  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)  # a type mistake (it was a ValueError only)
    with pytest.raises(InvariantRandomConfigError, match="seed must be an int"):
        enable_invariant_random(torch.nn.Linear(2, 2), init="keyed", seed=-1)
    with pytest.raises(InvariantRandomConfigError, match="seed must be an int"):
        enable_invariant_random(seed=-1)
    with pytest.raises(InvariantRandomConfigError, match="seed= keys init='keyed' only"):
        enable_invariant_random(init="full", seed=3)
    disable_invariant_random()  # none of them was turned on: a no-op
    assert issubclass(InvariantRandomConfigError, RNGTrackerError)
    assert issubclass(InvariantRandomConfigError, ValueError)
    state = torch.get_rng_state()
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="float p"):
        torch.empty(4).bernoulli_(torch.full((4,), 0.5))
    assert torch.equal(torch.get_rng_state(), state)
    assert issubclass(InvariantRandomUnsupportedError, TypeError)


_REFUSED_INITS = [
    (lambda: torch.nn.init.uniform_(torch.empty(4, dtype=torch.int32)), KernelInputTypeError,
     TypeError, "floating tensors, got torch.int32"),
    (lambda: torch.nn.init.uniform_(torch.empty(4), 1.0, 0.0), KernelInputError, ValueError,
     "a <= b .*as torch requires"),
    (lambda: torch.nn.init.uniform_(torch.empty(4), float("nan")), KernelInputError, ValueError,
     "finite bounds"),
    (lambda: torch.nn.init.normal_(torch.empty(4), 0.0, -1.0), KernelInputError, ValueError,
     "std >= 0, as torch requires"),
    (lambda: torch.nn.init.uniform_(torch.empty(4), "x"), KernelInputTypeError, TypeError,
     "a must be a real number, got str"),
    (lambda: torch.nn.init.normal_(torch.empty(4), std=None), KernelInputTypeError, TypeError,
     "std must be a real number, got NoneType"),
    (lambda: torch.nn.init.trunc_normal_(torch.empty(4, dtype=torch.int32)),
     KernelInputTypeError, TypeError, "floating tensors"),
    (lambda: torch.nn.init.trunc_normal_(torch.empty(4), "x"), KernelInputTypeError, TypeError,
     "mean must be a real number"),
]  # fmt: skip


def _later_draws() -> list[torch.Tensor]:
    return [
        torch.nn.init.uniform_(torch.empty(4)),
        torch.nn.init.normal_(torch.empty(4)),
        torch.nn.init.trunc_normal_(torch.empty(4), std=0.02),
    ]


@pytest.mark.parametrize(
    "call, error, builtin, words",
    _REFUSED_INITS,
    ids=["uniform-int32", "uniform-a>b", "uniform-nan", "normal-std<0", "uniform-str",
         "normal-std-None", "trunc_normal-int32", "trunc_normal-str"],
)  # fmt: skip
def test_a_refused_keyed_init_takes_no_name(
    call: object, error: type, builtin: type, words: str
) -> None:
    """With no model= a draw is named by its place among the block's draws: a refused call
    (checked before it is named) leaves later draws' values as they were, and draws nothing."""
    with invariant_random(seed=5):
        want = _later_draws()
    state = torch.get_rng_state()
    with invariant_random(seed=5):
        with pytest.raises(error, match=words) as info:
            call()  # type: ignore[operator]
        got = _later_draws()
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["uniform_", "normal_"])
def test_keyed_tensor_draws_keep_autograd_in_place_rules(method: str) -> None:
    """Tensor.uniform_/normal_ (not nn.init's, which run under no_grad) outside no_grad: the keyed
    route wrote into a leaf that requires grad, and into its views, where torch raises; on a
    non-leaf it kept the old graph, so backward gave the input the gradient of the overwritten
    values. Now torch's error (before a name is taken) and a zero gradient, as torch's own draw."""
    with invariant_random(seed=5):
        want = _later_draws()
    for take in (lambda w: w, lambda w: w[0]):
        leaf = torch.ones(3, 4, requires_grad=True)
        with invariant_random(seed=5):
            with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
                getattr(take(leaf), method)()
            got = _later_draws()
        assert torch.equal(leaf.detach(), torch.ones(3, 4))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    leaf = torch.ones(3, 4, requires_grad=True)
    doubled = leaf * 2
    with invariant_random(seed=5):
        getattr(doubled, method)()
    with invariant_random(seed=5):
        assert torch.equal(doubled.detach(), getattr(torch.empty(3, 4), method)())
    doubled.sum().backward()
    assert torch.equal(leaf.grad, torch.zeros(3, 4))
    with invariant_random(seed=5):  # nn.init's own no_grad: a leaf that requires grad is filled
        torch.nn.init.uniform_(leaf)
    with invariant_random(seed=5):
        assert torch.equal(leaf.detach(), torch.nn.init.uniform_(torch.empty(3, 4)))


def _in_place_draws_on_tensors_that_require_grad() -> dict[str, tuple[object, object]]:
    """(gradient reaching x through y = x * 2 drawn over in place, error on a leaf) per draw."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Shard

    from rng_tracker.parallel import dtensor as dt

    mesh = init_device_mesh("cpu", (2,))
    draws = {
        f"{name} {init}": (lambda t, n=name, i=init: _draw_in_block(t, n, i))
        for name in ("uniform_", "normal_", "bernoulli_")
        for init in ("keyed", "full")
    }
    draws["dtensor.uniform_"], draws["dtensor.normal_"] = dt.uniform_, dt.normal_
    outcome = {}
    for name, draw in draws.items():
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).requires_grad_()
        y = x * 2
        draw(y)
        (y * 3).sum().backward()
        leaf = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).requires_grad_()
        try:
            draw(leaf)
            error = None
        except RuntimeError as failure:
            error = str(failure).split(".")[0]
        outcome[name] = (x.grad.full_tensor().unique().tolist(), error)
    return outcome


def _draw_in_block(t: torch.Tensor, method: str, init: str) -> None:
    with invariant_random(init=init):
        getattr(t, method)(0.5) if method == "bernoulli_" else getattr(t, method)()


def test_in_place_draws_on_dtensors_keep_autograds_rules_in_both_modes() -> None:
    """Tensor.uniform_/normal_ (init="full") and bernoulli_ (both modes) under invariant_random,
    and dtensor.uniform_/normal_, wrote under no_grad: a leaf DTensor that requires grad was
    overwritten where torch raises, and y = x * 2 drawn over passed x the gradient 2 * 3. Now as
    torch's own draw on a DTensor: its error, and no gradient through the overwritten values."""
    from rng_tracker.parallel.testing import run_distributed

    for outcome in run_distributed(_in_place_draws_on_tensors_that_require_grad, world_size=2):
        for name, (gradient, error) in outcome.items():
            assert gradient == [0.0], name
            assert (
                error == "a leaf Variable that requires grad is being used in an in-place operation"
            ), name


def _feature_dims(y: torch.Tensor) -> int:
    """How many leading dims a feature dropout's mask varies over: the fewest k for which the
    output is all kept or all dropped within each index of the first k dims."""
    for k in range(y.dim() + 1):
        rows = (y != 0).reshape(math.prod(y.shape[:k]), -1)
        if bool((rows.all(1) | ~rows.any(1)).all()):
            return k
    raise AssertionError("unreachable: k = y.dim() leaves one element per row")


def _feature_dropout_outcome(func: object, dims: int) -> tuple[object, ...]:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            y = func(torch.ones((4,) * dims), 0.5, True)  # type: ignore[operator]
            outcome: object = _feature_dims(y)
        except RuntimeError as failure:
            outcome = str(failure)
    return outcome, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "func",
    [F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout, torch.feature_dropout],
    ids=["dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "torch.feature_dropout"],
)
def test_feature_dropouts_read_an_input_of_any_rank_as_torch_does(func: object) -> None:
    """The routes took a 2-D input to dropout2d for one sample (torch: (N, C), one value each),
    drew for inputs torch refuses (a 1-D one to dropout1d/2d, feature_alpha_dropout) and warned
    nothing where torch warns. Per rank 0-6: torch's error, warnings and mask dims, drawn by ours."""
    for dims in range(7):
        want = _feature_dropout_outcome(func, dims)
        with invariant_random():
            got = _feature_dropout_outcome(func, dims)
        assert got == want, dims


@pytest.mark.distributed(world_size=1, timeout=120)
def test_random_ops_with_no_invariant_draw_are_refused_on_dtensors_when_they_draw(rank):
    """Tensor.multinomial, torch.native_dropout, F.gumbel_softmax, attention dropout (SDPA, MHA)
    and fractional max pooling drew on each shard from one generator state, unrefused (every
    shard the same values). They are refused where they draw, and run where they draw nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Shard

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.rand(2, 4, 4, 4), mesh, [Shard(0)])
    samples = distribute_tensor(torch.rand(2, 4, 2), mesh, [Shard(0)])
    # attention on 3-d inputs: torch propagates a 4-d one's sharding through its CPU
    # decomposition once per candidate strategy (35-50 s here), a 3-d one's in milliseconds
    q = distribute_tensor(torch.rand(2, 4, 4), mesh, [Shard(0)])
    drawing = {
        "Tensor.multinomial": lambda: x[0, 0].multinomial(2),
        "torch.native_dropout": lambda: torch.native_dropout(x, 0.5, True),
        "F.gumbel_softmax": lambda: F.gumbel_softmax(x),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
            q, q, q, dropout_p=0.5
        ),
        "F.fractional_max_pool2d": lambda: F.fractional_max_pool2d(x, 2, output_size=2),
    }
    quiet = {
        "torch.native_dropout": lambda: torch.native_dropout(x, 0.5, False),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, q, q),
        "F.fractional_max_pool2d": lambda: F.fractional_max_pool2d(
            x, 2, output_size=2, _random_samples=samples
        ),
    }
    with invariant_random():
        for name, call in drawing.items():
            state = torch.get_rng_state()
            with pytest.raises(InvariantRandomUnsupportedError, match=name):
                call()
            assert torch.equal(torch.get_rng_state(), state)
        for name, call in quiet.items():
            call()
            assert torch.equal(torch.get_rng_state(), state), name  # it drew nothing


def test_init_bounds_torch_refuses_are_refused_in_both_modes() -> None:
    """nn.init.uniform_(t, 1, 0) and normal_(t, 0, -1) raise in plain torch; under
    invariant_random they raise too (KernelInputError, a ValueError), in keyed and full mode,
    before anything is written or drawn; valid bounds at the edge (a == b, std == 0) pass."""
    calls = [
        (lambda t: torch.nn.init.uniform_(t, 1.0, 0.0), "a <= b"),
        (lambda t: torch.nn.init.normal_(t, 0.0, -1.0), "std >= 0"),
        (lambda t: t.uniform_(0.0, float("inf")), "finite bounds"),
        (lambda t: torch.nn.init.uniform_(t, 0.0, 1e5), r"\+-65504"),
    ]
    for call, words in calls:
        with pytest.raises(RuntimeError):
            call(torch.empty(4, dtype=torch.float16))  # plain torch refuses it
        for options in ({"seed": 1}, {"init": "full"}):
            t = torch.full((4,), 7.0, dtype=torch.float16)
            state = torch.get_rng_state()
            with invariant_random(**options), pytest.raises(KernelInputError, match=words):
                call(t)
            assert torch.equal(t, torch.full((4,), 7.0, dtype=torch.float16)), (words, options)
            assert torch.equal(torch.get_rng_state(), state)
    for options in ({"seed": 1}, {"init": "full"}):
        with invariant_random(**options):
            assert torch.equal(torch.nn.init.uniform_(torch.empty(3), 2, 2), torch.full((3,), 2.0))
            assert torch.equal(torch.nn.init.normal_(torch.empty(3), 1, 0), torch.ones(3))


_DROPOUT_OPS = sorted(set(_ops()) - _INIT_OPS)


def _whole_and_halves(
    op: Callable[[torch.Tensor], torch.Tensor],
    base: torch.Tensor,
    as_input: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    gathered: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``op`` under the mode on the whole batch (4 samples), and on each half of it in its batch
    position, from the same seed (what two data-parallel ranks or microbatches run), joined."""
    torch.manual_seed(11)
    with invariant_random():
        want = op(base.clone())
    parts = []
    for offset in (0, 2):
        x = as_input(base[offset : offset + 2].clone())
        torch.manual_seed(11)  # every data-parallel rank's generator
        with invariant_random(), batch_position(offset, 4):
            parts.append(gathered(op(x)))
    return want, torch.cat(parts)


def test_data_parallel_ranks_draw_their_samples_of_the_whole_batchs_masks() -> None:
    """Each data-parallel rank (or microbatch) holds some samples of the global batch; inside
    batch_position every routed dropout draws those samples' part of the mask the whole batch
    draws on one device (same seed on every rank, as DP ranks have). torch's own dropout draws
    the same mask on every rank instead: the ranks' noise is the same for other samples."""
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) / 7.0 + 0.5
    for name in _DROPOUT_OPS:
        want, halves = _whole_and_halves(_ops()[name], base)
        assert torch.equal(halves, want), name
    torch.manual_seed(11)
    first = F.dropout(base[:2], 0.3)
    torch.manual_seed(11)
    second = F.dropout(base[2:], 0.3)
    assert torch.equal(first != 0, second != 0)  # torch: one mask for both ranks' samples


def test_microbatches_of_one_rank_each_start_from_the_steps_generator_state() -> None:
    """The mode draws from the default generator, and each draw moves it past the whole global
    batch: a second microbatch on the same rank would draw its rows of another global mask. Run
    every microbatch but the last in torch.random.fork_rng (each then starts from the step's
    state, as every data-parallel rank does): the microbatches draw the single-device masks and
    leave the generator where the single-device forward leaves it."""
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) / 7.0 + 0.5
    torch.manual_seed(11)
    with invariant_random():
        want = F.dropout(base, 0.3)
    want_state = torch.get_rng_state()
    for rewind in (False, True):
        torch.manual_seed(11)
        parts = []
        for offset in (0, 2):
            last = offset == 2
            fork = torch.random.fork_rng(devices=[]) if rewind and not last else nullcontext()
            with fork, invariant_random(), batch_position(offset, 4):
                parts.append(F.dropout(base[offset : offset + 2], 0.3))
        assert torch.equal(torch.cat(parts), want) == rewind
    assert torch.equal(torch.get_rng_state(), want_state)


def test_batch_dim_names_the_sample_dim_and_a_recompute_keeps_its_position() -> None:
    """invariant_random(batch_dim=1) places (seq, batch, hidden) activations by their dim 1; a
    block checkpointed by rng_tracker.checkpoint recomputes at its forward's position, though
    its backward runs after the next microbatch entered another: gradients equal the eager
    run's, bitwise."""
    base = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    with invariant_random(batch_dim=1):
        want = F.dropout(base, 0.5)
    parts = []
    for offset in (0, 2):
        torch.manual_seed(5)
        with invariant_random(batch_dim=1), batch_position(offset, 4):
            parts.append(F.dropout(base[:, offset : offset + 2], 0.5))
    assert torch.equal(torch.cat(parts, dim=1), want)

    def grads(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(5)
        x = base[:, 2:].clone().requires_grad_()
        w = torch.linspace(0.5, 1.5, 5).requires_grad_()
        block = lambda t: F.dropout(t * w, 0.5)  # noqa: E731
        with invariant_random(batch_dim=1):
            with batch_position(2, 4):
                y = checkpoint(block, x) if checkpointed else block(x)
            with batch_position(0, 4):  # the next microbatch's forward, before this backward
                (y * torch.arange(30.0).view(3, 2, 5)).sum().backward()
        return x.grad, w.grad

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True), strict=True))


def test_bad_batch_placements_are_typed_errors_that_draw_nothing() -> None:
    """A batch_dim that is no int is refused when the mode is made; a sample dim the tensor
    lacks, or samples that do not fit the global batch, are refused before anything is drawn."""
    with pytest.raises(BatchPositionTypeError, match="batch_dim"):
        invariant_random(batch_dim="0").__enter__()
    t = torch.full((3,), 7.0)
    with invariant_random(), batch_position(2, 4), pytest.raises(BatchPositionError):
        t.bernoulli_(0.5)  # 3 samples at offset 2 do not fit: t is left as it was
    assert torch.equal(t, torch.full((3,), 7.0)) and t._version == 0
    state = torch.get_rng_state()
    for call, error, words in (
        (lambda: F.dropout(torch.ones(3), 0.5), BatchPositionError, "has no sample dim"),
        (lambda: F.dropout(torch.ones(3, 3), 0.5), BatchPositionError, "does not fit"),
        (lambda: F.dropout2d(torch.ones(3, 4, 2), 0.5), BatchPositionError, "does not fit"),
    ):
        with invariant_random(batch_dim=1), batch_position(2, 4), pytest.raises(error, match=words):
            call()
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_dtensor_microbatches_and_a_data_parallel_layout(rank: int) -> None:
    """A TP-sharded DTensor activation that holds a microbatch draws its part of the global
    batch's mask (gathered: the single-device mask); with rng_tracker's parallel state at two
    data-parallel ranks, a dropout outside batch_position is refused, drawing nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Shard

    from rng_tracker.parallel import destroy_model_parallel, init_model_parallel

    mesh = init_device_mesh("cpu", (2,))
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) / 7.0 + 0.5
    for name in ("F.dropout", "dropout2d", "alpha_dropout", "bernoulli_"):
        want, halves = _whole_and_halves(
            _ops()[name],
            base,
            as_input=lambda t: distribute_tensor(t, mesh, [Shard(2)]),
            gathered=lambda t: t.full_tensor(),
        )
        assert torch.equal(halves, want), name

    init_model_parallel(tensor=1)  # two data-parallel ranks
    try:
        state = torch.get_rng_state()
        with invariant_random(), pytest.raises(MissingBatchPositionError, match="batch_position"):
            F.dropout(base[2 * rank : 2 * rank + 2], 0.3)
        assert torch.equal(torch.get_rng_state(), state)
        with invariant_random(), batch_position(2 * rank, 4):
            F.dropout(base[2 * rank : 2 * rank + 2], 0.3)
        # a DTensor whose mesh shards the batch holds its place: no position needed
        torch.manual_seed(11)
        with invariant_random(), batch_position(0, 4):  # the whole batch, as one device runs it
            want = F.dropout(base, 0.3)
        torch.manual_seed(11)
        with invariant_random():
            got = F.dropout(distribute_tensor(base, mesh, [Shard(0)]), 0.3).full_tensor()
        assert torch.equal(got, want)
    finally:
        destroy_model_parallel()


@pytest.mark.distributed(world_size=4, timeout=300)
def test_one_device_equals_any_mesh(rank: int) -> None:
    """Every routed op on a plain tensor == the same op on DTensors over (4,) and (2, 2) meshes
    (Shard, Replicate, FSDP-style _StridedShard + Shard): gathered bitwise, and the same
    generator state after; init="keyed" too; unrouted random ops on a DTensor are refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    meshes = {s: init_device_mesh("cpu", s) for s in [(4,), (2, 2)]}
    layouts = [
        ((4,), [Shard(0)]),
        ((4,), [Shard(2)]),
        ((4,), [Replicate()]),
        ((2, 2), [Shard(1), Shard(2)]),
        ((2, 2), [_StridedShard(2, split_factor=2), Shard(2)]),
    ]
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) / 7.0 + 0.5
    for name, op in _ops().items():
        # the init ops in both init modes: keyed (the default) and full; dropout has one
        for init in ("keyed", "full") if name in _INIT_OPS else ("keyed",):
            torch.manual_seed(11)
            with invariant_random(init=init):
                want = op(base.clone())
            want_state = torch.get_rng_state()
            # full: the 2-D mesh layouts only (it has its own DTensor-op tests, tests/test_dtensor.py)
            for mesh_shape, placements in layouts if init == "keyed" else layouts[3:]:
                x = distribute_tensor(base.clone(), meshes[mesh_shape], placements)
                torch.manual_seed(11)
                with invariant_random(init=init):
                    got = op(x)
                assert torch.equal(got.full_tensor(), want), (name, init, mesh_shape, placements)
                assert torch.equal(torch.get_rng_state(), want_state), (name, init, placements)

    # keyed init: the plain module and its DTensor-sharded twin hold the same values
    model = torch.nn.Linear(8, 12)
    with invariant_random(model, init="keyed", seed=7):
        model.reset_parameters()
    weight_layouts = [
        ((4,), [Shard(1)]),
        ((2, 2), [Shard(0), Shard(1)]),
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ]
    for mesh_shape, placements in weight_layouts:
        sharded = torch.nn.Linear(8, 12)
        sharded.weight = torch.nn.Parameter(
            distribute_tensor(sharded.weight.detach(), meshes[mesh_shape], placements)
        )
        state = torch.get_rng_state()
        with invariant_random(sharded, init="keyed", seed=7):
            sharded.reset_parameters()
        assert torch.equal(torch.get_rng_state(), state)  # keyed: nothing drawn
        assert torch.equal(sharded.weight.full_tensor(), model.weight)
        assert torch.equal(sharded.bias, model.bias)

    x = distribute_tensor(base.clone(), meshes[(4,)], [Shard(0)])
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="exponential_"):
        x.exponential_()
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="rand_like"):
        torch.rand_like(x)


# --- a parallelize_module block -------------------------------------------------------


class _Block(torch.nn.Module):
    """A pre-norm MLP block with dropout on the normed input, the hidden and the output."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        self.drop_in = torch.nn.Dropout(_P)
        self.drop_mid = torch.nn.Dropout(_P)
        self.drop_out = torch.nn.Dropout(_P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, hidden)
        y = self.drop_in(self.norm(x))
        y = self.drop_mid(torch.nn.functional.gelu(self.up(y)))  # (batch, seq, 2 hidden)
        return x + self.drop_out(self.down(y))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.up.reset_parameters()  # nn.init.kaiming_uniform_ and nn.init.uniform_
        torch.nn.init.xavier_normal_(self.down.weight)  # Tensor.normal_ inside
        torch.nn.init.trunc_normal_(self.down.bias, std=0.5)  # Tensor.uniform_, then pointwise
        self.norm.weight.normal_(1.0, 0.1)  # Tensor.normal_ directly
        torch.nn.init.normal_(self.norm.bias, 0.0, 0.5)


@pytest.mark.distributed(world_size=2, timeout=300)
def test_a_compiled_parallelized_module_under_invariant_random_draws_eager_masks(rank: int):
    """torch.compile of a parallelize_module TP+SP block (DTensors) under invariant_random():
    each step's output equals the eager block's bitwise, and nothing compiles after the first
    step. The index map's overlap check sorted symbolic strides, a graph break on every site
    once the second step made the sizes symbolic (20 graphs, then 21; then 18 at every step;
    4 since a routed draw and its check are one untraced step, docs/compile.md)."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    model = _Block(8)
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    x_full = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(5))
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    graphs, outs = [], []
    for step in range(3):
        results = []
        for run in (model, compiled):
            torch.manual_seed(100 + step)
            with invariant_random():
                results.append(run(x).full_tensor())
        assert torch.equal(results[0], results[1]), step
        outs.append(results[1])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 2, graphs
    assert not any("sort" in reason for reason in counters["graph_break"])
    assert not torch.equal(outs[0], outs[1])


class _KernelDropout(torch.nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rng_tracker import kernels

        return kernels.dropout(x, self.p)


def _record_masks(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    masks = []

    def hook(module, inputs, output) -> None:
        full = output.full_tensor() if isinstance(output, DTensor) else output
        masks.append((full != 0).detach())

    for name, module in model.named_children():
        if name.startswith("drop"):
            module.register_forward_hook(hook)
    return masks


@pytest.mark.distributed(world_size=4, timeout=300)
def test_invariant_random_on_a_parallelized_module(rank: int) -> None:
    """Under invariant_random() a parallelize_module TP+SP block inits (in the default keyed
    mode and in the full mode, which is torch's own init) and drops exactly as the unsharded
    block with the fused kernel; outside it, torch's own DTensor randomness runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.overrides import _len_torch_function_stack

    mesh = init_device_mesh("cpu", (4,))
    hidden = 8
    model = _Block(hidden)
    reference = _Block(hidden)
    for name in ("drop_in", "drop_mid", "drop_out"):
        setattr(reference, name, _KernelDropout(_P))
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    # the default (keyed) init: the unsharded block under the same mode, nothing drawn
    torch.manual_seed(11)
    with invariant_random():
        model.init_weights()
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(11).get_state())
    with invariant_random():
        reference.init_weights()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.full_tensor(), theirs), name
    # init="full": torch's own init of the unsharded block, from the same generator state
    torch.manual_seed(11)
    with invariant_random(init="full"):
        model.init_weights()
    after_init = torch.get_rng_state()
    torch.manual_seed(11)
    reference.init_weights()
    assert torch.equal(torch.get_rng_state(), after_init)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.full_tensor(), theirs), name

    x_full = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(5))
    x = distribute_tensor(x_full, mesh, [Shard(1)])
    ours_masks, ref_masks = _record_masks(model), _record_masks(reference)
    torch.manual_seed(12)
    with invariant_random():
        out = model(x)
    after = torch.get_rng_state()
    torch.manual_seed(12)
    ref = reference(x_full)
    assert torch.equal(torch.get_rng_state(), after)
    assert len(ours_masks) == 3
    for site, (a, b) in enumerate(zip(ours_masks, ref_masks, strict=True)):
        assert torch.equal(a, b), site
    # the row-parallel matmul sums over shards: values agree up to summation order
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-5)

    # Outside the mode: torch's DTensor dropout, untouched. On a CPU mesh it runs the
    # local op on every shard from the same generator state (pytorch#138329).
    assert _len_torch_function_stack() == 0
    y = distribute_tensor(torch.ones(4, 8), mesh, [Shard(0)])
    torch.manual_seed(13)
    torch_out = torch.nn.functional.dropout(y, _P)
    torch.manual_seed(13)
    assert torch.equal(torch_out.to_local(), torch.nn.functional.dropout(torch.ones(1, 8), _P))
    torch.manual_seed(13)
    with invariant_random():
        ours_out = torch.nn.functional.dropout(y, _P)
    assert not torch.equal(ours_out.full_tensor(), torch_out.full_tensor())
    torch.manual_seed(13)
    z = y.clone()
    with invariant_random():
        same = torch.nn.functional.dropout(z, _P, inplace=True)
        state = torch.get_rng_state()
        assert torch.nn.Dropout(_P).eval()(y) is y  # eval draws nothing, returns x
        assert torch.equal(torch.get_rng_state(), state)
    assert same is z
    assert torch.equal(z.full_tensor(), ours_out.full_tensor())


# --- keyed trunc_normal_: one keyed draw per element ----------------------------------


def test_trunc_normal_of_a_parameter_is_the_keyed_kernel() -> None:
    """Inside ``invariant_random(model, init="keyed")``, ``nn.init.trunc_normal_`` on a parameter
    (also through a ``partial`` bound before the block, as torchtitan binds it) is bitwise the
    keyed kernel's values, and a shard is bitwise the slice of the full tensor."""
    model = torch.nn.Linear(300, 200)
    bound = partial(torch.nn.init.trunc_normal_, std=0.02, a=-0.06, b=0.06)  # as torchtitan
    state = torch.get_rng_state()
    with torch.no_grad(), invariant_random(model, init="keyed", seed=11):
        bound(model.weight)
        torch.nn.init.trunc_normal_(model.bias, mean=1.0, std=2.0, a=0.5, b=9.0)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from the generator
    weight = keyed_trunc_normal_(
        torch.empty(200, 300), 0.0, 0.02, -0.06, 0.06, seed=11, name="weight"
    )
    bias = keyed_trunc_normal_(torch.empty(200), 1.0, 2.0, 0.5, 9.0, seed=11, name="bias")
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)
    rows, cols = [0, 1, 2, 150, 199], [5, 6, 7, 299]
    part = keyed_trunc_normal_(
        torch.empty(5, 4), 0.0, 0.02, -0.06, 0.06, seed=11, name="weight", global_shape=(200, 300),
        indices=[rows, cols],
    )  # fmt: skip
    assert torch.equal(part, weight[rows][:, cols])


def test_everything_else_runs_torchs_trunc_normal() -> None:
    """Tensors of no model, ``generator=``, other threads and everything after the block (also
    one that raised) run torch's own ``trunc_normal_``."""
    original = trunc_normal_impl()
    model = torch.nn.Linear(8, 8)

    def torch_values(generator: torch.Generator | None = None) -> torch.Tensor:
        torch.manual_seed(5)
        return torch.nn.init.trunc_normal_(
            torch.empty(64, 64), std=0.5, a=-0.6, b=0.6, generator=generator
        )

    expected = torch_values()
    seen: dict[str, torch.Tensor] = {}
    with invariant_random(model, init="keyed", seed=1):
        assert trunc_normal_impl() is not original  # routed while the block is open
        other = threading.Thread(target=lambda: seen.update(thread=torch_values()))
        other.start()
        other.join()
        seen["generator"] = torch_values(torch.Generator().manual_seed(5))
    assert torch.equal(seen["thread"], expected)  # another thread: torch's own
    assert torch.equal(seen["generator"], torch_values(torch.Generator().manual_seed(5)))
    assert trunc_normal_impl() is original
    with pytest.raises(RuntimeError, match="inside"), invariant_random(model, init="keyed", seed=1):
        raise RuntimeError("inside")
    assert trunc_normal_impl() is original  # restored when the block raises too
    assert torch.equal(torch_values(), expected)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_rank_initialises_its_shard_without_the_others(rank: int) -> None:
    """Rank 0 initialises its shard of a Shard(0) parameter while rank 1 waits in a barrier:
    with torch's resampling loop the global any() would hang rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]))
    if rank == 0:
        with torch.no_grad(), invariant_random(model, init="keyed", seed=4):
            torch.nn.init.trunc_normal_(model.w, std=0.5, a=-0.6, b=0.6)
        full = keyed_trunc_normal_(torch.empty(10, 6), 0.0, 0.5, -0.6, 0.6, seed=4, name="w")
        assert torch.equal(model.w.to_local(), full[:5])
    dist.barrier()


@pytest.mark.distributed(world_size=3, timeout=120)
def test_torchs_trunc_normal_on_a_partial_dtensor_is_the_one_device_draw(rank: int) -> None:
    """init="full" (and a keyed block's generator= call) draw torch's trunc_normal_ on a
    Partial("sum") DTensor bitwise as on one device, in all three of torch's branches: run on the
    DTensor, its pointwise steps redistributed the partial tensor (values / 3 on three ranks,
    off by an ulp after the sum) or refused in place (the narrow branch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    def draw(tensor: torch.Tensor, options: dict, generator: int | None, **kw: float) -> object:
        torch.manual_seed(5)
        gen = None if generator is None else torch.Generator().manual_seed(generator)
        with invariant_random(**options):
            return torch.nn.init.trunc_normal_(tensor, generator=gen, **kw)

    mesh = init_device_mesh("cpu", (3,))
    bounds = {"wide": {"a": -2.0, "b": 2.0}, "resampled": {"a": -1.0, "b": 1.0}}
    bounds["narrow"] = {"a": -0.2, "b": 0.2}  # torch's uniform-proposal branch
    for name, kw in bounds.items():
        for options, generator in (({"init": "full"}, None), ({"seed": 3}, 7)):
            want = draw(torch.zeros(10, 7), options, generator, **kw)
            want_state = torch.get_rng_state()
            x = distribute_tensor(torch.zeros(10, 7), mesh, [Partial()])
            got = draw(x, options, generator, **kw)
            assert got is x
            assert torch.equal(x.full_tensor(), want), (name, options)
            assert torch.equal(torch.get_rng_state(), want_state), (name, options)


@pytest.mark.parametrize(
    "init",
    [
        lambda t, g: torch.nn.init.uniform_(t, -1.0, 1.0, g),
        lambda t, g: torch.nn.init.normal_(t, 0.0, 1.0, g),
        lambda t, g: torch.nn.init.kaiming_uniform_(t, 0.0, "fan_in", "leaky_relu", g),
    ],
    ids=["uniform_", "normal_", "kaiming_uniform_"],
)
def test_a_generator_passed_positionally_runs_torchs_draw_as_generator_keyword_does(init) -> None:
    """nn.init takes its generator positionally too: under keyed invariant init such a call
    draws torch's values from that generator, as ``generator=`` does, not keyed values."""
    with invariant_random(init="keyed", seed=1):
        routed = init(torch.empty(6, 5), torch.Generator().manual_seed(3))
    assert torch.equal(routed, init(torch.empty(6, 5), torch.Generator().manual_seed(3)))


def test_an_empty_tensor_is_not_taken_for_an_empty_parameter_in_keyed_init():
    """Every empty storage has data pointer 0, so a tensor that is none of the model's, with the
    shape of an empty parameter (an empty local shard on some rank), was named as that parameter:
    the anonymous draws after it shifted on that rank alone. The draw after it must not depend
    on whether that tensor is empty."""

    def u_after(other: torch.Tensor) -> torch.Tensor:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(0, 4))
        u = torch.zeros(3)
        with invariant_random(model, seed=7):
            torch.nn.init.normal_(model.w)
            torch.nn.init.normal_(other)  # anonymous: none of the model's
            torch.nn.init.normal_(u)
        return u

    assert torch.equal(u_after(torch.zeros(0, 4)), u_after(torch.zeros(1, 4)))


def test_an_init_full_block_inside_a_keyed_block_draws_torchs_values() -> None:
    """Calls a route makes inside its handler reach the next mode out: torch's own init in an
    inner init="full" block was drawn keyed by the enclosing block. Now it is torch's values and
    torch's generator state, also in torch's resampling loops (trunc_normal_)."""
    inits = {
        "uniform_": lambda t: torch.nn.init.uniform_(t),
        "Tensor.normal_": lambda t: t.normal_(),
        "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t),
        "xavier_normal_": lambda t: torch.nn.init.xavier_normal_(t),
        "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, a=-1.0, b=1.0),
        "trunc_normal_ narrow": lambda t: torch.nn.init.trunc_normal_(t, a=-0.2, b=0.2),
    }
    for name, init in inits.items():
        torch.manual_seed(3)
        want = init(torch.empty(16, 8))
        want_state = torch.get_rng_state()
        torch.manual_seed(3)
        with invariant_random(seed=99), invariant_random(init="full"):
            got = init(torch.empty(16, 8))
        assert torch.equal(got, want), name
        assert torch.equal(torch.get_rng_state(), want_state), name


def _in_place_routes_on_a_partial_sum_over_three_ranks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (3,))
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    routes = {
        "dropout": lambda t: F.dropout(t, 0.3, inplace=True),
        "alpha_dropout": lambda t: F.alpha_dropout(t, 0.3, True, inplace=True),
        "bernoulli_ int64": lambda t: t.bernoulli_(0.5),
    }
    differing = {}
    for name, route in routes.items():
        whole = full.long() if "int64" in name else full
        mine = whole if dist.get_rank() == 0 else torch.zeros_like(whole)  # Partial(sum) of it
        x = DTensor.from_local(mine.clone(), mesh, [Partial()], run_check=False)
        torch.manual_seed(1)
        with invariant_random():
            got = route(x).full_tensor()
        torch.manual_seed(1)
        with invariant_random():
            want = route(whole.clone())
        differing[name] = int((got != want).sum())
    return differing


def test_in_place_routes_on_a_partial_sum_dtensor_write_the_plain_tensors_values():
    """The in-place routes copied their Replicate result into the Partial("sum") input with
    DTensor's copy_, which divides by the axis size on every rank: on 3 ranks v/3 summed thrice
    is not v (3 of 24 dropout values 1 ulp off), and an int64 bernoulli_ truncated to all zeros.
    Mesh sizes 2 and 4 hid it. The values are now written where the Partial holds them."""
    from rng_tracker.parallel.testing import run_distributed

    for differing in run_distributed(
        _in_place_routes_on_a_partial_sum_over_three_ranks, world_size=3
    ):
        assert differing == {"dropout": 0, "alpha_dropout": 0, "bernoulli_ int64": 0}


_IN_PLACE_ROUTES = {
    "F.dropout": lambda x: F.dropout(x, 0.3, True, inplace=True),
    "torch.dropout_": lambda x: torch.dropout_(x, 0.3, True),
    "F.alpha_dropout": lambda x: F.alpha_dropout(x, 0.3, True, inplace=True),
    "F.dropout2d": lambda x: F.dropout2d(x, 0.3, True, inplace=True),
    "torch.feature_alpha_dropout_": lambda x: torch.feature_alpha_dropout_(x, 0.3, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(_IN_PLACE_ROUTES))
def test_in_place_routes_refuse_a_leaf_that_requires_grad_before_drawing(name, dtype):
    """torch draws the mask of an in-place dropout and then refuses to write a leaf that requires
    grad, its generator advanced (measured here, side by side); the routes drew and failed the
    same way. They now refuse first, with a RuntimeError that is an RNGTrackerError, and draw
    nothing."""
    route = _IN_PLACE_ROUTES[name]
    leaf = torch.ones(2, 3, 4, 4, dtype=dtype, requires_grad=True)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="leaf Variable"):
        route(leaf)
    assert not torch.equal(torch.get_rng_state(), before)  # torch alone: drawn, then refused
    before = torch.get_rng_state()
    with invariant_random(), pytest.raises(KernelInPlaceError, match="leaf tensor") as info:
        route(leaf)
    assert isinstance(info.value, RuntimeError)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(leaf, torch.ones_like(leaf))


def _inference_ones() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(4, 4)


@pytest.mark.parametrize("init", ["keyed", "full"])
@pytest.mark.parametrize(
    ("name", "fill"),
    [
        ("bernoulli_", lambda t: t.bernoulli_(0.5)),
        ("uniform_", lambda t: t.uniform_()),
        ("normal_", lambda t: t.normal_()),
    ],
)
@pytest.mark.parametrize(
    ("make", "torch_draws_first"),
    [(_inference_ones, True), (lambda: torch.ones(4, 1).expand(4, 4), False)],
    ids=["inference", "expanded"],
)
def test_fills_torch_cannot_write_raise_torchs_error_before_drawing(
    make, torch_draws_first, name, fill, init
):
    """An inference tensor outside inference mode: torch draws the values (uniform_ and normal_
    even write them), then raises (its generator moved, measured here side by side); the routed
    fills did the same. An expand: torch refuses first, but the routed bernoulli_ drew before it
    failed. Each now raises torch's own error with every generator and the tensor as they were."""
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError) as torchs:
        fill(make())
    assert (not torch.equal(torch.get_rng_state(), before)) is torch_draws_first
    t = make()
    before = torch.get_rng_state()
    with invariant_random(init=init), pytest.raises(RuntimeError) as ours:
        fill(t)
    assert str(ours.value) == str(torchs.value), name
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(t, torch.ones(4, 4))


# --- torch's answers where nothing is drawn, torch's errors where torch refuses ----------------

# each routed dropout as (name, call(x, p, training)); feature dropouts get 4-D inputs
_DROPOUT_CALLS = {
    "F.dropout": lambda x, p, t: F.dropout(x, p, t),
    "F.dropout_inplace": lambda x, p, t: F.dropout(x, p, t, inplace=True),
    "torch.dropout": torch.dropout,
    "torch.dropout_": torch.dropout_,
    "F.alpha_dropout": lambda x, p, t: F.alpha_dropout(x, p, t),
    "torch.alpha_dropout": torch.alpha_dropout,
    "F.dropout1d": lambda x, p, t: F.dropout1d(x[0], p, t),
    "F.dropout2d": lambda x, p, t: F.dropout2d(x, p, t),
    "F.dropout3d": lambda x, p, t: F.dropout3d(x[None], p, t),
    "F.feature_alpha_dropout": lambda x, p, t: F.feature_alpha_dropout(x, p, t),
    "torch.feature_dropout": torch.feature_dropout,
    "torch.feature_alpha_dropout_": torch.feature_alpha_dropout_,
}


def _outcome(call, x: torch.Tensor, p: float, training: bool) -> tuple:
    """What a call gives: its result (values with signs, dtype, whether it is x) or its error
    (type and message), the warnings it gave, and whether the CPU generator moved."""
    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call(x, p, training)
            result = (out.dtype, out.tolist(), out.signbit().tolist(), out is x)
        except Exception as exc:
            result = (type(exc), str(exc))
    moved = not torch.equal(before, torch.get_rng_state())
    return result, [str(w.message) for w in caught], moved


@pytest.mark.parametrize("name", sorted(_DROPOUT_CALLS))
@pytest.mark.parametrize(
    ("dtype", "p", "training"),
    [
        (torch.float64, 0.5, False),
        (torch.float64, 0.0, True),
        (torch.float64, 1.0, True),
        (torch.int64, 0.5, False),
        (torch.int64, 1.0, True),
        (torch.float32, 1.0, True),
        (torch.float32, 1.5, True),
        (torch.float32, -0.1, False),
        (torch.float32, float("nan"), True),
        (torch.int64, 0.5, True),
        (torch.complex64, 0.5, True),
    ],
    ids=str,
)
def test_dropout_routes_answer_as_torch_where_nothing_is_drawn_or_torch_refuses(
    name, dtype, p, training
) -> None:
    """Under the mode a dropout that draws nothing (training off, p == 0 or 1) gives torch's own
    result for any dtype (values and signs bitwise, x itself where torch returns x), and one
    torch refuses (p out of [0, 1] or NaN; an integer or complex tensor it would draw on) raises
    torch's own error with torch's warnings; the generator does not move."""
    call = _DROPOUT_CALLS[name]
    x = (torch.arange(-24, 24) % 7 - 3).reshape(2, 4, 3, 2).to(dtype)
    torch.manual_seed(5)
    want = _outcome(call, x.clone(), p, training)
    torch.manual_seed(5)
    with invariant_random():
        got = _outcome(call, x.clone(), p, training)
    assert got[:2] == want[:2]
    assert not got[2]  # torch's own moves it before some of its errors; ours never does


def test_float64_dropout_draws_the_kernels_mask_in_its_own_dtype() -> None:
    """F.dropout of a float64 tensor under the mode keeps the mask the kernel draws for the same
    call in float32 (same generator state, same advance) and scales as torch does in float64."""
    x = torch.randn(6, 10, dtype=torch.float64)
    torch.manual_seed(3)
    with invariant_random():
        out = F.dropout(x, _P)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    keep = kernel_dropout(torch.ones(6, 10), _P) != 0
    assert torch.equal(torch.get_rng_state(), after)
    assert out.dtype == torch.float64
    assert torch.equal(out, x * keep.to(torch.float64).div_(1 - _P))  # torch's fp64 arithmetic


@pytest.mark.parametrize("name", sorted(_DROPOUT_CALLS))
def test_routed_dropout_keeps_torchs_memory_format_and_the_contiguous_copys_values(name) -> None:
    """Under the mode a channels_last input gives an output with the strides torch's own call
    gives it (torch keeps the input's memory format), and the values of its contiguous copy."""
    call = _DROPOUT_CALLS[name]
    x = torch.randn(2, 4, 3, 5)
    strided = x.contiguous(memory_format=torch.channels_last)
    want_strides = call(strided.clone(), _P, True).stride()
    results = []
    for t in (x, strided):
        torch.manual_seed(11)
        with invariant_random():
            results.append(call(t.clone(), _P, True))
    assert torch.equal(results[0], results[1])
    assert results[1].stride() == want_strides


@pytest.mark.parametrize("name", ["F.alpha_dropout", "F.dropout2d", "F.feature_alpha_dropout"])
def test_mask_routes_ignore_a_float64_default_dtype(name) -> None:
    """The alpha and feature routes draw their masks in float32 whatever the default dtype:
    under torch.set_default_dtype(torch.float64) a float32 input gets the mask and result it
    gets under the float32 default."""
    call = _DROPOUT_CALLS[name]
    x = torch.randn(2, 4, 3, 2)
    results = []
    for default in (torch.float32, torch.float64):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            torch.manual_seed(9)
            with invariant_random():
                results.append(call(x, _P, True))
        finally:
            torch.set_default_dtype(previous)
    assert torch.equal(results[0], results[1])


def test_routed_dropout_carries_a_forward_mode_tangent_through_its_mask() -> None:
    """Forward-mode AD through a routed F.dropout: the tangent goes through the primal's mask."""
    import torch.autograd.forward_ad as fwAD

    x, tangent = torch.randn(5, 8), torch.randn(5, 8)
    torch.manual_seed(4)
    with invariant_random(), fwAD.dual_level():
        unpacked = fwAD.unpack_dual(F.dropout(fwAD.make_dual(x, tangent), _P))
    torch.manual_seed(4)
    with invariant_random():
        assert torch.equal(unpacked.primal, F.dropout(x, _P))
    torch.manual_seed(4)
    with invariant_random():
        assert torch.equal(unpacked.tangent, F.dropout(tangent, _P))


# --- recompute under the mode ------------------------------------------------------------------


def _dropout_block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(F.dropout(h @ w, 0.5))


def _without_output(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from rng_tracker import CheckpointWithoutOutput

    act = CheckpointWithoutOutput()
    h = act.checkpoint(_dropout_block, x, w)
    y = h * 2.0
    act.discard_output_and_register_recompute(y)
    return y


def _torchs_with_our_context(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from rng_tracker import rng_context_fn

    return torch_checkpoint(_dropout_block, x, w, use_reentrant=False, context_fn=rng_context_fn())


_RECOMPUTING = {
    "checkpoint": lambda x, w: __import__("rng_tracker").checkpoint(_dropout_block, x, w),
    "checkpoint reentrant": lambda x, w: __import__("rng_tracker").checkpoint(
        _dropout_block, x, w, use_reentrant=True
    ),
    "megatron checkpoint": lambda x, w: __import__(
        "rng_tracker.megatron", fromlist=["checkpoint"]
    ).checkpoint(_dropout_block, False, x, w),
    "CheckpointWithoutOutput": _without_output,
    "torch checkpoint with rng_context_fn": _torchs_with_our_context,
}


@pytest.mark.parametrize("opened", ["with", "enable"])
@pytest.mark.parametrize("name", sorted(_RECOMPUTING))
def test_a_recompute_draws_the_forwards_masks_under_the_mode(name, opened) -> None:
    """autograd's engine runs backward without the caller's function modes, so a recompute ran
    outside invariant_random and drew torch's own dropout masks: silently other gradients. Every
    rng_tracker checkpoint (and torch's with rng_context_fn) now enters the mode again around
    its recompute: outputs and gradients are bitwise those of the run without a checkpoint."""

    def step(run) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w = torch.randn(8, 8, requires_grad=True)
        x = torch.ones(4, 8, requires_grad=True)
        if opened == "with":
            with invariant_random():
                y = run(x, w)
                y.sum().backward()
        else:
            enable_invariant_random()
            try:
                y = run(x, w)
                y.sum().backward()
            finally:
                disable_invariant_random()
        return [y.detach(), x.grad, w.grad]

    plain = step(lambda x, w: _dropout_block(x, w) * (2.0 if "Without" in name else 1.0))
    recomputed = step(_RECOMPUTING[name])
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_mask_drawn_in_torchs_own_checkpoint_is_refused(reentrant) -> None:
    """torch's own checkpoint recomputes without the mode, so a mask drawn in its forward would
    be redrawn by torch's dropout: refused, typed, before anything is drawn. torch's
    checkpoint_wrapper with checkpoint_fn=rng_tracker.checkpoint (the way to keep a wrapper)
    gives the run without a checkpoint bitwise."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import rng_tracker

    x = torch.ones(4, 8, requires_grad=True)
    before = torch.get_rng_state()
    with invariant_random(), pytest.raises(InvariantRandomUnsupportedError, match="rng_context_fn"):
        torch_checkpoint(lambda t: F.dropout(t, 0.5), x, use_reentrant=reentrant)
    if not reentrant:  # nested in rng_tracker's: the inner torch one still recomputes without it
        inner = lambda t: torch_checkpoint(lambda u: F.dropout(u, 0.5), t, use_reentrant=False)  # noqa: E731
        with invariant_random(), pytest.raises(InvariantRandomUnsupportedError):
            rng_tracker.checkpoint(inner, x)
    assert torch.equal(torch.get_rng_state(), before)

    def run(wrapped: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        if wrapped:
            model = checkpoint_wrapper(model, checkpoint_fn=rng_tracker.checkpoint)
        x = torch.ones(4, 8, requires_grad=True)
        with invariant_random():
            y = model(x)
            y.sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in model.parameters())]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_compiled_checkpoint_recomputes_the_forwards_masks_under_the_mode(reentrant) -> None:
    """Under torch.compile (aot_eager) a traced reentrant checkpoint compiled its backward, the
    recompute, without the mode: torch's masks there, silently other gradients. Both checkpoint
    forms run eagerly under compile, so two compiled steps give the eager run without a
    checkpoint bitwise."""
    import rng_tracker

    def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.dropout(h @ w, 0.5))

    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        w = torch.randn(8, 8, requires_grad=True)
        if compiled:
            step = torch.compile(
                lambda x: rng_tracker.checkpoint(block, x, w, use_reentrant=reentrant),
                backend="aot_eager",
            )
        else:
            step = lambda x: block(x, w)  # noqa: E731
        results = []
        with invariant_random():
            for _ in range(2):
                x = torch.ones(4, 8, requires_grad=True)
                y = step(x)
                y.sum().backward()
                results += [y.detach(), x.grad]
        return [*results, w.grad]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_a_compiled_routed_dropout_is_one_graph_break_and_warns_nothing() -> None:
    """Under torch.compile each drawn dropout the mode routes is one untraced step (its check
    for torch's checkpoint and its draw together): eager's masks and gradients bitwise, a fresh
    mask each step, every graph break that one step. The check was a break of its own (with
    Dynamo's warning that it cannot trace ``_top_saved_tensors_default_hooks``), the draw
    another."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8), torch.nn.Dropout(0.25)
    )
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            results = []
            for run in (model, compiled):
                torch.manual_seed(10 + step)
                x = torch.ones(4, 8, requires_grad=True)
                with invariant_random():
                    y = run(x)
                y.sum().backward()
                results.append((y.detach(), x.grad))
            assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), step
            steps.append(results[1][0])
    assert not torch.equal(steps[0], steps[1])
    reasons = list(counters["graph_break"])
    assert reasons and all("_draw_untraced" in reason for reason in reasons), reasons
    assert not [w for w in caught if "saved_tensors" in str(w.message)]


def test_torchs_checkpoint_compiled_under_the_mode_warns_since_its_masks_are_torchs() -> None:
    """Dynamo traces torch.utils.checkpoint as one higher-order op, which reaches the mode as a
    single call: its body is traced with the mode popped, so its dropout is torch's own (not the
    layout-invariant mask) and eager's refusal does not happen. That is said once, at the trace,
    with ``UnroutedCheckpointWarning``, naming rng_tracker.checkpoint, or under fullgraph=True
    (where that checkpoint is refused) keyed sites; rng_tracker.checkpoint, compiled the same
    way, routes the body and warns nothing. A body whose traced graph calls nothing the mode
    routes or refuses (a torchtitan block without dropout) is unaffected and warns nothing; a
    dropout module in the body, or a dropout in a checkpoint nested in it, warns."""
    import torch.utils.checkpoint as torch_checkpoint

    import rng_tracker
    from rng_tracker.parallel.invariant import UnroutedCheckpointWarning

    def block(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h * 2, 0.5)

    def run(
        checkpoint_fn: Callable[..., torch.Tensor],
        mode: bool,
        body: Callable[[torch.Tensor], torch.Tensor] = block,
        fullgraph: bool = False,
    ) -> tuple[torch.Tensor, list]:
        torch._dynamo.reset()
        step = torch.compile(
            lambda x: checkpoint_fn(body, x, use_reentrant=False),
            backend="aot_eager",
            fullgraph=fullgraph,
        )
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with invariant_random() if mode else nullcontext():
                out = step(torch.ones(4, 8, requires_grad=True)).detach()
        return out, [w for w in caught if w.category is UnroutedCheckpointWarning]

    torch.manual_seed(0)
    with invariant_random():
        invariant = block(torch.ones(4, 8))
    torch.manual_seed(0)
    torchs = block(torch.ones(4, 8))
    out, warned = run(torch_checkpoint.checkpoint, mode=True)
    assert torch.equal(out, torchs) and not torch.equal(out, invariant)
    assert len(warned) == 1 and "rng_tracker.checkpoint" in str(warned[0].message)
    # under fullgraph (torchtitan's compile) rng_tracker.checkpoint is refused: keyed sites
    out, warned = run(torch_checkpoint.checkpoint, mode=True, fullgraph=True)
    assert torch.equal(out, torchs) and len(warned) == 1
    assert "keyed sites" in str(warned[0].message)
    assert "checkpoint_fn=rng_tracker.checkpoint" not in str(warned[0].message)
    out, warned = run(rng_tracker.checkpoint, mode=True)
    assert torch.equal(out, invariant) and not warned
    assert not run(torch_checkpoint.checkpoint, mode=False)[1]

    def draws_nothing(h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h * 2).sum(-1, keepdim=True) * h

    out, warned = run(torch_checkpoint.checkpoint, mode=True, body=draws_nothing)
    assert torch.equal(out, draws_nothing(torch.ones(4, 8))) and not warned
    dropout_module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    assert len(run(torch_checkpoint.checkpoint, mode=True, body=dropout_module)[1]) == 1

    def nested(h: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(block, h + 1, use_reentrant=False)

    assert run(torch_checkpoint.checkpoint, mode=True, body=nested)[1]
