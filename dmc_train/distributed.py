"""Process group and megatron ``parallel_state`` set-up, plus the CPU compatibility layer.

This is the module that reads launcher environment variables (torchrun's
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` and SLURM's
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_JOB_NODELIST``/``SLURM_JOB_ID``); the one
exception is ``cli.fail``, which reads ``RANK``/``WORLD_SIZE`` itself because it can run before torch is
imported.

Backend: NCCL when CUDA is available (each process on GPU ``LOCAL_RANK``, megatron as it expects), gloo
otherwise. On CPU the compatibility layer (``install_cpu_compat``) must be active before megatron builds any
module. :func:`device` is the device this process computes on; everything the project creates for a model
(RoPE tables, method state, loss terms, flags and metrics it all-reduces) goes there.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmc_train.errors import DeviceError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def read_launch_env() -> LaunchEnv:
    """Rank/world from torchrun variables, else from SLURM (srun without torchrun), else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "")),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="slurm",
        )
    # A single process keeps its store in memory (``initialize``): no port, so any number share a machine.
    return LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")


def scheduler_job_id() -> str | None:
    """The SLURM job ID (kept across requeues), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID")


def _first_slurm_host(nodelist: str) -> str:
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0].split("[")[0]


# megatron-core announces every CPU fallback and deprecation at import/build time; all expected here.
_EXPECTED_WARNINGS = (
    r".*(Transformer Engine and Apex|Apex) (are|is) not installed.*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base)` is deprecated.*",
    r".*\.grad attribute of a Tensor that is not a leaf.*",  # megatron's DDP probes param.grad via hooks
    r".*`load_state_dict` is deprecated.*",  # megatron's dist_checkpointing on torch.distributed.checkpoint
    r".*Please use DTensor instead and we are deprecating ShardedTensor.*",
)


def silence_expected_warnings() -> None:
    """Hide megatron-core's expected CPU-fallback and deprecation warnings, and its INFO logging.

    Called by the entry points (``dmc_train.cli``), not at import: a library user keeps control of
    their own warning filters.
    """
    import logging
    import warnings

    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron").setLevel(logging.WARNING)


# --------------------------------------------------------------------------------------
# CPU compatibility layer for megatron-core 0.16.1
# --------------------------------------------------------------------------------------
_CPU_COMPAT_INSTALLED = False


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """(F) Rewrites ``device="cuda..."`` keyword arguments to cpu; (G) ``Tensor.cuda()`` returns self;
    (H) a bare ``Tensor.type()`` reports ``torch.cuda.*Tensor``.

    megatron allocates buffers with ``device=torch.cuda.current_device()`` or ``"cuda"``, moves
    tensors with ``.cuda()``, and its optimizer / grad clipping assert ``param.type() ==
    'torch.cuda.FloatTensor'``. A TorchFunctionMode intercepts all three without touching megatron code.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


def install_cpu_compat() -> bool:
    """Make megatron-core 0.16.1 run on CPU. No-op (returns False) when CUDA is available.

    Each patch was shown necessary by removing it (docs/DESIGN.md#the-cpu-compatibility-layer):
    (A) ``torch.cuda.current_device`` -> cpu device: megatron allocates grad buffers and optimizer
        tensors on ``torch.cuda.current_device()``.
    (B) ``torch.cuda.synchronize`` -> no-op: dist_checkpointing's save synchronises the device.
    (C, D) ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed`` act on the CPU generator:
        megatron's tensor-parallel RNG tracker forks the "cuda" generator around weight init and
        dropout; without D initial weights are not reproducible.
    (E) megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator state
        (they call into ``torch.cuda.default_generators`` directly).
    (F, G, H) a thread-local ``TorchFunctionMode`` (``_CudaToCpuMode``), entered for the process.
    """
    global _CPU_COMPAT_INSTALLED
    if torch.cuda.is_available():
        return False
    if _CPU_COMPAT_INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")  # (A)
    torch.cuda.synchronize = lambda *a, **k: None  # (B)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # (C)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # (D)
    torch.cuda.random.manual_seed = torch.cuda.manual_seed
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # (E)
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CudaToCpuMode().__enter__()  # (F, G, H): stays active for the process (main thread)
    _CPU_COMPAT_INSTALLED = True
    return True


