import os
from pathlib import Path

import pytest
import torch

from helpers import budget
from helpers.cli import make_corpus, write_docs

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
    """Start the test's budget (tests/helpers/budget.py) before any of its fixtures run: the timeout mark,
    else the ini ``timeout``; inner waits derive from it."""
    mark = item.get_closest_marker("timeout")
    timeout = mark.args[0] if mark is not None and mark.args else mark.kwargs.get("timeout") if mark else None
    if timeout is None:
        timeout = float(item.config.getini("timeout") or 0)
    budget.start(float(timeout))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small real-text corpus (modules of the standard library's ``email`` package): ``docs/``
    (16 files) and ``extra.jsonl`` (4 more documents). Read-only: tests write elsewhere."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def flat_corpus(tmp_path_factory) -> Path:
    """Twelve real text files in one folder (modules of the standard library's ``email`` package)."""
    return write_docs(tmp_path_factory.mktemp("flat_corpus"), 12)
