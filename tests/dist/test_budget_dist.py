"""A hung spawn of workers fails with TimeoutError (its workers killed) before pytest-timeout would
kill the test from outside."""

from __future__ import annotations

import time

import pytest

from helpers import budget
from helpers.dist_helpers import run_workers, start_fork_server


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(3600)


#: seconds the test may take to start the workers' fork server first (it imports torch once)
FORK_SERVER_S = 60


@pytest.mark.timeout(budget.MARGIN_S + 3 + FORK_SERVER_S)
def test_a_hung_spawn_asking_for_more_than_the_test_has_fails_first():
    start_fork_server()
    budget.start(budget.MARGIN_S + 3)  # from here, as if the test's timeout were MARGIN_S + 3 s
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="workers did not finish"):
        run_workers(_sleep_forever, 2, timeout=240)  # more than the test's own timeout
    assert time.monotonic() - started < 3 + 3