def device() -> torch.device:
    """The device this process computes on: its GPU (chosen by :func:`initialize`: ``LOCAL_RANK``) when CUDA is
    available, else the CPU."""
    if _CPU_COMPAT_INSTALLED or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def inference_device(spec: str | torch.device, dtype: torch.dtype | None = None) -> torch.device:
    """The device an inference model runs on, from ``spec`` (``"cpu"``, ``"cuda"`` = the current GPU,
    ``"cuda:<index>"``, a ``torch.device``), checked before anything is allocated: DeviceError (one line) for a GPU
    that is not there and for a ``dtype`` the device cannot compute in (fp16 on CPU; bf16 on a GPU without it)."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device={spec!r} is not a device; use cpu, cuda or cuda:<index>") from None
    if dev.type == "cpu":
        if dtype == torch.float16:
            raise DeviceError("fp16 on the CPU is not supported (its matmuls are slow and partly missing); use "
                              "dtype fp32 or bf16 on the CPU, or fp16 on a GPU (device=cuda)")
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device={spec!r}: inference runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceError(f"device={spec!r} but torch sees no GPU (a CPU build of torch, no driver, or "
                          f"CUDA_VISIBLE_DEVICES empty); use device=cpu, or a CUDA build (requirements-gpu.txt)")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise DeviceError(f"device={spec!r} but this machine has {count} visible GPU(s) (cuda:0..cuda:{count - 1}); "
                          f"choose one of those")
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"bf16 on {torch.cuda.get_device_name(index)}, which has no bfloat16; use dtype fp16 or fp32")
    return torch.device("cuda", index)


def without_cpu_compat_mode() -> contextlib.AbstractContextManager:
    """A context in which torch calls skip the compatibility layer's TorchFunctionMode (F, G, H).

    That mode intercepts every torch call (about 15 % of a small decode step on CPU); code that runs no
    megatron-core inside (the inference forward) can do without it. A no-op context when it is not
    installed.
    """
    return torch._C.DisableTorchFunction() if _CPU_COMPAT_INSTALLED else contextlib.nullcontext()


# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------
def initialize(layout_tp: int, layout_pp: int, layout_vpp: int | None, seed: int,
               timeout_minutes: int = 30) -> LaunchEnv:
    """Create the default process group and megatron's parallel groups; seed all RNGs.

    Idempotent: a second call with the same layout is a no-op (tests build several models).
    """
    from megatron.core import parallel_state, tensor_parallel

    env = read_launch_env()
    if not torch.cuda.is_available():
        install_cpu_compat()
    else:
        check_gpus(env)
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        on_gpu = torch.cuda.is_available()
        group = {"backend": "nccl" if on_gpu else "gloo", "timeout": datetime.timedelta(minutes=timeout_minutes),
                 "device_id": device() if on_gpu else None}
        if env.world_size == 1:
            # an in-memory store: a TCP one needs a port, which another process can take between choosing and
            # binding it (EADDRINUSE), and setting MASTER_PORT would leak into child processes
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **group)
        else:
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            dist.init_process_group(rank=env.rank, world_size=env.world_size, **group)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout_tp,
        pipeline_model_parallel_size=layout_pp,
        virtual_pipeline_model_parallel_size=layout_vpp,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return env


def check_gpus(env: LaunchEnv) -> None:
    """One GPU per process of this node, and NCCL to connect them; DeviceError (one line) otherwise."""
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise DeviceError(f"process {env.local_rank} of this node needs GPU {env.local_rank}, but {count} "
                          f"{'is' if count == 1 else 'are'} visible; launch at most {count} processes per node "
                          f"(torchrun --nproc_per_node={count}) or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if not dist.is_nccl_available():
        raise DeviceError("this torch build has no NCCL, which training on GPUs needs; install a CUDA build of torch "
                          "with NCCL (requirements-gpu.txt), or train on CPU with CUDA_VISIBLE_DEVICES=\"\"")


def check_precision(precision: str) -> None:
    """``train.precision`` the device supports; DeviceError (one line) otherwise. Call after :func:`initialize`."""
    if precision == "bf16" and device().type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"train.precision=bf16 but {torch.cuda.get_device_name()} has no bfloat16; use "
                          f"train.precision=fp16 or fp32")


def init_gloo_group(env: LaunchEnv, timeout_minutes: int = 30):
    """The default process group over gloo for ``env``'s ranks, without megatron's parallel state (tensor-parallel
    inference: plain tensors, CPU all-reduces) from torchrun's variables, used as they are (none is set).
    Idempotent; returns the group."""
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.group.WORLD


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Broadcast a picklable object from ``src`` to every rank (identity without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first_message(message: str | None) -> str | None:
    """Collective: the first non-None ``message`` in rank order (e.g. an error one rank hit), on every rank."""
    if not dist.is_initialized():
        return message
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
