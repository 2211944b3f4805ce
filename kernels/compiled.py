"""C sources compiled for this CPU on first use and loaded with ctypes: the CPU kernels' shared build.

A family's ``cpu.py`` names its source and what the library is for; :func:`load` compiles it once per source,
flags and machine (``-march=native``: keyed by the CPU's feature flags) into ``$DMC_KERNELS_CACHE`` (default
``~/.cache/dmc_train/kernels``), written atomically, and loads it; a cached file that cannot be loaded (truncated,
emptied) is built again. Without a C compiler (or if the build fails, e.g. an unwritable cache) it returns None
and the family's PyTorch path runs instead, after one warning per process and cause (whichever family meets it
first). ``CC`` picks the compiler (default ``cc``).
No torch headers are needed: the sources are plain C (OpenMP for threads), and take tensors as pointers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

# -ffp-contract=off: products rounded before they are added, as PyTorch's elementwise ops (so that a kernel can
# reproduce them bit for bit: DMC's state, RoPE)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what ``-march=native`` compiles for), so a library built on another machine
    sharing the cache directory is never loaded here."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return os.uname().machine.encode()


def cache_dir() -> Path:
    return Path(os.environ.get("DMC_KERNELS_CACHE") or Path.home() / ".cache" / "dmc_train" / "kernels")


def _build(compiler: str, source: Path, target: Path) -> Optional[str]:
    """Compile ``source`` into ``target`` (atomically: a temporary file, then a rename); the compiler's first
    error line on failure, else None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
            return lines[0] if lines else f"exit status {result.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # what the sources include ("../cpu_math.h")
_warned: set[str] = set()  # the causes warned of in this process


def _warn_once(cause: str, message: str) -> None:
    """Warn ``message`` unless this process warned of ``cause`` already: a cause every kernel family meets (no
    compiler, an unwritable cache) is said once, by the first family that needs its library."""
    if cause not in _warned:
        _warned.add(cause)
        warnings.warn(message, stacklevel=4)


def find_compiler() -> Optional[str]:
    """The C compiler: ``CC``, else ``cc`` or ``gcc`` on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def warn_no_compiler() -> None:
    """Say, once per process, that the CPU kernels run their PyTorch paths for want of a compiler."""
    _warn_once("compiler", "no C compiler (cc) found: the CPU kernels run their PyTorch paths, slower; install gcc "
                           "or set CC to use the compiled kernels")


def load(source: Path, what: str, argtypes: Optional[dict[str, list]] = None) -> Optional[ctypes.CDLL]:
    """The library compiled from ``source`` (built on first use, rebuilt when the cached file cannot be loaded),
    its functions' ``argtypes`` (name -> ctypes types; each returns an int, ctypes' default) set, or None when it
    cannot be built here (``what``, e.g. "the CPU paged-attention kernel", names it in the warning; one warning
    per process and cause)."""
    compiler = find_compiler()
    if compiler is None:
        warn_no_compiler()
        return None
    text = b"".join(p.read_bytes() for p in (source, *HEADERS))
    key = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode() + _cpu_flags()).hexdigest()
    path = cache_dir() / f"{source.parent.name}_cpu_{key[:16]}.so"
    lib, error = _build_and_open(compiler, source, path, argtypes)
    if error is not None:
        _warn_once("build", f"building {what} failed ({error}): the CPU kernels that cannot be built run their "
                            f"PyTorch paths, slower; check the C compiler ({compiler}) and that {cache_dir()} is "
                            f"writable (DMC_KERNELS_CACHE)")
    return lib


def _build_and_open(compiler: str, source: Path, path: Path,
                    argtypes: Optional[dict[str, list]]) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """``(library, None)``, built first when ``path`` is missing and again when the cached file cannot be loaded
    (truncated, emptied); ``(None, error line)`` when that fails."""
    error = _build_if_missing(compiler, source, path)
    if error is not None:
        return None, error
    lib = _open(path, argtypes)
    if lib is None:  # a damaged cached file
        error = _build_if_missing(compiler, source, path, force=True)
        if error is not None:
            return None, error
        lib = _open(path, argtypes)
    return lib, None if lib is not None else f"{path} cannot be loaded"


def _build_if_missing(compiler: str, source: Path, target: Path, force: bool = False) -> Optional[str]:
    """:func:`_build` unless ``target`` exists (``force``: in any case); the error line or None."""
    try:
        return None if target.exists() and not force else _build(compiler, source, target)
    except OSError as e:
        return str(e)


def _open(path: Path, argtypes: Optional[dict[str, list]]) -> Optional[ctypes.CDLL]:
    """The library at ``path`` with its functions' ``argtypes`` set, or None when it cannot be loaded or lacks
    one of them."""
    try:
        lib = ctypes.CDLL(str(path))
        for name, types in (argtypes or {}).items():
            getattr(lib, name).argtypes = types
    except (OSError, AttributeError):
        return None
    return lib
