"""Keyed init: values a pure function of (seed, parameter name, global element index).

Claims: the compiled kernel's uniform values are bitwise the plain-torch Philox reference; any
shard (index lists) is bitwise the slice of the full tensor, for uniform and normal; the
values do not depend on the generator, on meta-device materialisation, on module
construction order or on which other modules a (pipeline) stage holds; nothing is drawn
from the generator; keyed ``trunc_normal_`` values follow the truncated normal; bounds are refused
exactly where torch's ``uniform_``/``normal_`` refuse them, as typed errors. The multi-rank
TP, TP x FSDP and torchtitan cases are in tests/test_invariant.py and tests/test_torchtitan.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from rng_tracker.errors import (
    InvariantRandomConfigError,
    KernelInputError,
    KernelInputTypeError,
    KernelUnavailableError,
    RNGTrackerError,
)
from rng_tracker.kernels import _keyed_fill
from rng_tracker.kernels._keyed_fill import (
    init_key,
    keyed_normal_,
    keyed_trunc_normal_,
    keyed_uniform_,
    name_hash,
)
from rng_tracker.kernels.philox import philox4x32
from rng_tracker.parallel import keyed_init
from rng_tracker.parallel.invariant import invariant_random
from rng_tracker.parallel.keyed_init import KeyedInit, stable_name


def keyed_uniform_reference(
    global_shape: tuple[int, ...], a: float = 0.0, b: float = 1.0, *, seed: int, name: str
) -> torch.Tensor:
    """The full tensor ``keyed_uniform_`` defines, in plain torch from the Philox reference."""
    numel = math.prod(global_shape)
    key, hashed = init_key(seed), name_hash(name)
    blocks = torch.arange((numel + 3) // 4, dtype=torch.int64)
    counters = torch.stack(
        [
            blocks & 0xFFFFFFFF,
            blocks >> 32,
            torch.full_like(blocks, hashed & 0xFFFFFFFF),
            torch.full_like(blocks, hashed >> 32),
        ],
        dim=-1,
    )
    words = philox4x32((key & 0xFFFFFFFF, key >> 32), counters).reshape(-1)[:numel]
    u = (words >> 8).to(torch.float32) * 2.0**-24
    scale = torch.tensor(b - a, dtype=torch.float32)
    shift = torch.tensor(a, dtype=torch.float32)
    return (u * scale + shift).reshape(global_shape)


def test_kernel_is_the_reference_and_shards_are_slices() -> None:
    full = torch.empty(37, 29)
    keyed_uniform_(full, -0.5, 2.0, seed=9, name="w")
    assert torch.equal(full, keyed_uniform_reference((37, 29), -0.5, 2.0, seed=9, name="w"))
    rows, cols = [3, 4, 5, 20, 36], [0, 7, 8, 9, 28]
    for fill in (keyed_uniform_, keyed_normal_):
        whole = fill(torch.empty(37, 29), 0.25, 3.0, seed=9, name="w")
        part = fill(
            torch.empty(5, 5), 0.25, 3.0, seed=9, name="w", global_shape=(37, 29),
            indices=[rows, cols],
        )  # fmt: skip
        assert torch.equal(part, whole[rows][:, cols])
    other = keyed_uniform_(torch.empty(37, 29), -0.5, 2.0, seed=9, name="v")
    assert not torch.equal(other, full)
    assert not torch.equal(keyed_uniform_(torch.empty(37, 29), -0.5, 2.0, seed=8, name="w"), full)
    normal = keyed_normal_(torch.empty(512, 512), 1.0, 2.0, seed=1, name="n")
    assert abs(normal.mean().item() - 1.0) < 0.02 and abs(normal.std().item() - 2.0) < 0.02
    bf16 = keyed_uniform_(torch.empty(37, 29, dtype=torch.bfloat16), -0.5, 2.0, seed=9, name="w")
    assert torch.equal(bf16, full.to(torch.bfloat16))
    with pytest.raises(KernelInputError, match="indices"):
        keyed_uniform_(torch.empty(2, 2), seed=1, name="w", global_shape=(4, 4))


class _Block(torch.nn.Module):
    def __init__(self, reverse: bool) -> None:
        super().__init__()
        if reverse:  # other construction (and registration) order, same names
            self.proj = torch.nn.Linear(16, 8)
            self.fc = torch.nn.Linear(8, 16)
        else:
            self.fc = torch.nn.Linear(8, 16)
            self.proj = torch.nn.Linear(16, 8)


def _init(model: torch.nn.Module) -> None:
    torch.nn.init.trunc_normal_(model.fc.weight, std=0.5, a=-0.6, b=0.6)  # resamples
    torch.nn.init.normal_(model.proj.weight, std=0.02)
    torch.nn.init.kaiming_uniform_(model.proj.weight, a=1.0)
    torch.nn.init.xavier_uniform_(model.proj.weight)
    torch.nn.init.uniform_(model.fc.bias, -0.1, 0.1)
    torch.nn.init.zeros_(model.proj.bias)


def test_values_depend_on_seed_name_index_only() -> None:
    torch.manual_seed(0)
    plain = _Block(reverse=False)
    state = torch.get_rng_state()
    with torch.no_grad(), invariant_random(plain, init="keyed", seed=5):
        _init(plain)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from the generator
    torch.manual_seed(123)  # another generator state changes nothing
    with torch.device("meta"):
        late = _Block(reverse=True)  # built on meta, other order
    late.to_empty(device="cpu")  # materialised: new parameter objects
    with torch.no_grad(), invariant_random(late, init="keyed", seed=5):
        _init(late)
    for (name, a), (_, b) in zip(
        sorted(plain.named_parameters()), sorted(late.named_parameters()), strict=True
    ):
        assert torch.equal(a, b), name
    assert (plain.fc.weight.abs() <= 0.6).all()
    # a pipeline stage that holds only `proj` (same FQNs) initialises it to the same values
    stage = _Block(reverse=False)
    del stage.fc
    with torch.no_grad(), invariant_random(stage, init="keyed", seed=5):
        torch.nn.init.xavier_uniform_(stage.proj.weight)
    assert torch.equal(stage.proj.weight, plain.proj.weight)


def test_names_are_stable_and_errors_typed() -> None:
    assert stable_name("layers.0._checkpoint_wrapped_module.attn._orig_mod.w") == "layers.0.attn.w"
    model = torch.nn.Linear(2, 2)
    keyed = KeyedInit(model, 1)
    assert keyed.name_of(model.weight) == "weight"
    assert keyed.name_of(model.weight.data) == "weight"  # found by storage
    # a tensor of no model is named by its place among such draws
    assert [keyed.name_of(torch.empty(2)) for _ in range(2)] == ["<anonymous>.1", "<anonymous>.2"]
    assert KeyedInit(None, 1).name_of(model.weight) == "<anonymous>.1"
    with pytest.raises(InvariantRandomConfigError, match="takes model="):
        KeyedInit("not a module", 1)  # type: ignore[arg-type]
    with pytest.raises(InvariantRandomConfigError) as info:
        KeyedInit(model, 2**64)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)


def _truncated_moments(mean: float, std: float, a: float, b: float) -> tuple[float, float]:
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    mass = 0.5 * (math.erf(beta / math.sqrt(2)) - math.erf(alpha / math.sqrt(2)))
    shift = (pdf(alpha) - pdf(beta)) / mass
    var = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / mass - shift**2
    return mean + std * shift, std * math.sqrt(var)


@pytest.mark.parametrize(
    "mean, std, a, b", [(0.0, 0.02, -0.06, 0.06), (1.0, 2.0, 0.5, 9.0), (0.0, 1.0, -2.0, 2.0)]
)
def test_values_follow_the_truncated_normal(mean: float, std: float, a: float, b: float) -> None:
    """Keyed trunc_normal_ (one inverse-CDF draw per element) stays in [a, b] and has the
    truncated normal's mean and std."""
    values = keyed_trunc_normal_(torch.empty(1 << 20), mean, std, a, b, seed=3, name="w")
    assert values.min().item() >= a and values.max().item() <= b
    expected_mean, expected_std = _truncated_moments(mean, std, a, b)
    # 2**20 samples: the standard error of the mean is std / 1024
    assert abs(values.double().mean().item() - expected_mean) < 5 * expected_std / 1024
    assert abs(values.double().std().item() / expected_std - 1) < 5e-3
    with pytest.raises(KernelInputError, match="std > 0"):
        keyed_trunc_normal_(torch.empty(4), mean, 0.0, a, b, seed=3, name="w")


