"""Every paged-attention test runs on both CPU paths: the compiled kernel (``auto``) and PyTorch's (``torch``)."""

import pytest

from kernels.backend import get_backend, set_backend


@pytest.fixture(params=["auto", "torch"], ids=["cpu_kernel", "torch"])
def cpu_backend(request):
    """The kernels' backend for the test (``auto``: the compiled CPU kernel for fp32 decode attention)."""
    before = get_backend()
    set_backend(request.param)
    yield request.param
    set_backend(before)
