"""Bad input to ``ptdp train`` under torchrun: a busy master port fails at start-up (a launcher and a
worker run as processes; the in-process cases are in tests/unit/test_bad_input.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers import budget


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
