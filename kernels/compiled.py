"""C sources compiled for this CPU on first use and loaded with ctypes: the CPU kernels' shared build.

A family's ``cpu.py`` names its source and what the library is for; :func:`load` compiles it once per source,
flags and machine (``-march=native``: keyed by the CPU's feature flags) into ``$DMC_KERNELS_CACHE`` (default
``~/.cache/dmc_train/kernels``), written atomically, and loads it. Without a C compiler (or if the build fails)
it warns and returns None: the family's PyTorch path runs instead. ``CC`` picks the compiler (default ``cc``).
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


def load(source: Path, what: str, argtypes: Optional[dict[str, list]] = None) -> Optional[ctypes.CDLL]:
    """The library compiled from ``source`` (built on first use), its functions' ``argtypes`` (name -> ctypes
    types; each returns an int, ctypes' default) set, or None with one warning naming ``what`` (e.g. "the CPU
    paged-attention kernel") when it cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"no C compiler (cc) found: {what} runs its PyTorch path, slower; install gcc or set CC to "
                      f"use the compiled kernel", stacklevel=3)
        return None
    text = b"".join(p.read_bytes() for p in (source, *HEADERS))
    key = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode() + _cpu_flags()).hexdigest()
    path = cache_dir() / f"{source.parent.name}_cpu_{key[:16]}.so"
    try:
        error = None if path.exists() else _build(compiler, source, path)
    except OSError as e:
        error = str(e)
    if error is not None:
        warnings.warn(f"building {what} failed ({error}): its PyTorch path runs instead; check the C compiler "
                      f"({compiler}) and that {cache_dir()} is writable (DMC_KERNELS_CACHE)", stacklevel=3)
        return None
    lib = ctypes.CDLL(str(path))
    for name, types in (argtypes or {}).items():
        getattr(lib, name).argtypes = types
    return lib
