"""``ptdp train --profile``: each profiled rank writes a torch.profiler Chrome trace of the chosen
steps into the run directory; the summary gives every rank's peak memory (the session's profiled
run, tests/e2e/conftest.py, which tests/e2e/test_config_files_e2e.py also replays)."""

from __future__ import annotations

import json


def test_profile_writes_traces_and_the_summary_has_peak_memory(profiled_run):
    out, proc = profiled_run.run_dir, profiled_run.proc
    for rank in (0, 1):
        events = json.loads((out / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        marks = {e["name"] for e in events if e.get("name", "").startswith("ptdp iteration")}
        assert marks == {"ptdp iteration 2", "ptdp iteration 3"}  # 0-based steps 1 and 2
        assert any(e.get("name", "").startswith("aten::") for e in events)
    summary = json.loads((out / "summary.json").read_text())
    peaks = summary["peak_memory_bytes_by_rank"]
    assert sorted(peaks) == ["0", "1"] and all(100 * 2**20 < b < 8 * 2**30 for b in peaks.values())
    assert summary["peak_memory_measure"] == "peak RSS"
    assert summary["profile"] == {"iterations": [2, 3], "files": ["profile/rank0.json", "profile/rank1.json"]}
    assert "peak memory per rank, MiB (peak RSS): 0: " in proc.stdout
    assert "profile/rank0.json, profile/rank1.json" in proc.stdout
