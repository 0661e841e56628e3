"""Build, cache and load a kernel's C source: the one copy shared by the CPU dropout kernel
(``_cpu_kernel``) and the keyed fill of init values (``_keyed_fill``).

A library is compiled once per machine with the system C compiler (``CC``, else cc, gcc or
clang), atomically (ranks may build at the same time), into the cache directory
(``RNG_TRACKER_CACHE_DIR``, else ``~/.cache/rng_tracker``, else the temp dir), under a name
hashed from every file it is built from (the .c file and the headers it includes), the flags
and the platform. The compiler is not part of the key: the library is plain C with a fixed
ABI, so one built elsewhere (a shared cache) loads here without a compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import os
import platform
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rng_tracker.errors import KernelInputError, KernelUnavailableError

# A C file's includes of the kernels' own headers (system headers use <...>).
_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)
# The instruction-set paths of the C kernels (cpu_isa.h's RT_ISA_*), slowest first: 0 lets a
# kernel pick the fastest this CPU runs; the others force one (tests compare every path bitwise).
ISA_CODES = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}


# The instruction-set path the C kernels run, read at import: unset or "auto" lets each pick
# the fastest this CPU runs; a name of ISA_CODES forces that path (e.g. "avx2" on a CPU that
# slows its clock for 512-bit code).
ISA_ENV = "RNG_TRACKER_CPU_ISA"


# Whether the C kernels ask for transparent huge pages on a new output's pages, read at import:
# unset or "1" asks (a fault per 2 MiB instead of per 4 KiB); "0" does not, for machines where
# a huge page's fault stalls (memory compaction, a VM's host backing it anew).
HUGE_PAGES_ENV = "RNG_TRACKER_CPU_HUGE_PAGES"


def huge_pages_from_environment() -> bool:
    """Whether :data:`HUGE_PAGES_ENV` lets the kernels ask for huge pages (True when unset);
    a value other than "0" or "1" is a :class:`~rng_tracker.errors.KernelInputError`."""
    value = os.environ.get(HUGE_PAGES_ENV, "1")
    if value not in ("0", "1"):
        raise KernelInputError(
            f"{HUGE_PAGES_ENV}={value!r}; set it to '1' (the default: a new output's pages are "
            "asked for as transparent huge pages) or '0' (they are not)"
        )
    return value == "1"


HUGE_PAGES = huge_pages_from_environment()


def isa_paths(supported: Callable[[int], int]) -> list[str]:
    """The instruction-set paths a kernel library runs on this CPU, fastest last, given its
    exported ``rt_*isa_supported`` function."""
    return [name for name, code in ISA_CODES.items() if code and supported(code)]


def isa_from_environment() -> int:
    """The code of the path :data:`ISA_ENV` names (0, auto, when unset); another name is a
    :class:`~rng_tracker.errors.KernelInputError`."""
    name = os.environ.get(ISA_ENV, "auto")
    if name not in ISA_CODES:
        raise KernelInputError(
            f"{ISA_ENV}={name!r}; set it to one of {', '.join(map(repr, ISA_CODES))} ('auto', "
            "the default, picks the fastest path this CPU runs)"
        )
    return ISA_CODES[name]


ISA = isa_from_environment()


def unsupported_isa(
    what: str, code: int, supported: Callable[[int], int]
) -> KernelUnavailableError:
    """The error of ``what`` (a kernel) forced onto the path ``code``, which this CPU does not
    run (``supported``: the library's ``rt_*isa_supported``)."""
    name = next((n for n, c in ISA_CODES.items() if c == code), str(code))
    return KernelUnavailableError(
        f"{what} was forced onto the instruction-set path {name!r} ({ISA_ENV}), which this CPU "
        f"does not run; it runs {', '.join(map(repr, isa_paths(supported)))}: set {ISA_ENV} to "
        "one of those, or unset it to let the library pick the fastest"
    )


# What a failed build or load raises: the callers' fallback (a warning, or their own error).
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)
# The longest a compile may take (a few seconds here) before the callers fall back.
_BUILD_SECONDS = 300
# The flags every kernel library compiles with (a library may add its own after them).
FLAGS = (
    # -O2 plus the vectoriser: as fast here as -O3, and builds in a third of the time.
    "-O2",
    "-ftree-vectorize",
    "-std=c11",
    "-shared",
    "-fPIC",
    "-pthread",
    # Bit-exactness: no fused multiply-add, no reassociation or other unsafe math.
    "-ffp-contract=off",
    "-fno-fast-math",
)


def _read(name: str) -> bytes:
    return importlib.resources.files("rng_tracker.kernels").joinpath(name).read_bytes()


def source_files(source: str, read: Callable[[str], bytes]) -> dict[str, bytes]:
    """``source`` and every header it includes (``#include "..."``, directly or through another
    header), by name, as ``read`` gives them: what is copied next to the source to compile it,
    and what its library's cache key hashes."""
    files: dict[str, bytes] = {}
    pending = [source]
    while pending:
        name = pending.pop()
        if name not in files:
            files[name] = read(name)
            pending += [included.decode() for included in _INCLUDE.findall(files[name])]
    return files


def _compiler() -> str:
    chosen = os.environ.get("CC")
    candidates = [chosen] if chosen else ["cc", "gcc", "clang"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        f"no C compiler found (looked for {', '.join(candidates)}"
        + (" from CC" if chosen else " on PATH")
        + ")"
    )


