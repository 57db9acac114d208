"""Multi-node launch rehearsed on loopback: two torchrun launchers ("nodes") of 2 workers each, joined
by c10d rendezvous on 127.0.0.1, train exactly like one launcher of 4 workers (tp=1 pp=2 dp=2,
float64; ranks are ordered tp-dp-pp, so each node holds one pipeline stage with both of its
data-parallel ranks, and the pipeline transfers cross the nodes): the per-iteration losses,
gradient norms and validation losses are bitwise equal."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from helpers.proc_helpers import free_port, run_together
from helpers.cli import tiny_flags, write_docs


TINY = ["--tp", "1", "--pp", "2", "--dp", "2",
        *tiny_flags(train_iters=3, log_interval=1, params_dtype="float64", no_progress=True)]


def _metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k in ("iteration", "loss", "grad_norm", "val_loss")} for r in records]


def _failed(procs) -> str:
    return "\n".join(f"$ {' '.join(p.cmd[:12])} ...\nexit {p.returncode}\n{p.stderr[-2500:]}" for p in procs)


@pytest.mark.slow
def test_two_launchers_on_loopback_equal_one_launcher(tmp_path):
    docs = write_docs(tmp_path / "docs", 16)
    # A cold data cache: both launchers' local rank 0 tokenize at once; preparation is atomic.
    env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    flags = [*TINY, "--data", str(docs)]
    port = free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex[:8],
            "--local-addr", "127.0.0.1", "--max-restarts", "0",
            "-m", "ptdp.train", *flags, "--output-dir", str(tmp_path / "two-nodes")]
    procs = run_together([node, node], env=env, cwd=tmp_path)
    assert all(p.returncode == 0 for p in procs), _failed(procs)
    summaries = [p.stderr for p in procs if "done: 3 iterations" in p.stderr]
    assert len(summaries) == 1, "only global rank 0 prints the summary"
    assert sum(p.stdout.count("[data] prepared data in") for p in procs) == 1, "one launcher's data is used"

    (one,) = run_together([[sys.executable, "-m", "ptdp.cli", "train", *flags, "--output-dir",
                            str(tmp_path / "one-node")]], env=env, cwd=tmp_path)
    assert one.returncode == 0, _failed([one])
    assert "tp=1 pp=2 dp=2" in one.stdout

    two_nodes, one_node = _metrics(tmp_path / "two-nodes"), _metrics(tmp_path / "one-node")
    assert [r["iteration"] for r in one_node if "loss" in r] == [1, 2, 3]
    assert any("val_loss" in r for r in one_node)
    assert two_nodes == one_node  # bitwise: float64 values compared with ==
    prepared = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(prepared) == 1 and not prepared[0].startswith(".tmp"), prepared
