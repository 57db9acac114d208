"""The topology modules import no torch (checked in a fresh interpreter)."""

from __future__ import annotations

from helpers import budget


def test_topology_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, ptdp.topology.node, ptdp.topology.nvsmi, ptdp.topology.sysfs, "
        "ptdp.topology.placement, ptdp.commands.topo; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=budget.seconds())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
