import os

import pytest
import torch

import budget

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Start the test's budget (tests/budget.py) before any of its fixtures run: the timeout mark,
    else the ini ``timeout``; inner waits derive from it."""
    mark = item.get_closest_marker("timeout")
    timeout = mark.args[0] if mark is not None and mark.args else mark.kwargs.get("timeout") if mark else None
    if timeout is None:
        timeout = float(item.config.getini("timeout") or 0)
    budget.start(float(timeout))
