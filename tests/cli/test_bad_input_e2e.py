"""Bad input to ``ptdp train`` answered before any worker: a busy master port under torchrun fails
at start-up, a bad --cp exits 2 (the in-process cases are in tests/unit/test_bad_input.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import budget
from helpers.cli import run, tiny_flags


@pytest.mark.timeout(90)
def test_busy_master_port_under_torchrun_fails_at_once_and_writes_nothing(tmp_path):
    """``ptdp train`` picks its own free port; under torchrun the port is torchrun's flag. With the
    static rendezvous a port another program holds fails at start-up (EADDRINUSE) before any
    ptdp code runs (docs/multi-node.md says what c10d does instead)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(os.environ, PTDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "ptdp.train",
                "--tp",
                "1",
                "--pp",
                "1",
                "--output-dir",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=budget.seconds(80),
            env=env,
            cwd=tmp_path,
        )
    assert proc.returncode != 0
    assert "EADDRINUSE" in proc.stderr or "address already in use" in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_a_bad_cp_exits_2_before_any_worker(tmp_path):
    proc = run(
        [
            sys.executable,
            "-m",
            "ptdp.cli",
            "train",
            *tiny_flags(),
            "--nproc-per-node",
            "3",
            "--tp",
            "1",
            "--pp",
            "1",
            "--cp",
            "3",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "seq_length=32 is not divisible by 2*context_parallel_size = 2*3 = 6 (rule: seq_length % (2 * cp) == 0"
        in proc.stderr
    ), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