def _cache_dir() -> Path:
    explicit = os.environ.get("RNG_TRACKER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home_cache = Path(base) / "rng_tracker"
    try:
        home_cache.mkdir(parents=True, exist_ok=True)
        if os.access(home_cache, os.W_OK):
            return home_cache
    except OSError:
        pass
    # A read-only or missing home (some CI runners and containers): the temp dir, per user.
    user = getattr(os, "getuid", lambda: "user")()
    return _private(Path(tempfile.gettempdir()) / f"rng_tracker-{user}")


@functools.cache
def _own_dir() -> Path:
    """A cache directory of this process's own, made once where one is needed."""
    return Path(tempfile.mkdtemp(prefix="rng_tracker-"))


def _private(path: Path) -> Path:
    """``path``, made (mode 0700) or found owned by this user and writable by no one else; else
    a directory of this process's own. Anyone may create a predictable name in a shared temp
    dir first, and a library found there is loaded: code of theirs would run as this user."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # no users to tell apart (Windows): the temp dir is per user already
        return path
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        found = path.lstat()  # not a link's target: a link is someone else's choice of place
        if stat.S_ISDIR(found.st_mode) and found.st_uid == getuid() and not found.st_mode & 0o022:
            return path
    except OSError:
        pass
    return _own_dir()


# Where an ELF header keeps its section table, by class (1: 32-bit, 2: 64-bit): the format of
# e_shoff and its offset, and the offset of e_shentsize and e_shnum (two 16-bit words).
_SECTION_TABLE = {1: ("I", 32, 46), 2: ("Q", 40, 58)}


def _intact(path: Path) -> bool:
    """Whether ``path`` is as long as its ELF header says (the section headers end the file): a
    truncated library, e.g. a torn copy into a shared cache, would crash the loading process
    (SIGBUS on a page past its end) instead of failing. Off ELF systems (macOS) a file that is not
    empty is taken as it is."""
    with open(path, "rb") as file:
        header = file.read(64)
        size = os.fstat(file.fileno()).st_size
    if header[:4] != b"\x7fELF":  # no library where the system's libraries are ELF
        return header != b"" and not sys.platform.startswith(("linux", "freebsd"))
    if len(header) < 64 or header[4] not in _SECTION_TABLE:
        return False
    offset_format, at, sizes_at = _SECTION_TABLE[header[4]]
    order = "<" if header[5] == 1 else ">"
    (table,) = struct.unpack_from(order + offset_format, header, at)
    entry, count = struct.unpack_from(order + "HH", header, sizes_at)
    return table + entry * count <= size


@dataclass(frozen=True)
class CSource:
    """One kernel library: its C source in rng_tracker.kernels, how to compile it, its ABI."""

    source: str  # the .c file, e.g. "cpu_dropout.c"
    flags: tuple[str, ...]  # before the source on the command line
    libraries: tuple[str, ...]  # after the output, e.g. ("-lm",)
    abi_function: str  # the exported function that returns the ABI version
    abi_version: int
    # it maps new outputs with fresh_pages.h: told HUGE_PAGES once loaded (rt_set_huge_pages)
    maps_fresh_pages: bool = False

    def _files(self) -> dict[str, bytes]:
        return source_files(self.source, _read)

    def _command(self, source: Path, built: Path) -> list[str]:
        return [_compiler(), *self.flags, str(source), "-o", str(built), *self.libraries]

    def _path(self, files: dict[str, bytes]) -> Path:
        key = hashlib.sha256()
        for part in (
            *(name.encode() + b"\0" + text for name, text in files.items()),
            " ".join((*self.flags, *self.libraries)).encode(),
            f"{sys.platform}:{platform.machine()}".encode(),
        ):
            key.update(part)
            key.update(b"\0")
        return _cache_dir() / f"{Path(self.source).stem}-{key.hexdigest()[:20]}.so"

    def library_path(self) -> Path:
        """Where the library built from these files, flags and platform lives (or will)."""
        return self._path(self._files())

    def _build(self, target: Path, files: dict[str, bytes]) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            for name, text in files.items():
                (Path(scratch) / name).write_bytes(text)
            built = Path(scratch) / target.name
            result = subprocess.run(
                self._command(Path(scratch) / self.source, built),
                capture_output=True,
                text=True,
                timeout=_BUILD_SECONDS,  # a hung compiler: TimeoutExpired, the callers' fallback
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"compiling {self.source} failed: {result.stderr.strip()[-2000:]}"
                )
            os.replace(built, target)

    def load(self) -> ctypes.CDLL:
        """The library, built first where the cache lacks it; RuntimeError on another ABI."""
        files = self._files()  # read once: the key and the build see the same bytes
        path = self._path(files)
        if not path.exists() or not _intact(path):  # a broken file is built anew, replaced
            self._build(path, files)
        library = ctypes.CDLL(str(path))
        try:
            abi = getattr(library, self.abi_function)()
            if self.maps_fresh_pages:  # whether to ask for huge pages
                library.rt_set_huge_pages.argtypes = [ctypes.c_int64]
        except AttributeError as missing:
            raise RuntimeError(
                f"{path} is no kernel library of this rng_tracker ({missing}); delete it, and "
                "the next process builds it anew"
            ) from None
        if abi != self.abi_version:
            raise RuntimeError(
                f"{path} has ABI {abi}, expected {self.abi_version}; delete it, and the next "
                "process builds it anew"
            )
        if self.maps_fresh_pages:
            library.rt_set_huge_pages(int(HUGE_PAGES))
        return library


def load_once(
    state: dict[str, object], lock: threading.Lock, load: Callable[[], ctypes.CDLL]
) -> BaseException | None:
    """Run ``load`` once per process into ``state["library"]``, or record its failure in
    ``state["failed"]``; the failure is returned to the one call that met it (to warn once)."""
    if state["library"] is not None or state["failed"] is not None:
        return None
    with lock:
        if state["library"] is None and state["failed"] is None:
            try:
                state["library"] = load()
            except BUILD_ERRORS as error:
                state["failed"] = error
                return error
    return None
