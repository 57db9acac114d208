import os
from pathlib import Path

import pytest
import torch

from helpers import budget
from helpers.cli import make_corpus, write_docs

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


#: the tiers whose tests start processes (worker worlds, launchers, subprocesses): run one after another
PROCESS_TIERS = ("dist", "e2e", "gpu")

#: Tests of the process tiers that run one process at a time beside pytest (a command without a
#: launcher or whose launcher exits before any worker, one after another): they keep one core busy,
#: not both, so they run in a scope of their own, on the other pytest worker beside the multi-process
#: tests (path prefixes of their node ids). Every user of a session fixture they share is here too
#: (``uninterrupted``: run once per pytest worker that needs it). The 1T search's CPU bound stays
#: with the process tiers.
ONE_PROCESS = (
    "tests/e2e/test_api_e2e.py::",
    "tests/e2e/test_async_save_e2e.py::",
    "tests/e2e/test_bad_input_e2e.py::",
    "tests/e2e/test_budget_e2e.py::",
    "tests/e2e/test_cli.py::test_bad_data_path_is_a_clear_error",
    "tests/e2e/test_cli.py::test_corpus_too_small_for_one_global_batch",
    "tests/e2e/test_cli.py::test_output_dir_problems_are_found_before_data_preparation",
    "tests/e2e/test_cli.py::test_train_module_runs_without_a_launcher",
    "tests/e2e/test_cli.py::test_save_and_resume_from_the_command_line",
    "tests/e2e/test_context_parallel_e2e.py::test_a_bad_cp_exits_2_before_any_worker",
    "tests/e2e/test_data_tokenizer_e2e.py::",
    "tests/e2e/test_gpu_check_e2e.py::",
    "tests/e2e/test_planner_no_torch_e2e.py::test_plan_",
    "tests/e2e/test_planner_no_torch_e2e.py::test_schedule_command_imports_no_torch",
    "tests/e2e/test_planner_no_torch_e2e.py::test_a_bad_train_request_is_answered_without_importing_torch",
    "tests/e2e/test_planner_search_e2e.py::",
    "tests/e2e/test_topology_command_e2e.py::",
    "tests/e2e/test_topology_placement_e2e.py::",
    "tests/e2e/test_worker_imports_e2e.py::",
)


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
    """With pytest-xdist (``-n 2`` in ``pyproject.toml``): the multi-process tests of the process
    tiers (:data:`PROCESS_TIERS`) in two scopes, ``tests/dist`` (and ``tests/gpu``) and
    ``tests/e2e``, each run one test after another by one pytest worker as a plain ``pytest`` would
    (a worker world rarely keeps both cores busy: it waits on gloo and on process start-up, so two
    of them, one per pytest worker, fill the cores better than one); the tests of
    :data:`ONE_PROCESS` in a third scope; the single-process unit tests one scope each, taken by
    whichever worker is free (the larger scopes go out first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessTiersInScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(ONE_PROCESS):
                return "one-process tests"
            parts = nodeid.split("/")
            if len(parts) > 2 and parts[1] in PROCESS_TIERS:
                return "end-to-end tier" if parts[1] == "e2e" else "multi-process tiers"
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
