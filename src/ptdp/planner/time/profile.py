"""The hardware profile file that ``ptdp plan --calibrate`` writes and the planner reads.

A profile is a :class:`~ptdp.planner.inputs.hardware.GPUType` ("local") plus the
:class:`~ptdp.planner.time.constants.PerfConstants` that go with it, and the raw measurements, in JSON. The
measuring itself (torch workers) lives in :mod:`ptdp.run.calibration`; this module only reads and
writes the file, so the planner can use a profile without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ptdp.planner.inputs.hardware import GPUType
from ptdp.planner.time.constants import PerfConstants


def default_profile_path() -> Path:
    """``$PTDP_CACHE_DIR/hardware-profile.json`` (default ``~/.cache/ptdp``)."""
    return Path(os.environ.get("PTDP_CACHE_DIR", "~/.cache/ptdp")).expanduser() / "hardware-profile.json"


def save_profile(path: Path, gpu: GPUType, constants: PerfConstants, measurements: dict) -> None:
    """Write the profile to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"gpu": dataclasses.asdict(gpu), "constants": dataclasses.asdict(constants), "measurements": measurements}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_profile(path: str | Path) -> tuple[GPUType, PerfConstants]:
    """The GPU spec and constants saved by ``--calibrate``; ValueError if the file is not one."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        return GPUType(**record["gpu"]), PerfConstants(**record["constants"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a hardware profile written by `ptdp plan --calibrate` ({e})") from None
