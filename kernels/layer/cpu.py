"""A Llama layer's dense ops compiled for the CPU: ``cpu_kernel.c`` (built on first use, :mod:`kernels.compiled`).

The matrix products of up to 32 rows (a decode step's tokens) run the kernel's own loops over a packed copy of the
weight (:func:`packed`: column strips, each contiguous, so that they stream from memory; a few rows' sums in
vector registers while a strip streams past: 2-5x MKL's sgemm for such shapes on this project's CPUs, from the
caches or from memory; a row's result the same in any such batch); the others call the BLAS routine PyTorch's CPU
build carries (``sgemm_`` of ``libtorch_cpu``, MKL on x86): the same routine ``torch.mm`` runs. Both, and the row
loops of a prefill, on PyTorch's number of threads. When that symbol is not there (a build of PyTorch without it)
or no C compiler is present, :func:`library` is None and the tensor ops run (:mod:`kernels.layer.reference`). All
tensors fp32 and contiguous; the outputs are new tensors. A weight's packed copy is made at its first product of a
few rows and kept while the weight lives: a model decoding on CPU holds its projections twice.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kernels import compiled

SOURCE = Path(__file__).with_name("cpu_kernel.c")


def torch_sgemm() -> Optional[int]:
    """The address of ``sgemm_`` in PyTorch's own CPU library, or None."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.cast(ctypes.CDLL(str(path)).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled ops with PyTorch's BLAS handed to them, or None (with one warning) when either is missing."""
    sgemm = torch_sgemm()
    if sgemm is None:
        warnings.warn("PyTorch's CPU library exports no sgemm_: a Llama layer's dense ops run as tensor ops "
                      "(slower at decode)", stacklevel=2)
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib = compiled.load(SOURCE, "the CPU kernel of a Llama layer's dense ops", {
        "set_sgemm": [ptr], "set_threads": [ctypes.c_int], "strip_width": [], "skinny_rows": [],
        "rms_norm_matmul_f32": [ptr, ptr, f32, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr],
        "layer_output_f32": [ptr, ptr, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64],
        "layer_attend_output_f32": [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, f32, ptr, ptr, ptr, ptr, i64, i64, i64,
                                    ptr],
        "layer_decode_f32": [ptr, ptr, f32, ptr, ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr,
                             ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr]})
    if lib is None:
        return None
    lib.set_sgemm(sgemm)
    lib.threads = 0  # what set_threads was last given (see _threaded)
    lib.strip, lib.few_rows = lib.strip_width(), lib.skinny_rows()
    return lib


_PACKED = WeakIdKeyDictionary()  # weight -> (its version when packed, the packed copy)


def packed(w: torch.Tensor) -> torch.Tensor:
    """``w [k, n]`` as the kernel's products of a few rows read it: ``[ceil(n / S), k, S]``, strip ``b`` holding
    columns ``b S .. (b + 1) S`` (zeros past ``n``) row after row, ``S`` four of the CPU's vector registers (64
    floats with AVX-512). Made once per weight (again after an in-place change) and kept while ``w`` lives."""
    version, copy = _PACKED.get(w, (None, None))
    if version != w._version:
        (k, n), s = w.shape, library().strip
        strips = -(-n // s)
        copy = torch.zeros(k, strips * s, device="cpu")
        copy[:, :n] = w
        copy = copy.view(k, strips, s).transpose(0, 1).contiguous()
        _PACKED[w] = (w._version, copy)
    return copy


def _weight(w: torch.Tensor, t: int) -> tuple[int, Optional[int]]:
    """A weight's two arguments for a product of ``t`` rows: its address, and its packed copy's when ``t`` rows take
    the kernel's own products (else None: sgemm)."""
    return w.data_ptr(), packed(w).data_ptr() if t <= library().few_rows else None


def _threaded() -> ctypes.CDLL:
    """:func:`library`, its own products and loops on as many threads as PyTorch's (``torch.set_num_threads``)."""
    lib, n = library(), torch.get_num_threads()
    if lib.threads != n:
        lib.set_threads(n)
        lib.threads = n
    return lib


def _check(what: str, ok: bool, shapes: dict) -> None:
    """The kernel reads what the shapes say: refuse inconsistent ones as ``torch.mm`` would (one line)."""
    if not ok:
        given = ", ".join(f"{name} {tuple(t.shape)}" for name, t in shapes.items())
        raise ValueError(f"{what}: inconsistent shapes {given}")


def _out_of_memory(what: str, t: int) -> MemoryError:
    return MemoryError(f"{what} on CPU: no memory for the scratch buffers of {t} rows")


