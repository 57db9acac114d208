"""The multi-process tier: its session workers (``helpers.dist_helpers.run_in_pool``) end after its
last test, so that the end-to-end tests after it have the machine to themselves."""

from __future__ import annotations

from pathlib import Path

from helpers.dist_helpers import close_pools

HERE = Path(__file__).parent


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or Path(nextitem.path).parent != HERE:
        close_pools()
