"""Triton kernels run on CPU tensors through Triton's interpreter in the tests; the variable must be set
before Triton compiles anything (the kernels are imported lazily, on first use)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
