"""Inner timeouts fit inside the test's own: a hung spawn or command fails with TimeoutError (its
processes killed) before pytest-timeout would kill the test from outside."""

from __future__ import annotations

import time

import pytest

from helpers import budget


@pytest.mark.timeout(60)
def test_the_budget_is_shared_by_the_waits_of_one_test():
    first = budget.seconds()
    assert 60 - budget.MARGIN_S - 2 < first <= 60 - budget.MARGIN_S
    time.sleep(1)
    assert budget.seconds() <= first - 1 and budget.seconds(5) == 5
