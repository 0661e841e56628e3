"""Keyed init: parameter values that are a pure function of (seed, name, global element index).

Element g of the parameter called ``name`` takes word g % 4 of Philox4x32-10 under the key of
``seed`` at counter (lo32(g // 4), hi32(g // 4), lo32(h), hi32(h)), h a 64-bit hash of the
name; ``uniform`` maps the word to [a, b), ``normal`` pairs words by Box-Muller, ``truncated
normal`` maps it through the inverse normal CDF restricted to [a, b] (see ``keyed_fill.c``).
Nothing is read from or written to a generator, so a rank computes exactly its local shard: no
full-size buffer, work in proportion to the shard, and the same values for any mesh, placement,
pipeline split, meta-device materialisation or construction order.

These are *not* torch's values (torch's draws depend on the whole tensor's size and order):
``invariant_random(init="full")`` keeps those. The compiled C kernel is built once with the
system C compiler (like the CPU dropout kernel); without one, keyed init raises
:class:`KernelUnavailableError` (the full-tensor mode needs no compiler).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import numbers
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rng_tracker._bits import MASK64, mix_key
from rng_tracker._torch_private import disable_current_dispatch_modes, holds_no_data
from rng_tracker._validate import checked_int
from rng_tracker.errors import KernelInputError, KernelInputTypeError, KernelUnavailableError
from rng_tracker.kernels._c_build import (
    FLAGS,
    ISA,
    CSource,
    load_once,
    unsupported_isa,
)
from rng_tracker.kernels._c_build import isa_paths as isa_paths_of

_SOURCE = CSource(
    "keyed_fill.c",
    (*FLAGS, "-O3", "-fno-math-errno"),
    libraries=("-lm",),
    abi_function="rt_keyed_abi_version",
    abi_version=4,  # RT_KEYED_ABI of keyed_fill.c
    maps_fresh_pages=True,
)
_INIT_DOMAIN = 0x6B65796564494E49  # b"keyedINI": keyed init never shares a key with keyed dropout
_UNIFORM, _NORMAL, _TRUNCATED_NORMAL = 0, 1, 2
_FLOAT32 = torch.finfo(torch.float32)
_lock = threading.Lock()
MAX_DIMS = 64  # RT_MAX_DIMS of keyed_fill.c: the dims of a tensor it fills
# "isa": the instruction-set path (ISA_CODES; 0 picks the fastest), from RNG_TRACKER_CPU_ISA
_state: dict[str, object] = {"library": None, "failed": None, "isa": ISA}


def init_key(seed: int) -> int:
    """The 64-bit Philox key of ``seed`` for init (a bijection, in its own domain)."""
    seed = checked_int(
        seed,
        "seed",
        type_error=KernelInputTypeError,
        value_error=KernelInputError,
        minimum=0,
        maximum=MASK64,
    )
    return mix_key(seed, _INIT_DOMAIN)


def name_hash(name: str) -> int:
    """The 64-bit hash of a parameter's stable name (BLAKE2b of its UTF-8 bytes)."""
    if not isinstance(name, str):
        raise KernelInputTypeError(f"name must be a non-empty str, got {name!r}")
    if not name:  # a str of the wrong value
        raise KernelInputError(
            "name must not be empty: keyed init keys a tensor's values by its stable name; pass "
            "the parameter's name"
        )
    try:
        data = name.encode("utf-8")
    except UnicodeEncodeError:
        raise KernelInputError(
            f"name {name!r} holds a lone surrogate, which UTF-8 cannot encode, so it has no "
            "stable bytes to key by; name the tensor with text UTF-8 encodes"
        ) from None
    digest = hashlib.blake2b(data, digest_size=8, person=b"rng_tracker.init")
    return int.from_bytes(digest.digest(), "little")


def _load() -> ctypes.CDLL:
    library = _SOURCE.load()
    library.rt_keyed_fill.restype = ctypes.c_int64
    library.rt_keyed_fill.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        *(ctypes.POINTER(ctypes.c_int64),) * 3,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int64,
    ]
    library.rt_keyed_isa_supported.restype = ctypes.c_int64
    library.rt_keyed_isa_supported.argtypes = [ctypes.c_int64]
    return library


def isa_paths() -> list[str]:
    """The instruction-set paths of the keyed fill this CPU runs, fastest last."""
    return isa_paths_of(_library().rt_keyed_isa_supported)


def _library() -> ctypes.CDLL:
    load_once(_state, _lock, _load)
    if _state["library"] is None:
        raise KernelUnavailableError(
            f"keyed init needs its compiled CPU kernel, which cannot be built here "
            f"({_state['failed']}); install a C compiler (cc, gcc or clang, or set CC), or use "
            "invariant_random(init='full')"
        )
    return _state["library"]  # type: ignore[return-value]


