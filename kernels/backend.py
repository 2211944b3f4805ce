"""Which implementation the public ops run: one switch for every op family.

- ``auto`` (default): Triton kernels for CUDA tensors when Triton is installed; on CPU, paged decode attention
  and a Llama layer's dense ops by their compiled kernels (``kernels/paged/cpu.py``, ``kernels/layer/cpu.py``,
  fp32, when a C compiler is present); the PyTorch paths everywhere else.
- ``torch``: the PyTorch paths on every device (debugging, comparisons).
- ``triton``: the Triton kernels on every device. On CPU tensors this needs the Triton interpreter
  (``TRITON_INTERPRET=1`` in the environment before Triton is imported): how the kernels are tested
  on machines without a GPU.

Set it with :func:`set_backend` or the environment variable ``DMC_KERNELS`` (read once, at import).
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("DMC_KERNELS", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"DMC_KERNELS={_backend!r} is not one of {', '.join(BACKENDS)}")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """True when the ops should run their Triton kernels on tensors on ``device``."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not triton_available():
            raise RuntimeError("the Triton backend was requested (DMC_KERNELS=triton) but triton is not installed")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 "
                               "before starting Python")
        return True
    return device.type == "cuda" and triton_available()
