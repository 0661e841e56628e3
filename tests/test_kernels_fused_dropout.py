"""Fused dropout kernels: Philox answers, Triton == reference bitwise, layout invariance,
statistics, mask-free memory, tracker integration, compile-traceability, typed errors."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from _dispatch_log import OpNames

import rng_tracker.kernels.reference as reference_module
from rng_tracker import RNGStatesTracker, RNGTrackerError, checkpoint
from rng_tracker.errors import KernelInputError, KernelInputTypeError
from rng_tracker.kernels import Chunk, IndexMap, Region, bias_dropout_add, dropout
from rng_tracker.kernels._index_map import index_map_of
from rng_tracker.kernels.philox import philox4x32
from rng_tracker.kernels.reference import keep_threshold

M32 = 0xFFFFFFFF
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes (numel not a multiple of 4, of the block; 1 and 0 elements), and sizes whose numel
# and last dim are multiples of 4 (per-group masks and bias columns), across program boundaries.
SHAPES = [(0,), (1,), (3,), (5, 7), (1023,), (1025,), (3, 5, 67), (3, 4), (4, 8), (6, 260)]


_SEED = torch.tensor([1, 0, 0, 0])
_MAP_2X4 = index_map_of((2, 4), None)


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("key", "counter", "expected"),
    [
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32, M32), (M32, M32, M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0xA4093822, 0x299F31D0),
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_reproduces_random123_known_answers(key, counter, expected):
    assert tuple(philox4x32(key, torch.tensor(counter)).tolist()) == expected


def _run(impl: str, op: str, x, bias, residual, p=0.3):
    g = gen()
    x = x.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    residual = residual.detach().requires_grad_()
    if op == "dropout":
        out = dropout(x, p, generator=g, impl=impl)
    else:
        out = bias_dropout_add(x, bias, residual, p, generator=g, impl=impl)
    out.backward(torch.linspace(-2, 2, out.numel()).reshape(out.shape).to(out.dtype))
    grads = [t.grad for t in (x, bias, residual) if t is not None and t.grad is not None]
    return out.detach(), grads, g.get_state()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16)) if t.numel() else t


@pytest.mark.parametrize("op", ["dropout", "bias_dropout_add"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernel_equals_reference_bitwise(op, shape, dtype):
    """Outputs, masks and gradients of the Triton kernel (interpreted on CPU) equal the
    reference bit for bit, for odd sizes and empty tensors; the generator ends alike."""
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    bias = torch.randn(shape[-1:]).to(dtype) if op == "bias_dropout_add" else None
    residual = torch.randn(shape).to(dtype)
    ref, triton = _run("torch", op, x, bias, residual), _run("triton", op, x, bias, residual)
    assert torch.equal(_bits(ref[0]), _bits(triton[0]))
    assert len(ref[1]) == len(triton[1])
    for a, b in zip(ref[1], triton[1], strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(ref[2], triton[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_converts_every_16_bit_value_like_the_reference(dtype):
    """All 65536 bit patterns (zeros, subnormals, inf) as x, bias and residual, through the
    Triton kernel's loads, scale and store, equal the reference bit for bit; NaNs stay NaN
    (their payloads are outside the claim). The interpreter's own bf16 load lost subnormals."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    residual, bias = every.flip(0), every[: 2**8].roll(1)
    x = every.view(2**8, 2**8)
    for p in (0.3, 1.0):
        ref, got = (
            bias_dropout_add(x, bias, residual.view(x.shape), p, generator=gen(), impl=impl)
            for impl in ("torch", "triton")
        )
        nan = ref.isnan()
        assert torch.equal(nan, got.isnan())
        assert torch.equal(_bits(ref)[~nan], _bits(got)[~nan])
    ref, got = (dropout(every, 0.3, generator=gen(), impl=impl) for impl in ("torch", "triton"))
    nan = ref.isnan()
    assert torch.equal(nan, got.isnan()) and torch.equal(_bits(ref)[~nan], _bits(got)[~nan])


