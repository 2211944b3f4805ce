"""One test suite, two devices: ``DMC_TEST_DEVICE`` (``cpu``, the default and CI's, or ``cuda``) chooses where the
tests that exercise tensors run; they take it from the ``device`` fixture.

- ``cpu``: the GPUs of the machine, if any, are hidden from the tests and every process they start
  (``CUDA_VISIBLE_DEVICES=""``), so a training subprocess runs on CPU as in CI; Triton kernels run on CPU
  tensors through Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton compiles anything: the
  kernels are imported lazily, on first use); one intra-op thread per process unless ``OMP_NUM_THREADS`` says.
- ``cuda``: the same tests on the first visible GPU, Triton kernels compiled for real, training
  subprocesses on CUDA with NCCL (``benchmarks/gpu_check.sh`` runs this).

Files with a ``slow`` test run first, the longest first (``pytest.mark.slow(minutes=N)``): under ``pytest -n 2
--dist loadfile`` (the README's command) each file goes to one worker in collection order, so a long file collected
last would run alone at the end.
"""

import os
import sys

import pytest

TEST_DEVICE = os.environ.get("DMC_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"DMC_TEST_DEVICE={TEST_DEVICE!r} is not one of cpu, cuda")
if TEST_DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread per pytest process (set before torch is imported): with two workers on two cores, each
    # worker's second OpenMP thread spins waiting for a core the other worker holds, and the in-process tests took
    # 2-5x longer. The compiled kernels' multi-threaded paths are tested with threads set explicitly.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def device():
    """The ``torch.device`` the tests' tensors live on (``DMC_TEST_DEVICE``)."""
    import torch

    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.exit("DMC_TEST_DEVICE=cuda but torch sees no GPU; run without it for the CPU tests", returncode=2)
    return torch.device(TEST_DEVICE)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The test on 1 and on 2 intra-op threads (the compiled CPU kernels split their rows over as many OpenMP threads;
    the suite's processes run on one on CPU, above), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def pytest_configure(config):
    # pytest-xdist hands out files with the most tests first unless told not to: keep the order set below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    minutes = {}  # a file's longest ``slow`` mark (``pytest.mark.slow(minutes=5)``; 1 when not given)
    for item in items:
        for mark in item.iter_markers("slow"):
            minutes[item.path] = max(minutes.get(item.path, 0), mark.kwargs.get("minutes", 1))
    items.sort(key=lambda item: -minutes.get(item.path, 0))  # stable: the order within a file is kept


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that loads a checkpoint in this process (the inference model) sets up a process group and its
    MASTER_PORT: both are torn down after the test, so the worker's later tests (and their subprocesses,
    which would inherit the port) start clean."""
    before = {key: os.environ.get(key) for key in _LAUNCH_ENV}
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from dmc_train.distributed import shutdown

        shutdown()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
