"""The fault hooks' settings and the message of a lost peer, in one process (a stalled worker:
tests/dist/test_no_hang.py, tests/e2e/test_no_hang_e2e.py)."""

from __future__ import annotations

import pytest

from helpers import faults
from ptdp.engine import activity


def test_fault_hooks_parse_and_reject_bad_values(monkeypatch):
    plan = lambda: faults.FaultPlan.from_env()  # noqa: E731 - read once per process by install_from_env, here per check
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "3:2,5")
    assert [plan().poisons(r, i) for r, i in ((3, 2), (3, 5), (3, 3), (2, 2))] == [True, True, False, False]
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "0:every")
    assert plan().poisons(0, 17) and not plan().poisons(1, 17)
    monkeypatch.setenv(faults.NAN_LOSS_ENV, "0")
    with pytest.raises(ValueError, match="PTDP_TEST_NAN_LOSS='0': expected"):
        plan()
    monkeypatch.delenv(faults.NAN_LOSS_ENV)
    monkeypatch.setenv(faults.STALL_ENV, "1:2:gradient sync:0.5")
    assert plan().stall_phase(1, 2) == "gradient sync" and plan().stall_phase(1, 3) is None
    monkeypatch.setenv(faults.STALL_ENV, "1:2:grad sync")
    with pytest.raises(ValueError, match="phase 'grad sync' is not one of"):
        faults.install(plan())
    monkeypatch.delenv(faults.STALL_ENV)
    assert plan() is None, "no test variable: no plan, nothing on the production path"
    activity.start_step(1, 2)
    assert activity.CURRENT.where() == "in forward at iteration 2"


def test_a_lost_peer_is_named_without_claiming_a_timeout():
    activity.set_phase(activity.BACKWARD, 9)
    err = RuntimeError(
        "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5. This is "
        "typically caused by a remote worker crashing."
    )
    e = activity.collective_error(err, rank=4, axis="tp", op="all_reduce", ranks=(4, 5), timeout_s=120)
    assert type(e) is activity.CollectiveError
    assert str(e) == (
        "rank 4 failed in backward at iteration 9: tp all_reduce over ranks 4, 5: "
        "Connection closed by peer [127.0.0.1]:5"
    )


def test_an_installed_plan_acts_through_the_engine_hooks_and_only_then(monkeypatch):
    monkeypatch.setenv(faults.CRASH_ENV, "1:2:backward:raise")
    activity.start_step(1, 2)
    activity.set_phase(activity.BACKWARD)  # the variable alone does nothing: no plan installed
    remove = faults.install(faults.FaultPlan.from_env())
    try:
        activity.start_step(1, 2)
        with pytest.raises(RuntimeError, match="ptdp test crash: rank 1 in backward at iteration 2"):
            activity.set_phase(activity.BACKWARD)
        activity.set_phase(activity.BACKWARD)  # once per iteration
        activity.start_step(0, 2)
        activity.set_phase(activity.BACKWARD)  # another rank
    finally:
        remove()
    activity.start_step(1, 2)
    activity.set_phase(activity.BACKWARD)
