"""``ptdp train --hardware-profile FILE``: a file that is missing or not a profile written by
``ptdp plan --calibrate`` is a bad request, refused before any worker starts (exit 2, naming the
path), as ``ptdp plan`` refuses it."""

from __future__ import annotations

import json
import warnings

import pytest

from helpers.cli import tiny_flags
from ptdp import cli


@pytest.mark.parametrize("content", [None, "{}", "not json"])
def test_ptdp_train_refuses_a_bad_hardware_profile_before_any_worker(tmp_path, capsys, monkeypatch, content):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # ptdp train sets its own display
    launched = []
    monkeypatch.setattr("ptdp.run.launch.launch_local", lambda *a, **k: launched.append(a))
    monkeypatch.chdir(tmp_path)
    profile = tmp_path / "profile.json"
    if content is not None:
        profile.write_text(content, encoding="utf-8")
    code = cli.main(
        [
            "train",
            *tiny_flags(no_progress=True),
            "--data",
            str(tmp_path / "none"),
            "--output-dir",
            "run",
            "--hardware-profile",
            str(profile),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not launched, err
    assert f"--hardware-profile: {profile} is not a hardware profile written by `ptdp plan --calibrate`" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_calibrated_profile_is_accepted(tmp_path):
    import dataclasses

    from ptdp.config.schema import Config
    from ptdp.planner.inputs.hardware import CATALOG
    from ptdp.planner.time.constants import DEFAULT_CONSTANTS
    from ptdp.run.preflight import check_hardware_profile

    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {"gpu": dataclasses.asdict(CATALOG["a100-80gb"]), "constants": dataclasses.asdict(DEFAULT_CONSTANTS)}
        ),
        encoding="utf-8",
    )
    check_hardware_profile(Config(hardware_profile=str(path)))  # no error
    check_hardware_profile(Config())  # none given: the default profile is optional
