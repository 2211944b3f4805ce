"""The machine cannot run what was asked: one line naming the cause and the fix (``DeviceError``, exit code 2 at the
entry points). The GPU side is probed through torch's own queries, answered here as a GPU machine would."""

import pytest
import torch
import torch.distributed as dist

from dmc_train import distributed
from dmc_train.distributed import LaunchEnv, check_gpus, check_precision
from dmc_train.errors import DeviceError


def test_more_processes_per_node_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"process 3 of this node needs GPU 3, but 2 are visible; launch at most 2 "
                                          r"processes per node \(torchrun --nproc_per_node=2\)"):
        check_gpus(LaunchEnv(rank=3, world_size=4, local_rank=3, master_addr="h", master_port=1, launcher="torchrun"))


def test_no_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(DeviceError, match="no NCCL, which training on GPUs needs"):
        check_gpus(LaunchEnv(0, 1, 0, "h", 1, "single"))


def test_bf16_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(distributed, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    with pytest.raises(DeviceError, match="train.precision=bf16 but Tesla V100 has no bfloat16; use train.precision="
                                          "fp16 or fp32"):
        check_precision("bf16")
    check_precision("fp16")


def test_bf16_where_the_device_has_it():
    check_precision("bf16")  # the CPU, or the test GPU (every GPU lent here has bf16)


def gpus(monkeypatch, count: int, bf16: bool = True) -> None:
    """torch's GPU queries answered as a machine with ``count`` GPUs would (GPU 0 current)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")


@pytest.mark.parametrize("count, spec, dtype, message", [
    (0, "cuda", None, "device='cuda' but torch sees no GPU (a CPU build of torch, no driver, or CUDA_VISIBLE_DEVICES "
                      "empty); use device=cpu, or a CUDA build (requirements-gpu.txt)"),
    (2, "cuda:2", None, "device='cuda:2' but this machine has 2 visible GPU(s) (cuda:0..cuda:1); choose one of those"),
    (1, "cpu", torch.float16, "fp16 on the CPU is not supported"),
    (1, "cuda:0", torch.bfloat16, "bf16 on Tesla V100, which has no bfloat16; use dtype fp16 or fp32"),
    (1, "mps", None, "device='mps': inference runs on cpu or cuda"),
    (1, "gpu0", None, "device='gpu0' is not a device; use cpu, cuda or cuda:<index>"),
])
def test_an_inference_device_that_cannot_run_is_one_line(monkeypatch, count, spec, dtype, message):
    gpus(monkeypatch, count, bf16=False)
    with pytest.raises(DeviceError) as e:
        distributed.inference_device(spec, dtype)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_inference_device_names_its_gpu(monkeypatch):
    gpus(monkeypatch, 2)
    assert distributed.inference_device("cuda", torch.bfloat16) == torch.device("cuda", 0)
    assert distributed.inference_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert distributed.inference_device("cpu", torch.bfloat16) == torch.device("cpu")
