"""Inner timeouts fit inside the test's own: a hung spawn or command fails with TimeoutError (its
processes killed) before pytest-timeout would kill the test from outside."""

from __future__ import annotations

import sys
import time

import pytest

import budget
from dist_helpers import run_workers
from proc_helpers import run_together


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(3600)


@pytest.mark.timeout(budget.MARGIN_S + 6)
def test_a_hung_spawn_asking_for_more_than_the_test_has_fails_first():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="workers did not finish"):
        run_workers(_sleep_forever, 2, timeout=240)  # more than the test's own timeout
    assert time.monotonic() - started < 6 + 3


@pytest.mark.timeout(budget.MARGIN_S + 4)
def test_a_hung_command_is_killed_within_the_budget(tmp_path):
    started = time.monotonic()
    [proc] = run_together([[sys.executable, "-c", "import time; time.sleep(3600)"]], timeout=240, env={}, cwd=tmp_path)
    assert proc.returncode is None and time.monotonic() - started < 4 + 2


@pytest.mark.timeout(60)
def test_the_budget_is_shared_by_the_waits_of_one_test():
    first = budget.seconds()
    assert 60 - budget.MARGIN_S - 2 < first <= 60 - budget.MARGIN_S
    time.sleep(1)
    assert budget.seconds() <= first - 1 and budget.seconds(5) == 5
