import os
from pathlib import Path

import pytest
import torch

from helpers import budget
from helpers.cli import make_corpus, write_docs

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


#: the tiers whose tests start processes: ``dist`` and ``gpu`` (worker worlds), ``e2e`` (commands
#: with their workers) one test after another each, and ``cli`` (commands that run as one process)
PROCESS_TIERS = ("dist", "e2e", "gpu", "cli")


def pytest_collection_modifyitems(config, items):
    """Skip the ``gpu`` tests without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (``-n 2`` in ``pyproject.toml``): each process tier
    (:data:`PROCESS_TIERS`) in one scope, run one test after another by one pytest worker as a plain
    ``pytest`` would (``tests/gpu`` with ``tests/dist``; a worker world rarely keeps both cores
    busy: it waits on gloo and on process start-up, so two of them, one per pytest worker, fill the
    cores better than one, and a ``tests/cli`` process keeps one core); the single-process unit
    tests one scope each, taken by whichever worker is free (the larger scopes go out first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessTiersInScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("/")
            if len(parts) > 2 and parts[1] in PROCESS_TIERS:
                return {"e2e": "end-to-end tier", "cli": "one-process tests"}.get(parts[1], "multi-process tiers")
            return nodeid

    return ProcessTiersInScopes(config, log)


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
