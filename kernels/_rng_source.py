"""The seed words of one dropout call, drawn from a torch generator.

CUDA generators: key = the seed, counter base = philox offset // 4, and the offset
advances by 4 * ceil(N / 4) for the logical element count N, so no later torch op
reuses these counters. Other generators: key = one 64-bit draw, base = 0. A call's seed is
the four int64 words [key, base, c2, c3], c2 = c3 = 0 here: Python ints for the eager CPU
kernel (:func:`draw_words`), an int64 tensor for the registered ops (:func:`draw_seed`).
With p == 1 nothing is kept, so nothing is drawn: the generator stays put.
"""

from __future__ import annotations

import threading

import torch

from rng_tracker._bits import MASK64, signed64
from rng_tracker._device_rng import default_generator
from rng_tracker._torch_private import graph_tracing_active, vmap_may_be_active
from rng_tracker._validate import checked_instance
from rng_tracker.errors import KernelInputError, KernelInputTypeError, KernelUnavailableError

Words = tuple[int, int, int, int]  # [key, base, c2, c3] as int64 values


def advanced_offset(offset: int, logical_numel: int) -> int:
    """A CUDA generator's Philox offset after a call over ``logical_numel`` elements.

    Refuses (:class:`KernelInputError`, the generator untouched) an advance past 2**64 - 1:
    the offset would wrap and later calls would reuse earlier counters, so earlier masks.
    """
    advanced = offset + 4 * (-(-logical_numel // 4))
    if advanced > MASK64:  # a CUDA generator's Philox offset is a uint64
        raise KernelInputError(
            f"the generator's Philox offset {offset} cannot advance by {advanced - offset} for "
            f"{logical_numel} logical elements: it would pass 2**64 - 1 and wrap, reusing "
            "earlier masks' counters; reseed the generator (generator.manual_seed(...))"
        )
    return advanced


_SCRATCH = threading.local()  # per thread: a 0-dim int64 CPU tensor the eager draws reuse


def _drawn(
    generator: torch.Generator, logical_numel: int, scratch: torch.Tensor | None = None
) -> Words:
    """Consume the generator's randomness for one call over ``logical_numel`` elements
    (``scratch``: a CPU generator's reusable tensor to draw into)."""
    device = generator.device
    if device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(advanced_offset(offset, logical_numel))
        return signed64(generator.initial_seed()), offset // 4, 0, 0
    if scratch is None or device.type != "cpu":  # on the generator's device, not the default one
        scratch = torch.empty((), dtype=torch.int64, device=device)
    return _host_draw(generator, scratch)


def _host_draw(generator: torch.Generator, scratch: torch.Tensor) -> Words:
    """A non-CUDA generator's words: key = one 64-bit draw (into ``scratch``), base = 0."""
    scratch.random_(-(2**63), 2**63 - 1, generator=generator)
    return int(scratch), 0, 0, 0


def _generator(x: torch.Tensor, generator: object) -> torch.Generator:
    """``generator``, or the default generator of x's device where it is None."""
    if generator is None:
        return torch.default_generator if x.device.type == "cpu" else default_generator(x.device)
    return check_generator(generator)


def check_generator(generator: object) -> torch.Generator:
    """``generator`` if it is a ``torch.Generator``, else :class:`KernelInputTypeError`."""
    return checked_instance(
        generator,
        torch.Generator,
        "generator must be a torch.Generator",
        error=KernelInputTypeError,
    )


def draw_words(x: torch.Tensor, p: float, logical_numel: int, generator: object) -> Words:
    """The seed words of one eager call on x, from ``generator`` (or x's device's), with no
    tensor made (eager callers outside any trace or dispatch mode only: a CPU draw reuses a
    per-thread scratch tensor)."""
    if p == 1.0:
        return 0, 0, 0, 0
    scratch = getattr(_SCRATCH, "tensor", None)
    if scratch is None:
        # a normal tensor even if this thread's first draw runs under inference mode: an
        # inference tensor cannot be written outside it
        with torch.inference_mode(False):
            scratch = _SCRATCH.tensor = torch.empty((), dtype=torch.int64, device="cpu")
    if generator is None and x.is_cpu:  # the CPU's default generator, without a device lookup
        return _host_draw(torch.default_generator, scratch)
    return _drawn(_generator(x, generator), logical_numel, scratch)


def draw_fresh_words(x: torch.Tensor, p: float, logical_numel: int, generator: object) -> Words:
    """:func:`draw_words` for an eager call under a dispatch mode of the user's: the draw runs on
    a tensor made for it (the mode sees it, as it sees the draw of an op's seed), never on the
    thread's scratch tensor."""
    refuse_capture(x)
    if p == 1.0:
        return 0, 0, 0, 0
    return _drawn(_generator(x, generator), logical_numel)


def seed_tensor(words: Words, device: torch.device) -> torch.Tensor:
    """``words`` as an int64 tensor on ``device``: an op argument, never a constant baked into a
    graph."""
    return torch.tensor(words, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


def refuse_capture(x: torch.Tensor) -> None:
    """Refuse a drawn seed while a CUDA graph captures: every replay would reuse its mask."""
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise KernelUnavailableError(
            "fused dropout cannot be captured in a CUDA graph: its Philox key and counter base "
            "are read from the generator on the host, so every replay would reuse the captured "
            "mask; call it outside the capture, or pass seed= (a device tensor, whose words "
            "each replay reads as they are then)"
        )


def refuse_untraced_draw(source: torch.Tensor | torch.Generator) -> None:
    """Refuse a drawn seed where a traced program would not draw it anew on every run: under
    torch.export's strict mode (Dynamo cannot trace a draw from a generator), and from a CUDA
    generator under an export or make_fx trace (its key and counter base are read on the host:
    the graph would keep them as constants, one mask for every run). torch.compile draws
    outside its graph (:func:`drawn_seed`), and fake tensors alone trace nothing."""
    if torch.compiler.is_dynamo_compiling():
        strict_export = torch.compiler.is_exporting()
        if not strict_export:
            return
    else:
        strict_export = False
        if source.device.type != "cuda" or not (
            torch.compiler.is_exporting() or graph_tracing_active()
        ):
            return
    where = "torch.export with strict=True" if strict_export else "a trace of a CUDA generator"
    raise KernelUnavailableError(
        f"fused dropout cannot draw its seed inside {where}: the traced program would not draw "
        "a fresh mask on each run. Pass seed= (an int64 tensor [key, base, c2, c3], as an input "
        "of the traced function) or trace in eval mode (training=False)"
        + ("; or export with strict=False, which records the draw" if strict_export else "")
    )


def draw_seed(
    x: torch.Tensor, p: float, logical_numel: int, generator: object, device: torch.device
) -> torch.Tensor:
    """:func:`draw_words`'s words as a seed tensor on ``device``, for the registered ops."""
    refuse_capture(x)
    if p == 1.0:
        return torch.zeros(4, dtype=torch.int64, device=device)
    source = _generator(x, generator)
    refuse_untraced_draw(source)
    return drawn_seed(source, generator is None, logical_numel, device)


@torch.compiler.disable(
    reason="a dropout that draws from a torch.Generator reads and advances host state; "
    "with seed= (a keyed seed tensor) the call compiles whole"
)
def drawn_seed(
    generator: torch.Generator, is_default: bool, logical_numel: int, device: torch.device
) -> torch.Tensor:
    """The draw and its seed tensor as one step that torch.compile does not trace: the key never
    becomes a traced Python int (a 64-bit constant Inductor cannot print, and a value guard that
    would recompile every step), the seed enters the graph as a tensor.

    A non-CUDA generator's key (a CUDA one's too under vmap, which must see a random op to
    apply its randomness rules) stays a tensor, never read on the host: under fake tensors the
    call is shape-only and leaves the generator as it was, and a trace (make_fx, torch.export)
    records the draw itself, so each run of the traced program draws anew: from the device's
    default generator of the time it runs where ``is_default`` (none was passed; a trace that
    named this object would keep a copy of it, which torch.manual_seed no longer reaches once
    the program is saved and loaded), else from ``generator``."""
    if generator.device.type == "cuda" and not vmap_may_be_active():
        return seed_tensor(_drawn(generator, logical_numel), device)
    # the same draw as _host_draw's random_ (randint runs it), which FX can print; also a CUDA
    # generator's under vmap, which must see a random op to apply its randomness rules
    key = torch.randint(
        -(2**63),
        2**63 - 1,
        (1,),
        generator=None if is_default else generator,
        dtype=torch.int64,
        device=generator.device,
    )
    return torch.cat((key.to(device), torch.zeros(3, dtype=torch.int64, device=device)))
