"""``ptdp topo`` as a command (a process of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import budget

DATA = Path(__file__).parents[1] / "data" / "topo"
HGX = str(DATA / "hgx_a100_8gpu_nvswitch.txt")


def test_installed_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "ptdp.cli", "topo", "--file", HGX, "--tp", "16", "--dp", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=budget.seconds(),
    )
    assert proc.returncode == 0, proc.stderr
    placement = json.loads(proc.stdout)["placement"]
    assert placement["num_nodes"] == 2 and placement["tp_link_kind"] == "network"
    assert placement["warnings"][0].startswith("tp=16 is larger than the 8 GPUs per node")
