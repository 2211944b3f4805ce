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