def takes(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernel takes these tensors: CPU, fp32, contiguous, none needing a gradient (and the
    library built)."""
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop, not all() over a generator: this runs on every call of the layer ops
        if not (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not (grad and t.requires_grad)):
            return False
    return library() is not None  # last: a GPU run never builds it


def rms_norm_matmul_fits(x, weight, eps, w, rope=None, *_) -> bool:
    """The fit of :func:`kernels.layer.rms_norm_matmul`'s inputs (:func:`takes`)."""
    return takes(x, weight, w) if rope is None else takes(x, weight, w, *rope)


def layer_output_fits(x, attn, o_w, weight, eps, gate_up_w, down_w, all_reduce=None) -> bool:
    """The fit of :func:`kernels.layer.layer_output`'s inputs: one rank (no ``all_reduce``), :func:`takes`."""
    return all_reduce is None and takes(x, attn, o_w, weight, gate_up_w, down_w)


def rms_norm_matmul_cpu(x, weight, eps: float, w, rope=None, rope_heads: int = 0, head_dim: int = 0,
                        channel: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`kernels.layer.rms_norm_matmul` by the compiled kernel (inputs fp32 and contiguous)."""
    (t, h), n = x.shape, w.shape[1]
    ok = w.shape[0] == h and weight.shape == (h,)
    if rope is not None:
        d, cos, sin = head_dim, *rope
        ok &= (cos.shape == (t, d) and sin.dim() == 3 and sin.shape[0] == t and sin.shape[1] in (1, rope_heads)
               and sin.shape[2] == d and d % 2 == 0 and rope_heads * d <= n and (channel is None or 0 <= channel < d))
    _check("rms_norm_matmul", ok, {"x": x, "weight": weight, "w": w, **dict(zip(("cos", "sin"), rope or ()))})
    y = torch.empty(t, n, device="cpu")
    if rope is None:  # the channel's values are a view of the output
        cos = sin = channel_values = None
    else:
        (cos, sin), channel_values = rope, None if channel is None else torch.empty(t, rope_heads, device="cpu")
    if _threaded().rms_norm_matmul_f32(
            x.data_ptr(), weight.data_ptr(), eps, *_weight(w, t), y.data_ptr(), t, h, n,
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
            0 if sin is None else sin.shape[1], rope_heads, head_dim, channel or 0,
            None if channel_values is None else channel_values.data_ptr()):
        raise _out_of_memory("rms_norm_matmul", t)
    if rope is None and channel is not None:
        channel_values = y.view(t, -1, head_dim)[:, :rope_heads, channel]
    return y, channel_values


def layer_output_cpu(x, attn, o_w, weight, eps: float, gate_up_w, down_w, all_reduce=None) -> torch.Tensor:
    """:func:`kernels.layer.layer_output` by the compiled kernel (inputs fp32 and contiguous, one rank:
    :func:`layer_output_fits`)."""
    t, h = x.shape
    a, f = attn.shape[1], down_w.shape[0]
    _check("layer_output", attn.shape[0] == t and o_w.shape == (a, h) and weight.shape == (h,)
           and gate_up_w.shape == (h, 2 * f) and down_w.shape == (f, h),
           {"x": x, "attn": attn, "o_w": o_w, "weight": weight, "gate_up_w": gate_up_w, "down_w": down_w})
    y = torch.empty(t, h, device="cpu")
    if _threaded().layer_output_f32(x.data_ptr(), attn.data_ptr(), *_weight(o_w, t), weight.data_ptr(), eps,
                                  *_weight(gate_up_w, t), *_weight(down_w, t), y.data_ptr(), t, h, a, f):
        raise _out_of_memory("layer_output", t)
    return y


def layer_decode_cpu(x, norm_in, eps: float, qkv_w, rope, rope_heads: int, head_dim: int, attention, o_w, norm_mlp,
                     gate_up_w, down_w, channel: Optional[int] = None) -> torch.Tensor:
    """:func:`kernels.layer.layer_decode` by the compiled kernel (inputs fp32 and contiguous)."""
    (t, h), n, f = x.shape, qkv_w.shape[1], down_w.shape[0]
    cos, sin = rope
    ok = (qkv_w.shape[0] == h and norm_in.shape == norm_mlp.shape == (h,) and cos.shape == (t, head_dim)
          and sin.dim() == 3 and sin.shape[0] == t and sin.shape[1] in (1, rope_heads) and sin.shape[2] == head_dim
          and rope_heads * head_dim <= n and o_w.shape == (attention.width, h) and gate_up_w.shape == (h, 2 * f)
          and down_w.shape[1] == h and (channel is None or 0 <= channel < head_dim))
    _check("layer_decode", ok, {"x": x, "qkv_w": qkv_w, "cos": cos, "sin": sin, "o_w": o_w, "gate_up_w": gate_up_w,
                                "down_w": down_w})
    y = torch.empty(t, h, device="cpu")
    code = _threaded().layer_decode_f32(
        x.data_ptr(), norm_in.data_ptr(), eps, *_weight(qkv_w, t), t, h, n, cos.data_ptr(), sin.data_ptr(),
        sin.shape[1], rope_heads, head_dim, -1 if channel is None else channel, attention.function, attention.context,
        attention.width, *_weight(o_w, t), norm_mlp.data_ptr(), *_weight(gate_up_w, t), *_weight(down_w, t), f,
        y.data_ptr())
    _raise_for("layer_decode", code, t, attention)
    return y


def layer_attend_output_cpu(x, heads, attention, o_w, weight, eps: float, gate_up_w, down_w) -> torch.Tensor:
    """:func:`kernels.layer.layer_attend_output` by the compiled kernel (inputs fp32 and contiguous)."""
    t, h = x.shape
    f = down_w.shape[0]
    _check("layer_attend_output", heads.shape[0] == t and o_w.shape == (attention.width, h) and weight.shape == (h,)
           and gate_up_w.shape == (h, 2 * f) and down_w.shape == (f, h),
           {"x": x, "heads": heads, "o_w": o_w, "gate_up_w": gate_up_w, "down_w": down_w})
    y = torch.empty(t, h, device="cpu")
    code = _threaded().layer_attend_output_f32(x.data_ptr(), heads.data_ptr(), attention.function, attention.context,
                                             attention.width, *_weight(o_w, t), weight.data_ptr(), eps,
                                             *_weight(gate_up_w, t), *_weight(down_w, t), t, h, f, y.data_ptr())
    _raise_for("layer_attend_output", code, t, attention)
    return y


def _raise_for(what: str, code: int, t: int, attention) -> None:
    """The error of a layer call's nonzero return ``code``: -1 out of memory, else the attention's."""
    if code < 0:
        raise _out_of_memory(what, t)
    if code:
        attention.check(code)
