"""A hung spawn of workers fails with TimeoutError (its workers killed) before pytest-timeout would
kill the test from outside."""

from __future__ import annotations

import time

import pytest

from helpers import budget
from helpers.dist_helpers import run_workers


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(3600)


@pytest.mark.timeout(budget.MARGIN_S + 3)
def test_a_hung_spawn_asking_for_more_than_the_test_has_fails_first():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="workers did not finish"):
        run_workers(_sleep_forever, 2, timeout=240)  # more than the test's own timeout
    assert time.monotonic() - started < 3 + 3
