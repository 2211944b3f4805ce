"""Which implementation an op runs: the backends, the one chosen for a device, and the dispatch over each op
family's table.

Backends (each with :meth:`Backend.available` on a device, and the backend it falls back to):

- ``torch``: the PyTorch paths, on every device. Every op has one; it runs whatever no other backend takes.
- ``cpu_compiled``: the C kernels compiled on first use (:mod:`kernels.compiled`), CPU tensors; available where a
  C compiler is found (``CC``, else ``cc`` or ``gcc``). Falls back to ``torch``.
- ``triton``: the Triton kernels; CUDA tensors when Triton is installed, CPU tensors under its interpreter
  (``TRITON_INTERPRET=1`` in the environment before Python starts: how the kernels are tested without a GPU).
  Falls back to ``torch``.
- ``flash``: flash-attn's ``flash_attn_with_kvcache`` for paged decode attention where it fits; CUDA tensors, with
  flash-attn and Triton installed. Falls back to ``triton``.

:func:`choose` is the backend for tensors on a device. ``DMC_KERNELS`` (read once, at import; :func:`set_backend` in
tests and benchmarks) names one, or ``auto`` (the default): on CUDA ``flash``, else ``triton``, whichever is
available first; on CPU ``cpu_compiled`` where a compiler is found; ``torch`` otherwise. A named backend that cannot
run on the device raises RuntimeError naming the cause and the fix. The choice is kept per device type until
:func:`set_backend` (no environment read per call).

Dispatch: an op family lists each op's implementations by backend at the top of its ``__init__.py``, each with a
fit predicate over the op's inputs (:class:`Impl`, :class:`Op`). An op runs the first implementation, in the order
of the backend chosen for its first input's device (itself, the backends it falls back to, ``torch`` last), whose
fit takes its inputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, Optional

import torch

from kernels import compiled


class Backend:
    """A backend: its ``name`` (a ``DMC_KERNELS`` value), :meth:`problem` on a device, and ``order``, the backends
    whose implementations an op tries, in turn, when this one is chosen (itself first, ``torch`` last)."""

    def __init__(self, name: str, problem: Callable[[torch.device], Optional[str]],
                 falls_back_to: Optional[Backend]):
        self.name = name
        self._problem = problem
        self.order = (name,) + (falls_back_to.order if falls_back_to is not None else ())

    def problem(self, device: torch.device) -> Optional[str]:
        """Why this backend cannot run on ``device`` (one line: the cause and the fix), or None when it can."""
        return self._problem(device)

    def available(self, device: torch.device) -> bool:
        return self._problem(device) is None

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def _triton_problem(device: torch.device) -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "the Triton backend was requested (DMC_KERNELS=triton) but triton is not installed: pip install triton"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before starting Python"
    if device.type not in ("cuda", "cpu"):
        return f"Triton kernels run on CUDA tensors, not {device.type}: unset DMC_KERNELS or set it to torch"
    return None


def _flash_problem(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return (f"flash-attn (DMC_KERNELS=flash) runs on CUDA tensors, not {device.type}: unset DMC_KERNELS or set "
                f"it to torch")
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn (DMC_KERNELS=flash) is not installed: pip install flash-attn, or unset DMC_KERNELS"
    return _triton_problem(device)


def _cpu_compiled_problem(device: torch.device) -> Optional[str]:
    if device.type != "cpu":
        return (f"the compiled CPU kernels (DMC_KERNELS=cpu_compiled) take CPU tensors, not {device.type}: unset "
                f"DMC_KERNELS or set it to triton or torch")
    if compiled.find_compiler() is None:
        return ("the compiled CPU kernels (DMC_KERNELS=cpu_compiled) need a C compiler, none found: install gcc or "
                "set CC, or unset DMC_KERNELS")
    return None


TORCH = Backend("torch", lambda device: None, None)
TRITON = Backend("triton", _triton_problem, TORCH)
FLASH = Backend("flash", _flash_problem, TRITON)
CPU_COMPILED = Backend("cpu_compiled", _cpu_compiled_problem, TORCH)
BACKENDS = {b.name: b for b in (TORCH, TRITON, FLASH, CPU_COMPILED)}
SETTINGS = ("auto", *BACKENDS)
AUTO = {"cuda": (FLASH, TRITON), "cpu": (CPU_COMPILED,)}  # what auto tries on a device type, in turn

_setting = os.environ.get("DMC_KERNELS", "auto")
if _setting not in SETTINGS:
    raise ValueError(f"DMC_KERNELS={_setting!r} is not one of {', '.join(SETTINGS)}")
_chosen: dict[str, Backend] = {}  # device type -> the backend chosen for it under _setting


def set_backend(name: str) -> None:
    """Choose backends by ``name`` from now on (one of :data:`SETTINGS`; as ``DMC_KERNELS``)."""
    global _setting
    if name not in SETTINGS:
        raise ValueError(f"backend must be one of {', '.join(SETTINGS)}, got {name!r}")
    _setting = name
    _chosen.clear()


def get_backend() -> str:
    """The setting: ``auto`` or a backend's name."""
    return _setting