_LAYOUTS = {
    "transposed": lambda: torch.randn(16, 12).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda: torch.randn(2, 3, 2, 3, 4).contiguous(
        memory_format=torch.channels_last_3d
    ),
    "permuted": lambda: torch.randn(4, 6, 8).permute(2, 0, 1),
    "outer_dims_swapped": lambda: torch.randn(4, 6, 8).transpose(0, 1),  # last dim innermost
    # 5 map dims in memory order, more than Triton places: through a row-major copy
    "reversed_5d": lambda: torch.randn(2, 3, 2, 3, 2).permute(4, 3, 2, 1, 0),
    "sliced": lambda: torch.randn(8, 10)[:, ::2],  # not dense: the output is row-major
}


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_a_strided_input_keeps_its_memory_format_and_its_contiguous_copys_mask(impl, layout):
    """Like torch's dropout, the output of a dense x has x's strides (channels_last, a transpose,
    any permutation), and its values and gradient are bitwise those of x's contiguous copy."""
    x = _LAYOUTS[layout]().requires_grad_()
    flat = x.detach().contiguous().requires_grad_()
    assert not x.is_contiguous()
    out, want = (dropout(t, 0.5, generator=gen(), impl=impl) for t in (x, flat))
    assert torch.equal(out, want)
    dense = layout != "sliced"
    assert out.stride() == (x.stride() if dense else want.stride())
    grad = torch.randn_like(x)  # x's strides, as a loss's gradient would have
    out.backward(grad)
    want.backward(grad)
    assert torch.equal(x.grad, flat.grad)
    assert x.grad.stride() == x.stride() or not dense


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_permuted_shards_assemble_to_the_unsharded_output(impl):
    """A shard stored transposed draws its place's mask: the shards' outputs, with the shard's
    strides, assemble to the unsharded output; a map that cannot be split per dim of x (a dim of
    3 across map dims of 2 and 3) still draws right, row-major."""
    full = torch.randn(8, 6)
    seed = torch.tensor([5, 0, 0, 0])
    whole = dropout(full, 0.5, seed=seed, impl=impl)
    for i, rows in enumerate(full.chunk(2)):
        shard = rows.t().contiguous().t()
        out = dropout(shard, 0.5, seed=seed, shard=Chunk(0, i, 2, extent=8), impl=impl)
        assert torch.equal(out, whole.chunk(2)[i]) and out.stride() == shard.stride()
    index_map = IndexMap(offset=0, dims=((2, 10), (3, 1)), logical_numel=20)
    x = torch.randn(2, 3).t()  # (3, 2): its inner dim of 2 is not a dim of the map
    out = dropout(x, 0.5, seed=seed, shard=index_map, impl=impl)  # through a row-major copy
    assert torch.equal(out, dropout(x.contiguous(), 0.5, seed=seed, shard=index_map, impl=impl))
    assert out.stride() == x.stride()


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("order", [(1, 0, 2), (2, 0, 1)], ids=["last_inner", "last_moved"])
def test_bias_dropout_add_keeps_xs_memory_format(impl, with_bias, order):
    """residual + dropout(x + bias) takes x's strides, whether x's last dim (the bias's) is its
    innermost in memory (computed in memory order) or not (computed row-major, then written in
    x's format). Values bitwise as the contiguous call's either way."""
    back = sorted(range(3), key=order.__getitem__)
    x = torch.randn(4, 6, 8).permute(order).contiguous().permute(back)
    residual = torch.randn(x.shape).permute(order).contiguous().permute(back)
    bias = torch.randn(x.shape[-1]) if with_bias else None
    seed = torch.tensor([9, 0, 0, 0])
    out = bias_dropout_add(x, bias, residual, 0.4, seed=seed, impl=impl)
    want = bias_dropout_add(x.contiguous(), bias, residual.contiguous(), 0.4, seed=seed, impl=impl)
    assert torch.equal(out, want)
    assert out.stride() == x.stride()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shards_assemble_to_the_unsharded_output(impl, dim, count):
    """Concatenated shard outputs equal the unsharded output bitwise; the generator ends in the
    same state after each shard's call as after the unsharded call (dim -1 with 4 shards of 3
    elements exercises the unaligned path)."""
    x = torch.randn(4, 8, 12)
    whole_gen = gen(7)
    whole = dropout(x, 0.4, generator=whole_gen, impl=impl)
    parts = []
    for index, chunk in enumerate(x.chunk(count, dim=dim)):
        g = gen(7)
        parts.append(
            dropout(
                chunk.contiguous(),
                0.4,
                shard=Chunk(dim, index, count, extent=x.shape[dim]),
                generator=g,
                impl=impl,
            )
        )
        assert torch.equal(g.get_state(), whole_gen.get_state())
    assert torch.equal(torch.cat(parts, dim=dim), whole)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("shape", "dim", "count"), [((8, 3), 0, 4), ((1, 10, 3), 1, 2)])
def test_contiguous_block_shards_at_unaligned_offsets_assemble(impl, shape, dim, count):
    """A shard that is one contiguous block of the logical tensor (all leading dims 1) whose
    offset is not a multiple of 4 still draws the unsharded mask, with bias and residual."""
    x, residual = torch.randn(shape), torch.randn(shape)
    bias = torch.randn(shape[-1:])
    whole = bias_dropout_add(x, bias, residual, 0.3, generator=gen(5), impl=impl)
    parts = [
        bias_dropout_add(
            xs.contiguous(),
            bias,
            rs.contiguous(),
            0.3,
            shard=Chunk(dim, index, count, extent=shape[dim]),
            generator=gen(5),
            impl=impl,
        )
        for index, (xs, rs) in enumerate(zip(x.chunk(count, dim), residual.chunk(count, dim)))
    ]
    assert torch.equal(torch.cat(parts, dim=dim), whole)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_within_four_sigma(p):
    """Over 2**20 elements the kept fraction is 1 - p within 4 binomial standard deviations."""
    n = 2**20
    kept = (dropout(torch.ones(n), p, generator=gen(11), impl="torch") != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)


def test_masks_of_consecutive_calls_are_uncorrelated():
    """The Pearson correlation of two consecutive masks is within 4 / sqrt(n) of zero."""
    n, g = 2**20, gen(12)
    a = (dropout(torch.ones(n), 0.5, generator=g, impl="torch") != 0).double()
    b = (dropout(torch.ones(n), 0.5, generator=g, impl="torch") != 0).double()
    r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(r) < 4 / math.sqrt(n)


