"""Run commands (launchers and their workers) as separate process groups with a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import budget


@dataclass
class Finished:
    """A command that ran: its exit status (None: killed at the timeout) and its output."""

    cmd: list[str]
    returncode: int | None
    stdout: str
    stderr: str


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (bound to port 0, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands: list[list[str]], *, timeout: float | None = None, env: dict, cwd: Path) -> list[Finished]:
    """Start all ``commands`` at once, each in its own session (so its workers are in its process
    group), and wait for all of them. Output goes to files (no pipe can fill up and stall a
    launcher). A command still running at ``timeout`` seconds, or one that failed, has its whole
    process group killed (its workers too), and so has every command not yet waited for if this
    function raises. ``timeout`` (default: what is left of the test's budget) always ends before
    the test's own timeout (:mod:`budget`)."""
    timeout = budget.seconds(timeout)
    procs, files, codes = [], [], []
    try:
        for i, cmd in enumerate(commands):
            out, err = open(cwd / f"cmd{i}.out", "w+"), open(cwd / f"cmd{i}.err", "w+")
            files += [out, err]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        results = []
        for i, (cmd, code) in enumerate(zip(commands, codes)):
            out, err = files[2 * i], files[2 * i + 1]
            out.seek(0)
            err.seek(0)
            results.append(Finished(cmd, code, out.read(), err.read()))
        return results
    finally:
        for i, proc in enumerate(procs):
            if i >= len(codes) or codes[i] != 0:  # unfinished, failed, or never waited for
                _kill_group(proc)
        for f in files:
            f.close()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
