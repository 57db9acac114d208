"""Multi-node launch rehearsed on loopback: two torchrun launchers ("nodes") of 2 workers each, joined
by c10d rendezvous on 127.0.0.1, train exactly like one launcher of 4 workers (tp=1 pp=2 dp=2,
float64; ranks are ordered tp-dp-pp, so each node holds one pipeline stage with both of its
data-parallel ranks, and the pipeline transfers cross the nodes): the per-iteration losses,
gradient norms and validation losses are bitwise equal. The one launcher's run is the session's
uninterrupted (1,2,2) run of the restart tests (helpers/pp2_dp2_runs.py, tests/e2e/conftest.py)."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

from helpers.pp2_dp2_runs import FLAGS, ITERS, LAYOUT, metric_lines
from helpers.proc_helpers import free_port, run_together


def _metrics(lines: list[dict]) -> list[dict]:
    """The training and evaluation lines' iteration, loss, gradient norm and validation loss."""
    return [
        {k: v for k, v in r.items() if k in ("iteration", "loss", "grad_norm", "val_loss")}
        for r in lines
        if "loss" in r or "val_loss" in r
    ]


def _failed(procs) -> str:
    return "\n".join(f"$ {' '.join(p.cmd[:12])} ...\nexit {p.returncode}\n{p.stderr[-2500:]}" for p in procs)


@pytest.mark.slow
def test_two_launchers_on_loopback_equal_one_launcher(tmp_path, pp2_dp2_workspace, pp2_dp2_uninterrupted):
    # A cold data cache of their own: both launchers' local rank 0 tokenize at once; preparation is atomic.
    env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    port = free_port()
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        uuid.uuid4().hex[:8],
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        "-m",
        "ptdp.train",
        *LAYOUT,
        *FLAGS,
        "--data",
        str(pp2_dp2_workspace / "docs"),
        "--output-dir",
        str(tmp_path / "two-nodes"),
    ]
    procs = run_together([node, node], env=env, cwd=tmp_path)
    assert all(p.returncode == 0 for p in procs), _failed(procs)
    summaries = [p.stderr for p in procs if f"done: {ITERS} iterations" in p.stderr]
    assert len(summaries) == 1, "only global rank 0 prints the summary"
    assert sum(p.stdout.count("[data] prepared data in") for p in procs) == 1, "one launcher's data is used"

    one = pp2_dp2_uninterrupted  # ptdp train, one launcher of 4 workers, the same flags and documents
    assert "tp=1 pp=2 dp=2" in one.stdout

    two_nodes = _metrics(metric_lines(tmp_path / "two-nodes"))
    one_node = _metrics(metric_lines(pp2_dp2_workspace / "whole"))
    assert [r["iteration"] for r in one_node if "loss" in r] == list(range(1, ITERS + 1))
    assert any("val_loss" in r for r in one_node)
    assert two_nodes == one_node  # bitwise: float64 values compared with ==
    prepared = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(prepared) == 1 and not prepared[0].startswith(".tmp"), prepared
