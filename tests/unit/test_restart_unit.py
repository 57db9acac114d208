"""Restarts, in this process: which checkpoint a restarted job resumes from, and the restart flags
checked before any worker (the restarts themselves: tests/e2e/test_restart.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ptdp.config.flags import config_from_args
from ptdp.config.resolve import resolve
from ptdp.config.train_flags import max_restarts
from ptdp.errors import ConfigError
from ptdp.run.restart import check_torchrun_restarts, resume_config


def _fake_checkpoint(root: Path, iteration: int, complete: bool = True) -> Path:
    folder = root / (f"iter_{iteration:07d}" if complete else f".iter_{iteration:07d}.tmp")
    folder.mkdir(parents=True)
    (folder / "ptdp.json").write_text("{}")
    (folder / ".metadata").write_bytes(b"")
    return folder


def test_resume_config_picks_the_newest_complete_checkpoint_in_save(tmp_path):
    import argparse

    from ptdp.config.train_flags import add_train_arguments

    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    save, load = tmp_path / "save", tmp_path / "load"
    args = parser.parse_args(["--save", str(save), "--load", str(load), "--no-load-optim"])
    config = resolve(config_from_args(args), 8)
    assert resume_config(config, 0) == config, "the first attempt starts as told"
    assert resume_config(config, 1) == config, "nothing saved yet: --load again"
    _fake_checkpoint(save, 3)
    newest = _fake_checkpoint(save, 12)
    _fake_checkpoint(save, 15, complete=False)  # a save that was interrupted
    (save / "iter_0000020").mkdir()  # no ptdp.json: not complete
    resumed = resume_config(config, 1).checkpoint
    assert resumed.load == str(newest) and not resumed.no_load_optim and not resumed.no_load_rng
    assert resume_config(
        dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save=None)), 2
    ) == dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save=None)), (
        "no --save: unchanged"
    )


def test_restart_flags_are_checked_before_any_worker(monkeypatch, capsys):
    from ptdp import cli

    monkeypatch.setattr("ptdp.run.launch.launch_local", lambda *a, **k: pytest.fail("workers started"))
    assert cli.main(["train", "--max-restarts", "-1"]) == 2
    assert "max_restarts=-1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        max_restarts(type("A", (), {"max_restarts": -2})())
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="needs --output-dir .* and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_torchrun_restarts(None)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_torchrun_restarts("run")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    check_torchrun_restarts(None)
