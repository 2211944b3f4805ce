"""Triton kernels run on CPU tensors through Triton's interpreter in the tests; the variable must be set
before Triton compiles anything (the kernels are imported lazily, on first use).

Files with a ``slow`` test run first: under ``pytest -n 2 --dist loadfile`` (the README's command) each
file goes to one worker in collection order, so a long file collected last would run alone at the end.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file is kept