def _saved_bytes(fn, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return total


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("wanted", ["x", "bias", "residual"])
def test_backward_computes_only_the_gradient_asked_for(impl, wanted):
    """With one input requiring grad, backward runs only the ops its gradient needs (no mask
    regeneration for the residual alone, no bias reduction unless bias wants a gradient), and
    that gradient equals the one computed with every input requiring grad."""
    inputs = {"x": torch.randn(6, 8), "bias": torch.randn(8), "residual": torch.randn(6, 8)}
    grad = torch.randn(6, 8)
    every = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    bias_dropout_add(*every.values(), 0.3, generator=gen(), impl=impl).backward(grad)
    alone = {k: v.clone().requires_grad_(k == wanted) for k, v in inputs.items()}
    out = bias_dropout_add(*alone.values(), 0.3, generator=gen(), impl=impl)
    with OpNames() as backward_ops:
        out.backward(grad)
    assert torch.equal(alone[wanted].grad, every[wanted].grad)
    regenerations = sum("fused_dropout" in name for name in backward_ops.names)
    reductions = sum(name.startswith("aten.sum") for name in backward_ops.names)
    assert (regenerations, reductions) == {"x": (1, 0), "bias": (1, 1), "residual": (0, 0)}[wanted]


@pytest.mark.parametrize(("impl", "drawn_bytes"), [("torch", 32), ("cpu", 0), ("triton", 0)])
def test_saved_bytes_per_call_do_not_grow_with_numel(impl, drawn_bytes):
    """Dropout and bias-dropout-add save no per-element tensor: a keyed call saves its 32-byte
    seed tensor, a drawn call the 32-byte seed tensor of its op (the reference) or nothing (a
    kernel called straight keeps the words as ints); F.dropout saves a per-element mask (a float
    mask on CPU, 4 B/element; a bool mask on CUDA)."""
    seed = torch.tensor([5, 0, 0, 0])
    sizes = (64, 4096)

    def fused(n: int, **randomness: object) -> int:
        x = torch.ones(n // 8, 8, requires_grad=True)
        return _saved_bytes(
            lambda x: bias_dropout_add(
                x, torch.ones(8), torch.ones_like(x), 0.5, impl=impl, **randomness
            ),
            x,
        )

    def plain(n: int, **randomness: object) -> int:
        return _saved_bytes(
            lambda x: dropout(x, 0.5, impl=impl, **randomness), torch.ones(n, requires_grad=True)
        )

    assert [plain(n) for n in sizes] == [drawn_bytes] * 2
    assert [fused(n) for n in sizes] == [drawn_bytes] * 2
    assert [plain(n, seed=seed) for n in sizes] == [32, 32]
    assert [fused(n, seed=seed) for n in sizes] == [32, 32]
    torchs = [
        _saved_bytes(lambda x: F.dropout(x, 0.5), torch.ones(n, requires_grad=True)) for n in sizes
    ]
    assert torchs[0] >= 64 and torchs[1] == 64 * torchs[0]


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_what_autograd_saves_does_not_depend_on_dispatch_modes(impl):
    """A drawn call called straight kept its words as ints; under any dispatch mode (a
    profiler's, a FLOP counter's, checkpointing's check_rng or debug) it went through its op,
    which saved a seed tensor. torch.utils.checkpoint compares the saved tensors of a forward
    and its recompute, so a mode active in one of them only broke backward. The bits, the
    generator's advance and the saved tensors are now the same with and without a mode."""
    seed = torch.tensor([5, 0, 0, 0])
    results = []
    for mode in (None, OpNames()):
        with mode if mode is not None else contextlib.nullcontext():
            for randomness in ({"generator": gen(17)}, {"seed": seed}):
                x = torch.randn(4, 8, generator=gen(1)).requires_grad_()
                saved = _saved_bytes(lambda x, r=randomness: dropout(x, 0.5, impl=impl, **r), x)
                out = dropout(x, 0.5, impl=impl, **randomness)
                out.backward(torch.ones_like(out))
                state = randomness.get("generator")
                results.append((saved, out, x.grad, state and state.get_state()))
        if mode is not None:
            assert any("fused_dropout" in name for name in mode.names)  # the mode saw the op
    without, within = results[:2], results[2:]
    for plain, moded in zip(without, within, strict=True):
        assert plain[0] == moded[0]
        assert all(
            torch.equal(a, b) if a is not None else b is None
            for a, b in zip(plain[1:], moded[1:], strict=True)
        )


@pytest.mark.parametrize(
    "how", ["nested under check_rng", "nested under debug", "forward under a FLOP counter"]
)
def test_a_checkpoint_of_fused_dropout_backs_up_whatever_mode_its_forward_ran_under(how):
    """Each of these raised torch's CheckpointError "a different number of tensors was saved
    during the original forward and recomputation" in backward; F.dropout passed them all."""
    from torch.utils.flop_counter import FlopCounterMode

    def block(a):
        return dropout(a.tanh(), 0.3)

    def run(checkpointed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(4, 6, requires_grad=True)
        if not checkpointed:
            block(x).sum().backward()
        elif how == "forward under a FLOP counter":
            with FlopCounterMode(display=False):
                y = checkpoint(block, x, use_reentrant=False)
            y.sum().backward()
        else:
            option = {"check_rng": True} if how == "nested under check_rng" else {"debug": True}
            inner = lambda a: checkpoint(block, a, use_reentrant=False)  # noqa: E731
            checkpoint(inner, x, use_reentrant=False, **option).sum().backward()
        return x.grad

    assert torch.equal(run(checkpointed=True), run(checkpointed=False))


def test_dropout_inside_a_fork_draws_from_that_stream():
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 99)
    twin = torch.Generator().manual_seed(99)
    x = torch.randn(64)
    with tracker.fork("model-parallel-rng"):
        got = dropout(x, 0.5)
    assert torch.equal(got, dropout(x, 0.5, generator=twin))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_regenerates_identical_masks(use_reentrant):
    """Under checkpoint the recompute's kernels draw the forward's key: grads equal the plain run.
    (Non-reentrant: early_stop=False, so the recompute runs on past the last tensor backward
    needs; the dropouts save none, so torch would stop it before them.)"""
    tracker = RNGStatesTracker("cpu")
    whole = {} if use_reentrant else {"early_stop": False}

    def block(x, w, b, masks):
        h = (x @ w).tanh()  # tanh saves its output: backward needs the recompute
        with tracker.fork("mp"):
            h = dropout(h, 0.3)
        masks.append(h != 0)
        return bias_dropout_add(h, b, x, 0.2)

    def go(ckpt: bool):
        torch.manual_seed(5)
        tracker.reset()
        tracker.add("mp", 3)
        x = torch.randn(4, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        b = torch.randn(16, requires_grad=True)
        masks: list[torch.Tensor] = []
        out = (
            checkpoint(block, x, w, b, masks, use_reentrant=use_reentrant, tracker=tracker, **whole)
            if ckpt
            else block(x, w, b, masks)
        )
        out.square().sum().backward()
        return (x.grad, w.grad, b.grad), masks

    plain, plain_masks = go(False)
    got, masks = go(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert torch.equal(masks[0], plain_masks[0]) and torch.equal(masks[0], masks[1])


def test_identity_cases_draw_nothing_and_p_one_gives_zeros():
    g = gen()
    before = g.get_state()
    x = torch.randn(10, requires_grad=True)
    assert dropout(x, 0.0, generator=g) is x
    assert dropout(x, 0.7, training=False, generator=g) is x
    out = dropout(x, 1.0, generator=g)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(10)) and torch.equal(x.grad, torch.zeros(10))
    assert torch.equal(g.get_state(), before)


@pytest.mark.parametrize(
    ("call", "error", "builtin", "words"),
    [
        (
            lambda g: dropout(torch.ones(4), 1.5, generator=g),
            KernelInputError,
            ValueError,
            "[0, 1]",
        ),
        (
            lambda g: dropout(torch.ones(4), -0.1, generator=g),
            KernelInputError,
            ValueError,
            "[0, 1]",
        ),
        (
            lambda g: dropout(torch.ones(4), "0.1", generator=g),
            KernelInputTypeError,
            TypeError,
            "float",
        ),
        (lambda g: dropout([1.0], 0.1, generator=g), KernelInputTypeError, TypeError, "tensor"),
        (
            lambda g: dropout(torch.ones(4, dtype=torch.int32), 0.1, generator=g),
            KernelInputError,
            ValueError,
            "dtype",
        ),
        (
            lambda g: dropout(torch.ones(4), 0.1, impl="cuda", generator=g),
            KernelInputError,
            ValueError,
            "impl",
        ),
        (
            lambda g: dropout(torch.ones(4), 0.1, shard=Chunk(3, 0, 2, extent=8), generator=g),
            KernelInputError,
            ValueError,
            "out of range",
        ),
        (
            lambda g: dropout(torch.ones(4), 0.1, shard=Chunk(0, 2, 2), generator=g),
            KernelInputError,
            ValueError,
            "index < count",
        ),
        (
            lambda g: bias_dropout_add(
                torch.ones(2, 4), torch.ones(3), torch.ones(2, 4), 0.1, generator=g
            ),
            KernelInputError,
            ValueError,
            "bias must have shape (4,)",
        ),
        (
            lambda g: bias_dropout_add(
                torch.ones(2, 4), torch.ones(4, device="meta"), torch.ones(2, 4), 0.1, generator=g
            ),
            KernelInputError,
            ValueError,
            "bias is on meta but x is on cpu; move it there",
        ),
        (
            lambda g: bias_dropout_add(
                torch.ones(2, 4), None, torch.ones(2, 4, device="meta"), 0.1, generator=g
            ),
            KernelInputError,
            ValueError,
            "meta",
        ),
        # calls that draw nothing (training=False, p == 0) check impl, generator and training too
        *(
            (call, KernelInputError, ValueError, "impl must be 'auto', 'triton', 'cpu' or 'torch'")
            for call in (
                lambda g: dropout(torch.ones(4), 0.1, training=False, impl="bogus", generator=g),
                lambda g: dropout(torch.ones(4), 0.0, impl="bogus", generator=g),
                lambda g: bias_dropout_add(
                    torch.ones(4), None, torch.ones(4), 0.1, training=False, impl="bogus"
                ),
                # impl and generator both bad: impl is named first, drawing or not
                lambda g: dropout(torch.ones(4), 0.1, impl="bogus", generator="g"),
                lambda g: dropout(torch.ones(4), 0.0, impl="bogus", generator="g"),
                lambda g: dropout(torch.ones(4), 0.1, training=False, impl="bogus", generator="g"),
            )
        ),
        *(
            (call, KernelInputTypeError, TypeError, "generator must be a torch.Generator, got str")
            for call in (
                lambda g: dropout(torch.ones(4), 0.0, generator="g"),
                lambda g: dropout(torch.ones(4), 0.1, training=False, generator="g"),
                lambda g: bias_dropout_add(torch.ones(4), None, torch.ones(4), 0.0, generator="g"),
            )
        ),
        # the reference and its mask, public too: the checks dropout makes (a raw torch error
        # for a bias on another device, an int64 x computed, a c2 of -1 taken as 2**32 - 1)
        (
            lambda g: reference_module.fused_dropout_reference(
                torch.ones(2, 4, dtype=torch.int64), None, None, _SEED, 0.5, _MAP_2X4
            ),
            KernelInputError,
            ValueError,
            "x has dtype torch.int64; fused dropout supports fp32, fp16 and bf16: cast it",
        ),
        (
            lambda g: reference_module.fused_dropout_reference(
                torch.ones(2, 4), torch.ones(4, device="meta"), None, _SEED, 0.5, _MAP_2X4
            ),
            KernelInputError,
            ValueError,
            "bias is on meta but x is on cpu; move it there",
        ),
        *(
            (call, KernelInputError, ValueError, "seed words c2 and c3 must be in [0, 2**32)")
            for call in (
                lambda g: reference_module.keep_mask(
                    torch.tensor([1, 0, -1, 0]), 0.5, _MAP_2X4, torch.device("cpu")
                ),
                lambda g: reference_module.fused_dropout_reference(
                    torch.ones(2, 4), None, None, torch.tensor([1, 0, 0, 2**32]), 0.5, _MAP_2X4
                ),
            )
        ),
        *(
            (call, KernelInputTypeError, TypeError, f"training must be a bool, got {words}")
            for call, words in (
                (lambda g: dropout(torch.ones(4), 0.1, training="no", generator=g), "str 'no'"),
                (lambda g: dropout(torch.ones(4), 0.0, training=1, generator=g), "int 1"),
                (
                    lambda g: bias_dropout_add(
                        torch.ones(4), None, torch.ones(4), 0.1, training=None, generator=g
                    ),
                    "NoneType None",
                ),
            )
        ),
    ],
)
def test_bad_input_is_typed_and_draws_nothing(call, error, builtin, words):
    g = gen()
    before, cpu_before = g.get_state(), torch.get_rng_state()
    with pytest.raises(error) as info:
        call(g)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    assert words in str(info.value)
    assert torch.equal(g.get_state(), before) and torch.equal(torch.get_rng_state(), cpu_before)


def test_ops_trace_under_torch_compile_with_the_seed_as_an_input():
    """fullgraph compile (fake kernels, autograd) of the op; a new seed tensor gives a new mask
    without recompiling, and compiled results equal eager ones bitwise."""
    import torch._dynamo

    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def step(x, seed):
        return torch.ops.rng_tracker.fused_dropout(x, None, None, seed, 0.5, 0, [64, 1], 64) * 2

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    x = torch.randn(64)
    seeds = [torch.tensor([k, 0, 0, 0], dtype=torch.int64) for k in (1, 2)]
    outs = [compiled(x, s) for s in seeds]
    assert len(compiles) == 1
    assert not torch.equal(outs[0], outs[1])
    for out, s in zip(outs, seeds, strict=True):
        assert torch.equal(out, step(x, s))


def _spec_mask(words: tuple[int, int, int, int], p: float, g: list[int]) -> torch.Tensor:
    """The keep mask of global indices g from the documented mask function, in Python ints."""
    key, base, c2, c3 = (w % 2**64 for w in words)
    kept = []
    for index in g:
        c = (base + index // 4) % 2**64
        counter = torch.tensor([c & M32, c >> 32, c2, c3])
        word = philox4x32((key & M32, key >> 32), counter)[index % 4].item()
        kept.append(word >= keep_threshold(p))
    return torch.tensor(kept)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    "words",
    [(5, 0, 0, 0), (-3, -1, 7, M32), (2**62 + 9, 2**63 - 2, M32, 1)],
    ids=["small", "base-wraps", "high-words"],
)
def test_explicit_seed_follows_the_mask_function_and_draws_nothing(impl, words):
    """With seed=[key, base, c2, c3] the mask of element g is Philox(key) at counter
    (lo32(c), hi32(c), c2, c3), c = base + g // 4 mod 2**64, for a region's global indices too
    (both counter halves and the wrap of c exercised); no generator state changes."""
    x = torch.randn(6, 10)
    seed = torch.tensor(words, dtype=torch.int64)
    cpu_before = torch.get_rng_state()
    out = dropout(x, 0.5, seed=seed, impl=impl)
    assert torch.equal(out != 0, _spec_mask(words, 0.5, list(range(60))).view(6, 10))
    box = dropout(
        x[2:5, 3:9].contiguous(), 0.5, shard=Region((6, 10), (2, 3)), seed=seed, impl=impl
    )
    assert torch.equal(box, out[2:5, 3:9])
    assert torch.equal(torch.get_rng_state(), cpu_before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_generator_draws_equal_the_seed_words_they_stand_for(impl):
    """A generator call is the keyed call with the drawn (key, base) and c2 = c3 = 0; other c2,
    c3 give other masks; bias_dropout_add's backward regenerates the seed's mask."""
    x, bias, residual = torch.randn(5, 8), torch.randn(8), torch.randn(5, 8)
    g = gen(3)
    key = int(torch.empty((), dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=gen(3)))
    via_generator = bias_dropout_add(x, bias, residual, 0.3, generator=g, impl=impl)
    seed = torch.tensor([key, 0, 0, 0])
    assert torch.equal(
        bias_dropout_add(x, bias, residual, 0.3, seed=seed, impl=impl), via_generator
    )
    for other in ([key, 0, 1, 0], [key, 0, 0, 1]):
        got = bias_dropout_add(x, bias, residual, 0.3, seed=torch.tensor(other), impl=impl)
        assert not torch.equal(got, via_generator)
    leaf = x.clone().requires_grad_()
    bias_dropout_add(leaf, bias, residual, 0.3, seed=seed, impl=impl).backward(torch.ones(5, 8))
    assert torch.equal(leaf.grad != 0, via_generator != residual)


def test_seed_modified_in_place_before_backward_is_reported():
    seed = torch.tensor([1, 2, 3, 4])
    x = torch.randn(8, requires_grad=True)
    out = dropout(x, 0.5, seed=seed, impl="torch")
    seed[1] += 1  # e.g. a device step counter advanced too early
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize(
    ("seed", "generator", "error", "words"),
    [
        (torch.tensor([1, 2, 3, 4]), gen(), KernelInputError, "not both"),
        (
            torch.tensor([1, 2, 3, 4], dtype=torch.int32),
            None,
            KernelInputError,
            "int64 tensor of 4",
        ),
        (torch.tensor([1, 2, 3]), None, KernelInputError, "int64 tensor of 4"),
        (torch.tensor([1, 2, 2**32, 0]), None, KernelInputError, "[0, 2**32)"),
        (torch.tensor([1, 2, 0, -1]), None, KernelInputError, "[0, 2**32)"),
        ([1, 2, 3, 4], None, KernelInputTypeError, "int64 tensor or None"),
    ],
)
def test_bad_seeds_are_typed_and_draw_nothing(seed, generator, error, words):
    g = generator if generator is not None else gen()
    before, cpu_before = g.get_state(), torch.get_rng_state()
    with pytest.raises(error) as info:
        dropout(torch.ones(4), 0.5, seed=seed, generator=generator)
    assert isinstance(info.value, RNGTrackerError) and words in str(info.value)
    assert torch.equal(g.get_state(), before) and torch.equal(torch.get_rng_state(), cpu_before)


@pytest.mark.parametrize("keyed", [False, True], ids=["drawn", "keyed"])
def test_triton_straight_route_equals_its_op_bitwise(keyed):
    """An eager impl="triton" call launches the kernel straight (drawn seed words as kernel
    arguments); under a dispatch mode it goes through the rng_tracker::fused_dropout_triton op.
    Outputs, gradients and the generator's advance are the same bits either way, and the same as
    the reference."""
    from rng_tracker.kernels import _dispatch
    from rng_tracker.kernels._index_map import index_map_of

    torch.manual_seed(3)
    x, bias, residual = torch.randn(6, 260), torch.randn(260), torch.randn(6, 260)
    grad = torch.randn(6, 260)
    seed = torch.tensor([-(2**62) - 7, 2**40, 5, 9]) if keyed else None
    results = []
    for impl, mode in (("triton", None), ("triton", OpNames()), ("torch", None)):
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        g = None if keyed else gen(2**63 + 11)
        with mode if mode is not None else contextlib.nullcontext():
            if impl == "triton":
                straight = _dispatch.route(leaves[0], impl, index_map_of(x.shape, None))
                assert straight == ("triton" if mode is not None else "triton_direct")
            out = bias_dropout_add(*leaves, 0.3, generator=g, seed=seed, impl=impl)
            out.backward(grad)
        if mode is not None:
            assert mode.names.count("rng_tracker.fused_dropout_triton.default") == 2  # fwd, bwd
        state = None if g is None else g.get_state()
        results.append((out, *(leaf.grad for leaf in leaves), state))
    for straight, through_op in zip(results[0], results[1], strict=True):
        assert torch.equal(straight, through_op) if straight is not None else through_op is None
    for straight, reference in zip(results[0], results[2], strict=True):
        assert torch.equal(straight, reference) if straight is not None else reference is None


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton", "triton_op"])
@pytest.mark.parametrize("view", ["table_column", "expanded"])
def test_a_strided_seed_draws_the_mask_of_its_contiguous_copy(view, impl):
    """A seed that is a view (a column of a seed table, stride 2; one word expanded, stride 0)
    gives every path, the registered Triton op included, the outputs and gradients of its
    contiguous copy on the reference, bit for bit: the Triton kernel reads the view's words."""
    from rng_tracker.kernels._index_map import index_map_of, to_op_args

    table = torch.tensor([[123456789, 2**40 + 3, 7, 3], [-987654321, 5, 9, 11]]).t().contiguous()
    seed = table[:, 0] if view == "table_column" else torch.tensor([5]).expand(4)
    assert not seed.is_contiguous()
    x, bias, residual = torch.randn(6, 260), torch.randn(260), torch.randn(6, 260)
    grad = torch.randn(6, 260)

    def outputs(seed: torch.Tensor, impl: str) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        if impl == "triton_op":
            index_map = to_op_args(index_map_of(x.shape, None))
            out = torch.ops.rng_tracker.fused_dropout_triton(*leaves, seed, 0.3, *index_map)
        else:
            out = bias_dropout_add(*leaves, 0.3, seed=seed, impl=impl)
        out.backward(grad)
        return [_bits(t) for t in (out, *(leaf.grad for leaf in leaves))]

    expected = outputs(seed.contiguous(), "torch")
    for got, want in zip(outputs(seed, impl), expected, strict=True):
        assert torch.equal(got, want)


def _on_a_new_thread(fn: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``fn()`` on a thread of its own, whose first drawn call makes the thread's scratch tensor."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize("impl", ["auto", "cpu", "torch", "triton"])
def test_a_thread_whose_first_draw_is_in_inference_mode_draws_alike_after_it(impl):
    """A thread's first drawn calls run under torch.inference_mode(), its later ones outside it
    (forward and backward): every output, gradient and generator state is the same bits as those
    of the same calls without inference mode, and no later call fails after drawing."""
    x, grad = torch.randn(6, 260), torch.randn(6, 260)

    def calls(inference: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)
        private = gen(9)
        with torch.inference_mode(inference):
            outs = [dropout(x, 0.3, impl=impl), dropout(x, 0.3, generator=private, impl=impl)]
            states = [torch.get_rng_state(), private.get_state()]
        leaf = x.clone().requires_grad_()
        outs.append(dropout(leaf, 0.3, impl=impl))
        outs[-1].backward(grad)
        outs += [leaf.grad, dropout(x, 0.3, generator=private, impl=impl)]
        return [_bits(t) for t in outs] + states + [torch.get_rng_state(), private.get_state()]

    expected, got = _on_a_new_thread(lambda: calls(False)), _on_a_new_thread(lambda: calls(True))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@contextlib.contextmanager
def _default_device(device: str) -> Iterator[None]:
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("impl", ["auto", "cpu", "torch", "triton"])
@pytest.mark.parametrize("how", ["device_context", "set_default_device"])
def test_a_meta_default_device_changes_no_bit_of_a_call_on_cpu_tensors(how, impl):
    """Inside ``with torch.device("meta")`` (or after torch.set_default_device("meta")), on a
    thread whose first calls these are, drawn and keyed calls on CPU tensors (forward and
    backward) give the CPU outputs, gradients and generator states of the same calls outside it,
    bit for bit, as F.dropout does; so do the thread's later calls outside it."""
    x, bias, residual = torch.randn(6, 260), torch.randn(260), torch.randn(6, 260)
    grad = torch.randn(6, 260)
    seed = torch.tensor([-(2**62) - 7, 2**40, 5, 9])

    def calls(meta: bool) -> list[torch.Tensor]:
        torch.manual_seed(5)
        private = gen(9)
        leaves = [t.clone().requires_grad_() for t in (x, bias, residual)]
        keyed_leaf = x.clone().requires_grad_()
        context = torch.device("meta") if how == "device_context" else _default_device("meta")
        with context if meta else contextlib.nullcontext():
            outs = [
                dropout(x, 0.3, impl=impl),
                bias_dropout_add(
                    *leaves, 0.3, shard=Region((12, 260), (3, 0)), generator=private, impl=impl
                ),
                dropout(keyed_leaf, 0.3, seed=seed, impl=impl),
            ]
            outs[1].backward(grad)
            outs[2].backward(grad)
        states = [torch.get_rng_state(), private.get_state()]
        later = [dropout(x, 0.3, impl=impl), dropout(x, 0.3, generator=private, impl=impl)]
        grads = [leaf.grad for leaf in (*leaves, keyed_leaf)]
        assert all(t.device.type == "cpu" for t in (*outs, *grads))
        states += [torch.get_rng_state(), private.get_state()]
        return [_bits(t) for t in (*outs, *grads, *later)] + states

    expected, got = _on_a_new_thread(lambda: calls(False)), _on_a_new_thread(lambda: calls(True))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("keyed", [False, True], ids=["drawn", "keyed"])
def test_forward_mode_ad_carries_the_tangents_through_the_same_mask(impl, keyed):
    """Inside ``forward_ad.dual_level`` the tangent of ``residual + dropout(x + bias)`` is the
    tangents through the primal's own mask, ``dropout(tx + tbias) + tresidual`` (torch's
    F.dropout carries its tangent too); the primal is the call without tangents, and the
    generator moves by one draw, as for that call."""
    import torch.autograd.forward_ad as fwAD

    x, bias, residual = torch.randn(6, 8), torch.randn(8), torch.randn(6, 8)
    tx, tbias, tresidual = torch.randn(6, 8), torch.randn(8), torch.randn(6, 8)

    def randomness(generator: torch.Generator) -> dict:
        return {"seed": torch.tensor([5, 7, 0, 0])} if keyed else {"generator": generator}

    dual_gen, plain_gen = gen(), gen()
    with fwAD.dual_level():
        out = bias_dropout_add(
            fwAD.make_dual(x, tx),
            fwAD.make_dual(bias, tbias),
            fwAD.make_dual(residual, tresidual),
            0.3,
            impl=impl,
            **randomness(dual_gen),
        )
        primal, tangent = fwAD.unpack_dual(out)
        alone = fwAD.unpack_dual(
            dropout(fwAD.make_dual(x, tx), 0.3, impl=impl, seed=torch.tensor([5, 7, 0, 0]))
        )
    assert torch.equal(
        primal, bias_dropout_add(x, bias, residual, 0.3, impl=impl, **randomness(plain_gen))
    )
    same_mask = dropout(tx + tbias, 0.3, impl=impl, **randomness(gen()))
    assert torch.equal(tangent, same_mask + tresidual)
    assert torch.equal(alone.tangent, dropout(tx, 0.3, impl=impl, seed=torch.tensor([5, 7, 0, 0])))
    assert torch.equal(dual_gen.get_state(), plain_gen.get_state())


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(
    ("x_dtype", "bias_dtype", "residual_dtype", "computed_in"),
    [
        (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32),  # fp32 residual stream
        (torch.float16, None, torch.float32, torch.float32),
        (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float32, torch.float32),  # x + bias promotes
        (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32),
    ],
    ids=str,
)
def test_bias_dropout_add_takes_megatrons_dtypes(
    impl, training, x_dtype, bias_dtype, residual_dtype, computed_in
):
    """As megatron-core's bias-dropout-add: where x's dtype is not the residual's, x and bias are
    taken in the residual's; else x + bias promotes as in torch. The result is the call on the
    inputs cast to that dtype (bitwise, the same mask), and gradients reach each input in its
    own dtype."""
    x = torch.randn(6, 8).to(x_dtype).requires_grad_()
    bias = None if bias_dtype is None else torch.randn(8).to(bias_dtype).requires_grad_()
    residual = torch.randn(6, 8).to(residual_dtype).requires_grad_()
    out = bias_dropout_add(x, bias, residual, 0.3, training=training, generator=gen(), impl=impl)
    cast = [None if t is None else t.detach().to(computed_in) for t in (x, bias, residual)]
    want = bias_dropout_add(*cast, 0.3, training=training, generator=gen(), impl=impl)
    assert out.dtype == computed_in and torch.equal(out, want)
    out.sum().backward()
    for t in (x, bias, residual):
        assert t is None or (t.grad is not None and t.grad.dtype == t.dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("impl", ["torch", "cpu", "auto"])
def test_vmap_over_a_table_of_seeds_gives_each_sample_its_own_keyed_mask(impl):
    """torch.func.vmap over x and a (B, 4) seed table: sample i is the call on x[i] with seeds[i]
    (bitwise), so the samples' masks differ, as under randomness='different', deterministically.
    A drawn call keeps vmap's randomness rules: 'error' refuses, 'same' gives every sample one
    mask."""
    x = torch.randn(3, 64)
    seeds = torch.tensor([[11, 0, 0, 0], [12, 0, 0, 0], [13, 0, 0, 0]])
    out = torch.func.vmap(lambda t, s: dropout(t, 0.5, seed=s, impl=impl))(x, seeds)
    for i in range(3):
        assert torch.equal(out[i], dropout(x[i], 0.5, seed=seeds[i], impl=impl))
    assert not torch.equal(out[0] != 0, out[1] != 0)
    ones = torch.ones(3, 64)
    with pytest.raises(RuntimeError, match="randomness error mode"):
        torch.func.vmap(lambda t: dropout(t, 0.5, impl=impl))(ones)
    same = torch.func.vmap(lambda t: dropout(t, 0.5, impl=impl), randomness="same")(ones)
    assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_vmap_with_different_randomness_draws_a_key_per_sample(impl):
    """Under vmap(randomness='different') a drawn call draws its key as a batched random op, so
    sample i gets the keyed mask of the i-th key that draw gives: the samples' masks differ, a
    second run from the same generator state repeats them, and the gradient is each sample's
    own mask (docs/compile.md said it raised)."""
    x = torch.ones(4, 64, requires_grad=True)

    def drop(t: torch.Tensor) -> torch.Tensor:
        return dropout(t, 0.5, impl=impl)

    torch.manual_seed(0)
    out = torch.func.vmap(drop, randomness="different")(x)
    out.sum().backward()
    assert torch.equal(x.grad, (out != 0).float() * 2)
    assert len({tuple((row != 0).tolist()) for row in out}) == 4
    torch.manual_seed(0)
    keys = torch.func.vmap(
        lambda t: torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64),
        randomness="different",
    )(x.detach())
    for i in range(4):
        seed = torch.cat((keys[i], torch.zeros(3, dtype=torch.int64)))
        assert torch.equal(out[i], dropout(torch.ones(64), 0.5, seed=seed, impl=impl))


def test_bias_dropout_add_takes_training_fifth_by_position_as_megatron_lm_does():
    """Megatron-LM's and ColossalAI's bias_dropout_add(x, bias, residual, prob, training) call
    shape failed (training was keyword-only); it now runs and means what the keyword means, for
    the kernel and its DTensor form alike."""
    import inspect

    from rng_tracker.parallel import dtensor

    x, bias, residual = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    assert torch.equal(bias_dropout_add(x, bias, residual, 0.5, False), residual + (x + bias))
    drawn = [
        bias_dropout_add(x, bias, residual, 0.5, *flag, generator=torch.Generator().manual_seed(3))
        for flag in ((True,), ())
    ]
    keyword = bias_dropout_add(
        x, bias, residual, 0.5, training=True, generator=torch.Generator().manual_seed(3)
    )
    assert all(torch.equal(d.view(torch.int32), keyword.view(torch.int32)) for d in drawn)
    assert not torch.equal(keyword, residual + (x + bias))  # it dropped
    for function in (bias_dropout_add, dtensor.bias_dropout_add):
        training = inspect.signature(function).parameters["training"]
        assert training.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and training.default is True
        assert list(inspect.signature(function).parameters).index("training") == 4


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_dropout_takes_torch_dropouts_call_shape_training_third_and_inplace_fourth(impl):
    """``F.dropout(x, p, training, inplace)`` failed with the kernel (training was keyword-only,
    inplace unknown). Now training means by position what it means by keyword, and inplace=True
    writes the out-of-place result into x bit for bit and returns x, as torch's does."""
    import inspect

    from rng_tracker.parallel import dtensor

    x = torch.randn(6, 10)
    assert dropout(x, 0.5, False, impl=impl) is x and dropout(x, 0.5, False, True) is x
    keyword = dropout(x, 0.5, training=True, generator=gen(), impl=impl)
    assert torch.equal(dropout(x, 0.5, True, generator=gen(), impl=impl), keyword)
    assert not torch.equal(keyword, x)  # it dropped

    target = x.clone()
    version = target._version
    written = dropout(target, 0.5, True, True, generator=gen(), impl=impl)
    assert written is target and target._version > version
    assert torch.equal(target.view(torch.int32), keyword.view(torch.int32))

    # through autograd as torch's in-place dropout: the gradient is the out-of-place one
    grads = []
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        hidden = leaf * 2.0
        out = dropout(hidden, 0.5, True, inplace, generator=gen(), impl=impl)
        assert (out is hidden) is inplace
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        grads.append(leaf.grad)
    assert torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))

    for function, names in (
        (dropout, ["x", "p", "training", "inplace"]),
        (dtensor.dropout, ["x", "p", "training", "inplace"]),
    ):
        parameters = inspect.signature(function).parameters
        positional = [
            name
            for name, parameter in parameters.items()
            if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        assert positional == names and parameters["training"].default is True


def _bytes_allocated(function: Callable[[], object]) -> int:
    """The bytes of the tensors torch allocates on the CPU while ``function`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_inplace_dropout_writes_x_itself_where_the_kernel_is_called_straight(impl):
    """In-place dropout made the out-of-place output and copied it into x, so its peak held x
    twice. Where the kernel is called straight (eager, contiguous x) it now writes x itself: no
    tensor is allocated, with and without autograd recording, and the bits and the gradient are
    the out-of-place call's. Under a dispatch mode the op runs and its output is copied in."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shape = (64, 1024) if impl == "cpu" else (8, 64)  # the Triton interpreter is slow
    x = torch.randn(shape)
    want = dropout(x, 0.3, generator=gen(), impl=impl)
    out_of_place = x.clone().requires_grad_()
    dropout(out_of_place * 1.0, 0.3, generator=gen(), impl=impl).backward(torch.ones(shape))
    for grad in (False, True):
        leaf = x.clone().requires_grad_(grad)
        target = leaf * 1.0 if grad else leaf
        written = []
        made = _bytes_allocated(
            lambda t=target, into=written: into.append(
                dropout(t, 0.3, True, True, generator=gen(), impl=impl)
            )
        )
        assert made == 0 and written[0] is target
        assert torch.equal(target.detach().view(torch.int32), want.view(torch.int32))
        if grad:
            target.backward(torch.ones(shape))
            assert torch.equal(leaf.grad.view(torch.int32), out_of_place.grad.view(torch.int32))

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    target = x.clone()
    with Passing():
        made = _bytes_allocated(
            lambda: dropout(target, 0.3, True, True, generator=gen(), impl=impl)
        )
    assert made >= x.nbytes
    assert torch.equal(target.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize(
    "view",
    [lambda h: h[1:], lambda h: h[:, 1:], lambda h: h.view(-1)],
    ids=["rows", "cols", "flat"],
)
def test_inplace_dropout_on_a_view_has_the_gradient_of_the_result_copied_into_the_view(view):
    """A view of a tensor autograd records: the kernel writes the view (contiguous rows, a
    flat view) or its output is copied in (columns); either way the base's gradient is that of
    the out-of-place result copied into the view."""
    grads = []
    for inplace in (True, False):
        leaf = torch.randn(6, 10, generator=gen(3)).requires_grad_()
        hidden = leaf * 3.0
        if inplace:
            dropout(view(hidden), 0.4, True, True, generator=gen())
            result = hidden
        else:
            result = hidden.clone()
            view(result).copy_(dropout(view(hidden), 0.4, generator=gen()))
        result.pow(2).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))


def test_dropout_defaults_are_torch_dropouts():
    """``F.dropout(x)`` drops with p = 0.5; the kernel and its DTensor form refused a call without
    p. Every argument they share with torch's now has torch's default, and ``dropout(x)`` is
    ``dropout(x, 0.5)`` bit for bit."""
    import inspect

    from rng_tracker.parallel import dtensor

    _, *shared = inspect.signature(F.dropout).parameters.values()  # after the tensor
    assert [p.name for p in shared] == ["p", "training", "inplace"]
    for function in (dropout, dtensor.dropout):
        ours = inspect.signature(function).parameters
        assert [ours[p.name].default for p in shared] == [p.default for p in shared]
    x = torch.randn(6, 10)
    assert torch.equal(dropout(x, generator=gen()), dropout(x, 0.5, generator=gen()))


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(4, 4)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: torch.ones(4, 4, requires_grad=True), "leaf tensor that requires grad"),
        (lambda: torch.ones(4, 4, requires_grad=True)[1:], "view of a leaf"),
        (lambda: torch.ones(4, 1).expand(4, 4), "share memory"),
        (_inference_tensor, "inference tensor"),
    ],
    ids=["leaf", "view_of_leaf", "expanded", "inference"],
)
@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_inplace_dropout_refuses_what_torch_cannot_write_before_drawing(make, words, impl):
    """torch's F.dropout(inplace=True) draws its mask and only then fails on these tensors, its
    generator advanced; ours refuses first, every generator as it was."""
    from rng_tracker.errors import KernelInPlaceError

    x = make()
    before = torch.get_rng_state()
    with pytest.raises(KernelInPlaceError, match=words) as info:
        dropout(x, 0.5, True, True, impl=impl)
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, RuntimeError)
    assert "inplace=False" in str(info.value)
    assert torch.equal(torch.get_rng_state(), before)
    # what would draw nothing answers as torch's does: x itself, unchecked
    assert dropout(x, 0.5, False, True, impl=impl) is x and dropout(x, 0.0, True, True) is x


