"""CPU binding (``--bind-cpus``) of real workers: under torchrun and ``ptdp train`` every thread of
each worker runs on the CPUs its plan gives (the plans themselves: tests/unit/test_binding.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers.proc_helpers import run_together
from ptdp.topology.binding import allowed_numa_nodes, plan_cpu_only, read_cpu_layout

WORKER = """
import json, os, sys
import torch, torch.distributed as dist
from ptdp.run.distributed import init_distributed

init_distributed(1.0, bind_cpus=sys.argv[1])
record = {
    "cpus": sorted(os.sched_getaffinity(0)),
    "threads": torch.get_num_threads(),
    "omp": os.environ["OMP_NUM_THREADS"],
    "thread_cpus": [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")],
}
dist.barrier()
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PTDP_CACHE_DIR=str(tmp_path / "cache"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["exclusive", "numa"])
def test_torchrun_workers_bind_themselves(policy, tmp_path):
    """Two workers under torchrun bind at start-up: every thread of each worker runs on the CPUs
    the policy gives its local rank (exclusive: disjoint shares; numa: its node's CPUs)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        policy,
        str(tmp_path),
    ]
    (proc,) = run_together([cmd], env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    layout = read_cpu_layout()
    allowed = set(layout.allowed)
    for record in got:
        assert record["cpus"] and set(record["cpus"]) <= allowed
        assert all(cpus == record["cpus"] for cpus in record["thread_cpus"]), "a thread escaped the binding"
    if policy == "exclusive":
        if len(allowed) >= 2:
            assert not set(got[0]["cpus"]) & set(got[1]["cpus"]), "exclusive shares overlap"
        for record in got:
            assert record["threads"] == len(record["cpus"]) and record["omp"] == str(len(record["cpus"]))
    else:
        nodes = allowed_numa_nodes(layout)
        expected = [list(nodes[list(nodes)[r * len(nodes) // 2]]) for r in range(2)]
        assert [record["cpus"] for record in got] == expected
    plan = plan_cpu_only(policy, 2, layout)
    assert [record["cpus"] for record in got] == [list(b.cpus) for b in plan.bindings]
    assert [record["threads"] for record in got] == [b.threads for b in plan.bindings]


@pytest.mark.slow
def test_ptdp_train_with_exclusive_binding(profiled_run):
    """The flag flows from ``ptdp train`` through the config to the workers; the plan is printed
    (the session's profiled run, tests/e2e/conftest.py: 2 workers with ``--bind-cpus exclusive``)."""
    plan = plan_cpu_only("exclusive", 2, read_cpu_layout())
    assert "cpu binding (exclusive):\n  " + plan.describe().replace("\n", "\n  ") in profiled_run.proc.stdout
    assert json.loads((profiled_run.run_dir / "config.json").read_text())["parallel"]["bind_cpus"] == "exclusive"