def test_a_new_large_tensor_is_filled_in_pieces_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor of 32 MiB and more is a new mapping (malloc's mmap): its pages are mapped a
    piece (256 KiB) at a time just ahead of the fill, before each batch of a run (rows here
    start off a multiple of 4) and as the element-by-element loop reaches them. On every path,
    the values of the batched runs equal those of the element-by-element loop (scalar Philox)
    that a shard with its columns in reverse order takes, itself on a new mapping."""
    from rng_tracker.kernels import _c_build

    rows, cols = 128, 65536 + 7  # 33.5 MiB; each row one run of two pieces, rows unaligned
    reverse = list(range(cols - 1, -1, -1))
    for path in _keyed_fill.isa_paths():
        monkeypatch.setitem(_keyed_fill._state, "isa", _c_build.ISA_CODES[path])
        for fill in (
            lambda t, **k: keyed_uniform_(t, -0.5, 2.0, **k),
            lambda t, **k: keyed_normal_(t, 0.1, 0.02, **k),
        ):
            whole = fill(torch.empty(rows, cols), seed=7, name="w")
            flipped = fill(
                torch.empty(rows, cols),
                seed=7,
                name="w",
                global_shape=(rows, cols),
                indices=[range(rows), reverse],
            )
            assert torch.equal(whole.flip(-1).view(torch.int32), flipped.view(torch.int32)), path


def test_every_instruction_set_path_fills_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable and the AVX2 keyed fill (where this CPU has it) write the same bits for
    uniform, normal and truncated normal: a run whose Philox counter crosses 2**32 (the AVX2
    path splits its batch there), a short run, and scattered columns."""
    from rng_tracker.kernels import _c_build, _cpu_kernel, _keyed_fill

    paths = _keyed_fill.isa_paths()
    # the dropout kernel's paths, which its test checks against the CPU's flags: AVX2 is here
    # wherever the CPU has it, so this compares two paths there, not one with itself
    assert paths[0] == "portable" and paths == _cpu_kernel.isa_paths()
    crossing = [range(2**34 - 1000 - 3, 2**34 + 1000)]  # g // 4 crosses 2**32 inside
    cases = [
        ((2003,), (2**36,), crossing),
        ((5, 7), (5, 7), None),
        ((3, 4), (9, 2**20), [[0, 4, 8], [1, 2**19, 2**19 + 1, 2**20 - 1]]),
    ]
    fills = [
        lambda t, **k: keyed_uniform_(t, -0.5, 2.0, **k),
        lambda t, **k: keyed_normal_(t, 0.1, 0.02, **k),
        lambda t, **k: keyed_trunc_normal_(t, 0.0, 0.02, -0.04, 0.04, **k),
    ]
    for shape, global_shape, indices in cases:
        for fill in fills:
            by_path = []
            for path in paths:
                monkeypatch.setitem(_keyed_fill._state, "isa", _c_build.ISA_CODES[path])
                target = {"seed": 7, "name": "w", "global_shape": global_shape, "indices": indices}
                by_path.append(fill(torch.empty(shape), **target))
            for values in by_path[1:]:
                assert torch.equal(values.view(torch.int32), by_path[0].view(torch.int32))
    # and each path against the plain-torch definition (so one path alone is checked too)
    for path in paths:
        monkeypatch.setitem(_keyed_fill._state, "isa", _c_build.ISA_CODES[path])
        got = keyed_uniform_(torch.empty(5, 7), -0.5, 2.0, seed=7, name="w")
        want = keyed_uniform_reference((5, 7), -0.5, 2.0, seed=7, name="w")
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path
    # each refusal typed for its own cause, and nothing written
    many_dims = torch.full([1] * 65, 3.0)
    with pytest.raises(KernelInputError, match="at most 64 dims, got 65"):
        keyed_uniform_(many_dims, seed=7, name="w")
    # torch's ops take at most 64 dims: read the values through a flat tensor on its storage
    flat = torch.tensor([]).set_(many_dims.untyped_storage())
    assert torch.equal(flat, torch.tensor([3.0]))
    monkeypatch.setitem(_keyed_fill._state, "isa", 99)  # a path no CPU has
    untouched = torch.full((4,), 3.0)
    with pytest.raises(KernelUnavailableError, match=r"path '99' \(RNG_TRACKER_CPU_ISA\), which"):
        keyed_uniform_(untouched, seed=7, name="w")
    assert torch.equal(untouched, torch.full((4,), 3.0))


_NAN, _INF = float("nan"), float("inf")
_UNIFORM_BOUNDS = [(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (_NAN, 1.0), (0.0, _INF), (-_INF, 0.0),
                   (0.0, 1e5), (-3e38, 3e38), (-1, 2)]  # fmt: skip
_NORMAL_PARAMS = [(0.0, 1.0), (0.0, 0.0), (0.0, -1.0), (0.0, _NAN), (_NAN, 1.0), (_INF, 1.0),
                  (0.0, _INF)]  # fmt: skip


def _torch_refuses(torch_fill: object, dtype: torch.dtype, first: float, second: float) -> bool:
    try:
        torch_fill(torch.empty(3, dtype=dtype), first, second)  # type: ignore[operator]
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_bounds_are_refused_where_torch_refuses_them(dtype: torch.dtype) -> None:
    """Plain tensor and module alike: keyed uniform_/normal_ raise KernelInputError (a
    ValueError) exactly where torch's own raise (a float64 keyed fill, computed in float32, also
    refuses bounds past float32's range); a refusal writes nothing and draws nothing."""
    for fill, torch_fill, cases in (
        (keyed_init.keyed_uniform_, torch.Tensor.uniform_, _UNIFORM_BOUNDS),
        (keyed_init.keyed_normal_, torch.Tensor.normal_, _NORMAL_PARAMS),
    ):
        for first, second in cases:
            torch_refuses = _torch_refuses(torch_fill, dtype, first, second)
            beyond_float32 = dtype == torch.float64 and (first, second) == (-3e38, 3e38)
            t = torch.full((3,), 7.0, dtype=dtype)
            state = torch.get_rng_state()
            if not (torch_refuses or beyond_float32):
                fill(t, first, second, name="w", seed=1)
                continue
            with pytest.raises(KernelInputError, match="as torch requires") as info:
                fill(t, first, second, name="w", seed=1)
            assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
            assert torch.equal(t, torch.full((3,), 7.0, dtype=dtype)), (fill, first, second)
            assert torch.equal(torch.get_rng_state(), state)


def _assert_refused(call: object, t: torch.Tensor, error: type, builtin: type, words: str) -> None:
    state = torch.get_rng_state()
    with pytest.raises(error, match=words) as info:
        call(t)  # type: ignore[operator]
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert t.is_meta or torch.equal(t, torch.full((3,), 7.0))
    assert torch.equal(torch.get_rng_state(), state)


def test_bad_arguments_are_typed_before_anything_is_written() -> None:
    """Non-numbers are KernelInputTypeError (a TypeError), not bare TypeErrors; the meta device
    and the kernel's own entry points check alike; a valid call keeps its exact bits."""
    for call, error, builtin, words in (
        (lambda t: keyed_init.keyed_uniform_(t, "x", 1.0, name="w", seed=1),
         KernelInputTypeError, TypeError, "a must be a real number, got str"),
        (lambda t: keyed_init.keyed_normal_(t, 0.0, None, name="w", seed=1),
         KernelInputTypeError, TypeError, "std must be a real number, got NoneType"),
        (lambda t: keyed_init.keyed_trunc_normal_(t, "x", name="w", seed=1),
         KernelInputTypeError, TypeError, "mean must be a real number"),
        (lambda t: keyed_init.keyed_uniform_(t, torch.ones(2), name="w", seed=1),
         KernelInputTypeError, TypeError, "a must be a real number, got Tensor"),
        (lambda t: keyed_init.keyed_uniform_(t, 1.0, 0.0, name="w", seed=1),
         KernelInputError, ValueError, "a <= b"),
        (lambda t: keyed_init.keyed_uniform_(t.int(), name="w", seed=1),
         KernelInputTypeError, TypeError, "floating tensors, got torch.int32"),
        (lambda t: keyed_init.keyed_uniform_(t, name=5, seed=1),
         KernelInputTypeError, TypeError, "name must be a non-empty str"),
    ):  # fmt: skip
        for t in (torch.full((3,), 7.0), torch.empty(3, device="meta")):
            _assert_refused(call, t, error, builtin, words)
    for call, error, builtin, words in (  # the kernel's entry points (CPU tensors only)
        (lambda t: keyed_uniform_(t, 1.0, 0.0, name="w", seed=1),
         KernelInputError, ValueError, "a <= b"),
        (lambda t: keyed_normal_(t, 0.0, -1.0, name="w", seed=1),
         KernelInputError, ValueError, "std >= 0"),
        (lambda t: keyed_trunc_normal_(t, 0.0, 1.0, "x", name="w", seed=1),
         KernelInputTypeError, TypeError, "a must be a real number"),
    ):  # fmt: skip
        _assert_refused(call, torch.full((3,), 7.0), error, builtin, words)
    with pytest.raises(KernelInputTypeError, match="tensor or a DTensor, got str"):
        keyed_init.keyed_uniform_("t", name="w", seed=1)  # type: ignore[arg-type]
    with pytest.raises(KernelInputTypeError, match="fqn must be a str") as info:
        stable_name(5)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    # numbers torch takes (ints, a 0-dim tensor) keep the bits of their float values
    want = keyed_uniform_reference((4, 5), -1.0, 2.0, seed=3, name="w")
    assert torch.equal(keyed_init.keyed_uniform_(torch.empty(4, 5), -1, 2, name="w", seed=3), want)
    got = keyed_init.keyed_uniform_(torch.empty(4, 5), torch.tensor(-1.0), 2, name="w", seed=3)
    assert torch.equal(got, want)
    # ... inexact ones too: bounds are combined as Python floats (a float32 tensor would round
    # the float beside it to float32 first)
    tensors = (torch.tensor(0.1), 0.7)  # a float32 0-dim tensor with a Python float
    floats = tuple(float(v) for v in tensors)  # the same values, as Python floats
    for fill in (
        keyed_init.keyed_uniform_,
        keyed_init.keyed_normal_,
        lambda t, mean, std, **k: keyed_init.keyed_trunc_normal_(t, mean, std, -0.2, 1.3, **k),
    ):
        by_float = fill(torch.empty(4, 5), *floats, name="w", seed=3)
        by_tensor = fill(torch.empty(4, 5), *tensors, name="w", seed=3)
        assert torch.equal(by_tensor.view(torch.int32), by_float.view(torch.int32))


def test_a_refused_fill_takes_no_name() -> None:
    """KeyedInit.fill checks before it names: a refused draw leaves the anonymous names of
    later draws, so their values, as they were."""
    keyed = KeyedInit(None, 5)
    with pytest.raises(KernelInputTypeError, match="floating tensors"):
        keyed.fill(torch.empty(4, dtype=torch.int32), "uniform", 0.0, 1.0)
    with pytest.raises(KernelInputError, match="std >= 0"):
        keyed.fill(torch.empty(4), "normal", 0.0, -1.0)
    got = keyed.fill(torch.empty(4), "uniform", 0.0, 1.0)
    assert keyed.anonymous_name() == "<anonymous>.2"
    assert torch.equal(got, keyed_uniform_reference((4,), seed=5, name="<anonymous>.1"))


def test_a_tensor_is_never_named_by_a_storage_another_tensor_held() -> None:
    """The name map is keyed by storage for ``param.data``; a storage that changed hands since
    the map was made must not name its new holder after its old one. Swapped explicitly here
    (weight 1 takes weight 0's old storage), and as ``.to()`` inside the block does, after which
    HF-style ``.data.normal_()`` init gave layer i the values of layer i - 1."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)])
    keyed = KeyedInit(model, seed=7)
    w0, w1 = model[0].weight, model[1].weight
    old = w0.data
    w0.data, w1.data = torch.empty_like(old), old
    assert keyed.name_of(w1.data) == "1.weight" and keyed.name_of(w0.data) == "0.weight"

    def build() -> torch.nn.Sequential:
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(4)])

    reference = build().to(torch.float64)
    with invariant_random(reference, seed=7):
        for layer in reference:
            layer.weight.data.normal_(0.0, 0.02)
    moved = build()
    with invariant_random(moved, seed=7):
        moved.to(torch.float64)  # new storages for the same Parameter objects
        for layer in moved:
            layer.weight.data.normal_(0.0, 0.02)
    for i in range(4):
        assert torch.equal(moved[i].weight, reference[i].weight), i


def test_a_tied_weight_is_keyed_by_its_smallest_name_in_any_registration_order() -> None:
    """A weight under two names (an embedding tied to the head) took the name registered first,
    so the same model declared in another order drew other values."""

    class LM(torch.nn.Module):
        def __init__(self, head_first: bool) -> None:
            super().__init__()
            if head_first:
                self.head = torch.nn.Linear(6, 10, bias=False)
                self.emb = torch.nn.Embedding(10, 6)
            else:
                self.emb = torch.nn.Embedding(10, 6)
                self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

    values = []
    for head_first in (False, True):
        model = LM(head_first)
        with invariant_random(model, seed=1):
            torch.nn.init.normal_(model.emb.weight, std=0.02)
        values.append(model.emb.weight.detach())
    assert torch.equal(values[0], values[1])
    expected = keyed_init.keyed_normal_(torch.empty(10, 6), 0.0, 0.02, seed=1, name="emb.weight")
    assert torch.equal(values[0], expected)  # "emb.weight" < "head.weight"


def test_a_name_utf8_cannot_encode_is_a_typed_error() -> None:
    t = torch.full((3,), 5.0)
    with pytest.raises(KernelInputError, match="lone surrogate") as raised:
        keyed_init.keyed_normal_(t, 0.0, 1.0, seed=1, name="w\ud800")
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, RNGTrackerError)
    assert torch.equal(t, torch.full((3,), 5.0))


def test_under_fake_tensors_keyed_init_is_shape_only_as_torchs_init():
    """A memory estimate builds the model under FakeTensorMode: keyed init writes nothing there
    (the C fill would write through a fake tensor's data pointer, a crash), as torch's init
    writes nothing; then the same call on a real tensor fills its values."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from rng_tracker.parallel.invariant import invariant_random

    with FakeTensorMode():
        fake = keyed_init.keyed_normal_(torch.empty(4, 8), name="w", seed=1)
        with invariant_random():
            layer = torch.nn.Linear(8, 4)
    assert isinstance(fake, FakeTensor) and isinstance(layer.weight, FakeTensor)
    real = keyed_init.keyed_normal_(torch.empty(4, 8), name="w", seed=1)
    assert torch.equal(real, keyed_init.keyed_normal_(torch.zeros(4, 8), name="w", seed=1))
    assert real.std() > 0.5


def test_an_empty_name_is_a_value_error_and_a_name_of_another_type_a_type_error() -> None:
    """keyed_normal_(t, name="") raised KernelInputTypeError: an empty str is a str of the
    wrong value, a KernelInputError (a ValueError); a name that is no str stays a TypeError."""
    for fill in (
        keyed_init.keyed_uniform_,
        keyed_init.keyed_normal_,
        keyed_init.keyed_trunc_normal_,
    ):
        for t in (torch.full((3,), 7.0), torch.empty(3, device="meta")):
            _assert_refused(
                lambda t, fill=fill: fill(t, name="", seed=0),
                t,
                KernelInputError,
                ValueError,
                "name must not be empty",
            )
            with pytest.raises(KernelInputError) as info:
                fill(t, name="", seed=0)
            assert not isinstance(info.value, TypeError)
            _assert_refused(
                lambda t, fill=fill: fill(t, name=None, seed=0),
                t,
                KernelInputTypeError,
                TypeError,
                "name must be a non-empty str",
            )


def test_keyed_init_of_a_model_or_seed_of_the_wrong_type_is_a_type_error() -> None:
    """KeyedInit(5, 0) raised InvariantRandomConfigError, a ValueError only; a model that is no
    nn.Module and a seed that is no int are type errors of the same family, a seed out of range
    stays a value error."""
    from rng_tracker.errors import InvariantRandomConfigTypeError

    before = torch.get_rng_state()
    for model, seed, match in (
        (5, 0, "takes model=.*got int"),
        ("a module", 0, "got str"),
        (None, "1", r"seed must be an int in \[0, 2\*\*64\), got '1'"),
        (None, 1.0, "got 1.0"),
        (None, True, "got True"),
    ):
        with pytest.raises(InvariantRandomConfigTypeError, match=match) as info:
            KeyedInit(model, seed)  # type: ignore[arg-type]
        assert isinstance(info.value, InvariantRandomConfigError)
        assert isinstance(info.value, TypeError) and isinstance(info.value, RNGTrackerError)
    for seed in (-1, 2**64):
        with pytest.raises(InvariantRandomConfigError, match="seed must be an int") as info:
            KeyedInit(None, seed)
        assert isinstance(info.value, ValueError) and not isinstance(info.value, TypeError)
    assert torch.equal(torch.get_rng_state(), before)
