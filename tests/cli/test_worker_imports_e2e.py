"""What a worker process imports before it trains: neither ``torch._dynamo`` (only ``--compile``
needs it; ``ptdp.engine.eager`` disables the communicating functions lazily) nor
``torch.distributed.checkpoint`` (only saving and loading need it). Each costs every worker process
of every run and test about half a second of CPU at start-up."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import ptdp.train
print(sorted(m for m in ("torch._dynamo", "torch.distributed.checkpoint") if m in sys.modules))
"""


def test_a_worker_imports_neither_dynamo_nor_dcp(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
