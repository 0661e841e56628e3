"""Live CPU heap bytes (glibc mallinfo2) and a dispatch mode that tracks their peak.

torch's default CPU allocator hands memory straight to malloc and back, so the heap in
use follows the tensors alive; sampling it after every op gives the peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_mallinfo2 = getattr(_libc, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (small blocks + mmapped blocks)."""
    if _mallinfo2 is None:
        raise RuntimeError("glibc mallinfo2 is not available: memory figures need glibc >= 2.33")
    info = _mallinfo2()
    return info.uordblks + info.hblkhd


class PeakHeap(TorchDispatchMode):
    """Tracks the peak of :func:`heap_bytes` over the ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = heap_bytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_bytes())
        return out