def _index_lists(
    shape: Sequence[int], global_shape: Sequence[int], indices: Sequence[Sequence[int]] | None
) -> list[Sequence[int]]:
    if indices is None:
        if tuple(shape) != tuple(global_shape):
            raise KernelInputError(
                f"a local tensor of shape {tuple(shape)} needs the global indices it holds "
                f"(indices=) in a tensor of shape {tuple(global_shape)}"
            )
        return [range(n) for n in global_shape]
    if len(indices) != len(global_shape) or [len(i) for i in indices] != list(shape):
        raise KernelInputError(
            f"indices must list, per dim, the {tuple(shape)} global indices the local tensor "
            f"holds; got lengths {[len(i) for i in indices]} for global shape {tuple(global_shape)}"
        )
    return list(indices)


def _index_array(lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """Every dim's global indices, one after another, as one int64 CPU tensor (at least one
    element, so its pointer is valid): built by torch, not element by element in Python, since
    a long dim (a flat 2**24-element parameter) has as many indices as elements. Real memory
    the kernel reads, under a caller's ``torch.device("meta")`` or fake tensors too."""
    cpu = torch.device("cpu")
    with disable_current_dispatch_modes():
        parts = [
            torch.arange(lst.start, lst.stop, lst.step, dtype=torch.int64, device=cpu)
            if isinstance(lst, range)
            else torch.as_tensor(lst, dtype=torch.int64, device=cpu).reshape(-1)
            for lst in lists
        ]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=cpu)
        return flat if flat.numel() else torch.zeros(1, dtype=torch.int64, device=cpu)


def real_number(value: object, what: str) -> float:
    """``value`` as a float where torch's init takes a number: a real number (a bool, an int, a
    float, a numpy scalar) or a 0-dim real tensor."""
    if isinstance(value, numbers.Real) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex()
    ):
        return float(value)
    raise KernelInputTypeError(
        f"{what} must be a real number, got {type(value).__name__} {value!r}"
    )


def _check_random_dtype(op: str, dtype: torch.dtype) -> None:
    if not (dtype.is_floating_point or dtype.is_complex):
        raise KernelInputTypeError(f"{op} fills floating-point or complex tensors, got {dtype}")


def check_uniform(a: object, b: object, dtype: torch.dtype) -> None:
    """Refuse what torch's ``uniform_(a, b)`` refuses on a ``dtype`` tensor: bounds that are not
    real numbers, not finite, outside the dtype's range, ``a > b``, or ``b - a`` past its max."""
    _check_random_dtype("uniform_", dtype)
    low, high = real_number(a, "a"), real_number(b, "b")
    limit = torch.finfo(dtype).max
    if not -limit <= low <= high <= limit or high - low > limit:
        raise KernelInputError(
            f"uniform_ needs finite bounds a <= b with a, b and b - a within +-{limit:.6g} (the "
            f"range of {dtype}), as torch requires; got a={low}, b={high}"
        )


def check_normal(mean: object, std: object, dtype: torch.dtype) -> None:
    """Refuse what torch's ``normal_(mean, std)`` refuses on a ``dtype`` tensor: numbers that are
    not real, or ``std`` not >= 0 (NaN included); an infinite mean or std torch allows."""
    _check_random_dtype("normal_", dtype)
    real_number(mean, "mean")
    if not real_number(std, "std") >= 0.0:
        raise KernelInputError(f"normal_ needs std >= 0, as torch requires; got std={std}")


def check_trunc_normal(mean: object, std: object, a: object, b: object) -> None:
    """Refuse a keyed truncated normal's parameters: not real numbers, or not a finite mean,
    ``std > 0`` and ``a < b``."""
    names = ("mean", "std", "a", "b")
    m, s, low, high = (real_number(v, n) for v, n in zip((mean, std, a, b), names, strict=True))
    if not (math.isfinite(m) and math.isfinite(s) and s > 0 and low < high):
        raise KernelInputError(
            f"a truncated normal needs a finite mean, std > 0 and a < b; got mean={mean}, "
            f"std={std}, a={a}, b={b}"
        )