def test_inplace_dropout_writes_a_leaf_that_requires_grad_under_no_grad_as_torch_does():
    leaf = torch.ones(4, 4, requires_grad=True)
    with torch.no_grad():
        out = dropout(leaf, 0.5, True, True, generator=gen())
    assert out is leaf and torch.equal(leaf, dropout(torch.ones(4, 4), 0.5, generator=gen()))


def test_inplace_flag_that_is_not_a_bool_is_typed_and_draws_nothing():
    before = torch.get_rng_state()
    with pytest.raises(KernelInputTypeError, match="inplace"):
        dropout(torch.ones(4), 0.5, True, "yes")
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_a_tensor_of_no_elements_draws_nothing_as_torchs_dropout_but_an_empty_shard_does(impl):
    """torch's dropout returns a tensor of no elements itself and draws nothing (measured here);
    ours drew a seed, so the generator moved. Now it does as torch. An empty shard of a logical
    tensor that has elements still draws what every other rank draws: the ranks stay in step."""
    empty, residual, bias = torch.empty(0, 4), torch.empty(0, 4), torch.ones(4)
    before = torch.get_rng_state()
    assert F.dropout(empty, 0.5) is empty and torch.equal(torch.get_rng_state(), before)
    assert dropout(empty, 0.5, impl=impl) is empty
    assert dropout(empty, 0.5, True, True, impl=impl) is empty
    assert torch.equal(bias_dropout_add(empty, bias, residual, 0.5, impl=impl), residual)
    assert torch.equal(torch.get_rng_state(), before)

    g_empty, g_full = gen(), gen()
    dropout(empty, 0.5, shard=Region(global_shape=(2, 4), offset=(2, 0)), generator=g_empty)
    dropout(torch.ones(2, 4), 0.5, generator=g_full, impl=impl)
    assert torch.equal(g_empty.get_state(), g_full.get_state())
    assert not torch.equal(g_empty.get_state(), gen().get_state())
