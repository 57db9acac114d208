"""A hung command is killed (its process group) within the test's budget, before pytest-timeout
would kill the test from outside."""

from __future__ import annotations

import sys
import time

import pytest

from helpers import budget
from helpers.proc_helpers import run_together


@pytest.mark.timeout(budget.MARGIN_S + 2)
def test_a_hung_command_is_killed_within_the_budget(tmp_path):
    started = time.monotonic()
    [proc] = run_together([[sys.executable, "-c", "import time; time.sleep(3600)"]], timeout=240, env={}, cwd=tmp_path)
    assert proc.returncode is None and time.monotonic() - started < 2 + 2
