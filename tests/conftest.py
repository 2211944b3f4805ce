"""Triton kernels run on CPU tensors through Triton's interpreter in the tests; the variable must be set
before Triton compiles anything (the kernels are imported lazily, on first use).

Files with a ``slow`` test run first: under ``pytest -n 2 --dist loadfile`` (the README's command) each
file goes to one worker in collection order, so a long file collected last would run alone at the end.
"""

import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file is kept


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