def choose(device: torch.device) -> Backend:
    """The backend for tensors on ``device`` (the module's docstring). Raises RuntimeError when the backend named
    by ``DMC_KERNELS`` cannot run there."""
    backend = _chosen.get(device.type)
    if backend is None:
        backend = _chosen[device.type] = _choose(device)
    return backend


def _chosen_for(tensor: torch.Tensor) -> Backend:
    """:func:`choose` for ``tensor``'s device; for a CPU tensor without building its device (reading a
    ``torch.device``'s type costs more than the rest of a dispatch)."""
    if tensor.is_cpu:
        backend = _chosen.get("cpu")
        if backend is not None:
            return backend
    return choose(tensor.device)


def _choose(device: torch.device) -> Backend:
    if _setting != "auto":
        backend = BACKENDS[_setting]
        problem = backend.problem(device)
        if problem is not None:
            raise RuntimeError(problem)
        return backend
    backend = next((b for b in AUTO.get(device.type, ()) if b.available(device)), TORCH)
    if device.type == "cpu" and backend is TORCH:
        compiled.warn_no_compiler()
    return backend


class Impl:
    """One backend's implementation of an op: ``run(*inputs)``; ``fits(*inputs) -> bool``, whether it takes these
    inputs (None: any); ``takes(device, dtype) -> bool``, the part of the fit that the device and dtype of the op's
    main tensors decide (None: any), for questions asked before the tensors exist (which plan a cache builds)."""

    __slots__ = ("run", "fits", "takes", "backend")

    def __init__(self, run: Callable, fits: Optional[Callable[..., bool]] = None,
                 takes: Optional[Callable[[torch.device, Optional[torch.dtype]], bool]] = None):
        self.run, self.fits, self.takes = run, fits, takes
        self.backend = ""  # set by Op


class Op:
    """One op's implementations by backend name (``torch``'s takes every input; an op without one is a question
    whose other answer is its caller's route, and :meth:`pick` then returns None)."""

    def __init__(self, impls: dict[str, Impl]):
        unknown = set(impls) - set(BACKENDS)
        if unknown:
            raise ValueError(f"no backend named {', '.join(sorted(unknown))}")
        for name, impl in impls.items():
            impl.backend = name
        self._order = {b: tuple(impls[n] for n in b.order if n in impls) for b in BACKENDS.values()}

    def pick(self, *inputs) -> Optional[Impl]:
        """The implementation that runs ``inputs`` (the backend chosen for the first one's device)."""
        for impl in self._order[_chosen_for(inputs[0])]:
            if impl.fits is None or impl.fits(*inputs):
                return impl
        return None

    def pick_for(self, device: torch.device, dtype: Optional[torch.dtype]) -> Optional[Impl]:
        """The implementation that runs tensors of ``dtype`` on ``device`` as far as those two decide
        (:attr:`Impl.takes`)."""
        for impl in self._order[choose(device)]:
            if impl.takes is None or impl.takes(device, dtype):
                return impl
        return None

    def __call__(self, *inputs):
        """Run ``inputs`` by the implementation :meth:`pick` gives (the same loop inline: this is every op's call)."""
        for impl in self._order[_chosen_for(inputs[0])]:
            if impl.fits is None or impl.fits(*inputs):
                return impl.run(*inputs)


def lazy(module: str, name: str) -> Callable:
    """``module.name``, imported on first call (Triton decides compiled vs interpreted when a kernel is defined, and
    a machine without it never imports it)."""
    def run(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    run.__name__ = name
    return run