def _keyed_limit(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose range bounds a keyed fill of ``dtype``: its own, or float32's where
    wider, since the kernel computes in float32."""
    return dtype if torch.finfo(dtype).max <= _FLOAT32.max else torch.float32


def check_fill(
    kind: str, dtype: torch.dtype, dims: int, params: Sequence[object]
) -> tuple[float, ...]:
    """``params`` as Python floats, once checked: raise what a keyed fill of ``kind``
    ("uniform", "normal" or "trunc_normal") refuses for a ``dims``-dim tensor of ``dtype`` with
    ``params``, before anything is named or written. A 0-dim tensor bound gives the bits its
    float gives (float32 tensor arithmetic would not)."""
    if not dtype.is_floating_point:
        raise KernelInputTypeError(f"keyed init fills floating tensors, got {dtype}")
    if dims > MAX_DIMS:
        raise KernelInputError(
            f"keyed init takes tensors of at most {MAX_DIMS} dims, got {dims}; reshape or fill "
            "a flat view"
        )
    if kind == "uniform":
        check_uniform(*params, _keyed_limit(dtype))
    elif kind == "normal":
        check_normal(*params, dtype)
    else:
        check_trunc_normal(*params)
    return tuple(float(v) for v in params)  # type: ignore[arg-type]


def _checked_params(local: object, kind: str, params: Sequence[object]) -> tuple[float, ...]:
    """``params`` as :func:`check_fill` returns them, once ``local`` is a CPU tensor."""
    if not isinstance(local, torch.Tensor) or local.device.type != "cpu":
        raise KernelInputError(
            "keyed init runs on CPU tensors (materialise on CPU, then move); got "
            f"{type(local).__name__} on {getattr(local, 'device', None)}"
        )
    return check_fill(kind, local.dtype, local.dim(), params)


@torch.no_grad()
def _fill(
    local: torch.Tensor,
    kind: int,
    params: Sequence[float],
    *,
    seed: int,
    name: str,
    global_shape: Sequence[int] | None = None,
    indices: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Write the keyed values of ``kind`` into ``local`` (in place, outside autograd).

    The values of parameter ``name`` under ``seed``; ``local`` holds the elements ``indices``
    (per dim, the global indices it holds; None: all) of a ``global_shape`` tensor (None:
    local's own shape). The public fills take these four keywords as ``**target``.
    """
    if holds_no_data(local):  # no memory behind data_ptr() for the kernel to write
        return local
    global_shape = tuple(local.shape) if global_shape is None else tuple(global_shape)
    lists = _index_lists(local.shape, global_shape, indices)
    library = _library()
    key, hashed = init_key(seed), name_hash(name)
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    flat = _index_array(lists)
    c_sizes = (ctypes.c_int64 * max(1, len(lists)))(*[len(lst) for lst in lists])
    c_index = ctypes.cast(flat.data_ptr(), ctypes.POINTER(ctypes.c_int64))
    c_strides = (ctypes.c_int64 * max(1, len(strides)))(*strides)
    direct = local.dtype == torch.float32 and local.is_contiguous()
    out = local if direct else torch.empty(local.shape, dtype=torch.float32, device=local.device)
    c_params = (ctypes.c_float * 8)(*params, *[0.0] * (8 - len(params)))
    status = library.rt_keyed_fill(
        out.data_ptr(),
        len(lists),
        c_sizes,
        c_index,
        c_strides,
        key,
        hashed,
        kind,
        c_params,
        _state["isa"],
    )
    if status == -2:
        raise unsupported_isa("the keyed fill", _state["isa"], library.rt_keyed_isa_supported)
    if status != 0:
        raise KernelInputError(
            f"keyed init takes tensors of at most {MAX_DIMS} dims, got {len(lists)}; reshape "
            "or fill a flat view"
        )
    if not direct:
        local.copy_(out)
    return local


def fill_checked(
    local: torch.Tensor, kind: str, values: Sequence[float], **target: Any
) -> torch.Tensor:
    """Fill the CPU tensor ``local`` with the keyed values of ``kind`` for ``values``, the
    floats :func:`check_fill` returned (nothing is checked again); ``target``: seed, name,
    global_shape, indices, as the public fills take them."""
    if kind == "uniform":
        a, b = values
        return _fill(local, _UNIFORM, (b - a, a), **target)
    if kind == "normal":
        mean, std = values
        return _fill(local, _NORMAL, (std, mean), **target)
    mean, std, a, b = values
    lo, hi = _normal_cdf((a - mean) / std), _normal_cdf((b - mean) / std)
    return _fill(local, _TRUNCATED_NORMAL, (0.0, 0.0, lo, hi - lo, mean, std, a, b), **target)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def keyed_uniform_(
    local: torch.Tensor, a: float = 0.0, b: float = 1.0, **target: Any
) -> torch.Tensor:
    """Fill ``local`` from U[a, b), keyed (``target``: seed, name, global_shape, indices).

    Value of global element g: ``u * float32(b - a) + float32(a)``, u = (word >> 8) * 2**-24.
    """
    return fill_checked(local, "uniform", _checked_params(local, "uniform", (a, b)), **target)


def keyed_normal_(
    local: torch.Tensor, mean: float = 0.0, std: float = 1.0, **target: Any
) -> torch.Tensor:
    """Fill ``local`` from N(mean, std²), keyed (Box-Muller of the element's Philox words)."""
    return fill_checked(local, "normal", _checked_params(local, "normal", (mean, std)), **target)


def keyed_trunc_normal_(
    local: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    **target: Any,
) -> torch.Tensor:
    """Fill ``local`` from N(mean, std²) truncated to [a, b], keyed, by inverse-CDF sampling.

    One draw per element (no rejection loop), so no rank ever needs another's answer: the cost
    is the shard's, whatever the index map. ``std`` must be positive and ``a < b``.
    """
    values = _checked_params(local, "trunc_normal", (mean, std, a, b))
    return fill_checked(local, "trunc_normal", values, **target)
