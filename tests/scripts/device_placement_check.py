"""A training step (and an evaluation) with the ``meta`` device playing the GPU, on a machine without one.

    python tests/scripts/device_placement_check.py <overrides> [-- <overrides> ...]

The process's device (``dmc_train.distributed.device``) and megatron's "current CUDA device" are ``meta``, so the
model, megatron's buffers and every tensor the project creates for the model's device live there, while a tensor
created on the CPU by mistake stays on the CPU. PyTorch refuses an op that mixes a meta and a (non-scalar) CPU
tensor, as CUDA refuses CUDA and CPU: a tensor the project leaves on the CPU fails here as it would on a GPU.
Collectives must get tensors on the model's device (NCCL takes GPU tensors only; with one process they are
identities). Meta tensors hold no values, so what would read them (``item``, ``bool``, ``tolist``, ``nonzero``)
gets placeholders, and DMC's noise generator (none exists on meta) draws zeros on its device.

For each override set: build the Trainer, run one step and one evaluation; prints ``ok <overrides>``.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from dmc_train import distributed
from kernels.dmc import decisions

META = torch.device("meta")


def play_gpu_on_meta() -> None:
    """The CPU compatibility layer's "CUDA" becomes ``meta`` (megatron's allocations, ``.cuda()``), and so does
    the project's device."""
    distributed.install_cpu_compat()
    distributed.device = lambda: META
    torch.cuda.current_device = lambda: META
    compat = distributed._CudaToCpuMode.__torch_function__

    def to_meta(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(META)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # megatron asserts a CUDA type name
            return func(*args).replace("torch.meta.", "torch.cuda.")
        if kwargs.get("device") is not None and distributed._is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=META)
        return compat(self, func, types, args, kwargs)

    distributed._CudaToCpuMode.__torch_function__ = to_meta

    def all_reduce(tensor, *args, **kwargs):
        if tensor.device != META:
            raise RuntimeError(f"all_reduce of a tensor on {tensor.device}, not on the model's device")

    dist.all_reduce = all_reduce

    class Generator:  # torch.Generator(device="meta") does not exist
        device = META

        def manual_seed(self, seed):
            return self

    real_generator, gumbel = torch.Generator, decisions.gumbel_difference
    torch.Generator = lambda device=None: Generator() if device is not None and torch.device(device) == META \
        else real_generator(device)
    decisions.gumbel_difference = lambda shape, generator=None: (
        torch.zeros(shape, device=META) if isinstance(generator, Generator) else gumbel(shape, generator))


def _placeholders(data):
    if isinstance(data, torch.Tensor) and data.device == META:
        return torch.ones(data.shape).tolist() if data.dim() else 1.0
    if isinstance(data, (list, tuple)):
        return type(data)(_placeholders(x) for x in data)
    return data


# ops that take tensors on several devices on CUDA too: moves, copies, and indexing by a CPU index
_CROSS_DEVICE = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
                 torch.Tensor.index_put_, torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.cpu}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class MetaValues(TorchFunctionMode):
    """Reads of meta tensors' values get placeholders: 1 for a number, True for a truth value, nothing found by
    ``nonzero``. With ``checking`` set (a step, an evaluation; not the model's construction, whose moves are
    meant), an op on meta and (non-scalar) CPU tensors together is refused, as CUDA refuses it, also where meta's
    own kernels do not check (matmul, gather, ...)."""

    checking = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.checking and func not in _CROSS_DEVICE:
            devices = {t.device.type for t in _tensors((args, kwargs)) if t.dim() > 0}
            if len(devices) > 1:
                raise RuntimeError(f"{getattr(func, '__name__', func)} on tensors on {sorted(devices)}: one of them "
                                   f"is not on the model's device")
        t = args[0] if args else None
        if isinstance(t, torch.Tensor) and t.device == META:
            if func in (torch.Tensor.item, torch.Tensor.__float__):
                return 1.0
            if func in (torch.Tensor.__int__, torch.Tensor.__index__):
                return 1
            if func is torch.Tensor.__bool__:
                return True
            if func is torch.Tensor.tolist:
                return _placeholders(t)
            if func in (torch.Tensor.nonzero, torch.nonzero):
                return torch.zeros((0, t.dim()), dtype=torch.long, device=META)
        if func is torch.tensor and args:
            args = (_placeholders(args[0]), *args[1:])
        return func(*args, **kwargs)


def main() -> None:
    play_gpu_on_meta()
    from dmc_train.recipes import load_config
    from dmc_train.training.loop import Trainer

    runs, current = [], []
    for arg in sys.argv[1:] + ["--"]:
        if arg == "--":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    with tempfile.TemporaryDirectory() as tmp, MetaValues() as mode:
        for overrides in runs:
            # two layers and one micro-batch: a step's ops on meta tensors run through PyTorch's Python references
            cfg = load_config(["+recipe=tiny_pretrain", f"run_dir={tmp}/run", "checkpoint.resume=none",
                               "logging.progress=false", "train.eval_iters=1", "model.num_layers=2",
                               "train.global_batch_size=2", *overrides])
            trainer = Trainer(cfg)
            assert all(p.device == META for chunk in trainer.model for p in chunk.parameters())
            mode.checking = True
            trainer.train_step()
            trainer.evaluate()
            trainer.method.evaluation_metrics()
            mode.checking = False
            print("ok", " ".join(overrides), flush=True)


if __name__ == "__main__":
    main()
