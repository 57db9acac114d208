"""The trackers: a missing extra is a clear error naming its pip install; TensorBoard gets the
metrics lines' scalars at their iterations; W&B runs offline without an API key."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from ptdp.config.schema import Config, TrainConfig
from ptdp.errors import ConfigError
from ptdp.run import tracking
from ptdp.run.metrics import RunLog
from ptdp.run.tracking import Trackers, check_trackers, wandb_mode


def with_train(**changes) -> Config:
    return Config(train=dataclasses.replace(TrainConfig(), **changes))


@pytest.mark.parametrize(
    "flag, field, module, extra",
    [
        ("--tensorboard-dir", "tensorboard_dir", "tensorboard", "ptdp[tensorboard]"),
        ("--wandb-project", "wandb_project", "wandb", "ptdp[wandb]"),
    ],
)
def test_a_tracker_whose_package_is_missing_is_refused(monkeypatch, flag, field, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to import
    with pytest.raises(ConfigError) as err:
        check_trackers(with_train(**{field: "x"}))
    assert flag in str(err.value) and f'pip install "{extra}"' in str(err.value)
    check_trackers(with_train())  # nothing asked, nothing needed


@pytest.mark.parametrize(
    "flag, field, package, entry",
    [
        ("--tensorboard-dir", "tensorboard_dir", "tensorboard", "torch.utils.tensorboard"),
        ("--wandb-project", "wandb_project", "wandb", "wandb"),
    ],
)
def test_a_tracker_whose_package_is_installed_but_broken_is_refused(tmp_path, monkeypatch, flag, field, package, entry):
    """A package that is found but fails to import (e.g. a protobuf it needs is missing) is named
    with its error before any worker starts, not raised by rank 0's tracker after the launch."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("raise ImportError(\"No module named 'google.protobuf'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in {package, entry}:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ConfigError) as err:
        check_trackers(with_train(**{field: "x"}))
    message = str(err.value)
    assert flag in message and f"{entry!r} cannot be imported" in message and "google.protobuf" in message


def test_wandb_name_or_folder_without_a_project_is_refused():
    with pytest.raises(ConfigError, match="--wandb-exp-name and --wandb-save-dir given without --wandb-project"):
        check_trackers(with_train(wandb_exp_name="a", wandb_save_dir="b"))
    pytest.importorskip("wandb")  # with a project the package is imported: nothing else is refused
    check_trackers(with_train(wandb_project="p", wandb_exp_name="a"))


def test_a_tracker_folder_that_cannot_be_written_is_refused(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(ConfigError, match=f"--tensorboard-dir: {afile} exists and is not a directory"):
        check_trackers(with_train(tensorboard_dir=str(afile)))
    with pytest.raises(ConfigError, match=f"--wandb-save-dir: {afile / 'wb'} cannot be created: {afile} is a file"):
        check_trackers(with_train(wandb_project="p", wandb_save_dir=str(afile / "wb")))
    check_trackers(with_train(tensorboard_dir=str(tmp_path / "new" / "tb"), wandb_project="p"))
    assert not (tmp_path / "new").exists()  # checked, not created


def test_wandb_is_offline_unless_a_key_or_a_mode_is_given():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}) == "disabled"


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_every_numeric_field_of_the_metrics_lines(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = with_train(tensorboard_dir=str(tmp_path / "tb"))
    log = RunLog(tmp_path, enabled=True, total_iters=2, progress=False, trackers=Trackers(cfg, tmp_path))
    log.write({"iteration": 0, "val_loss": 5.5})
    log.write(
        {
            "iteration": 1,
            "loss": 5.25,
            "grad_norm": 0.5,
            "lr": 1e-3,
            "step_time_s": 0.25,
            "tokens_per_s": 1024.0,
            "tflops_per_gpu": 0.125,
            "mfu": 0.375,
            "peak_memory_bytes": 2**20,
            "skipped": True,
            "reason": "x",
        }
    )
    log.write({"iteration": 2, "loss": float("nan"), "loss_scale": 512.0})
    moe = {"moe_aux_loss": 0.125, "moe_z_loss": 0.5, "moe_dropped_fraction": 0.25, "moe_max_load": 1.5}
    moe |= {"moe_max_rank_load": 1.25, "moe_expert_bias_min": -0.5, "moe_expert_bias_max": 0.25}
    log.write({"iteration": 3, **moe, "moe_tokens_per_expert": {"1": [4, 2, 1, 1], "3": [2, 2, 2, 2]}})
    log.write({"event": "restart", "resumed_from_iteration": 1})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    histogram = events.Histograms("moe/tokens_per_expert/layer1")[0]
    assert histogram.step == 3 and histogram.histogram_value.num == 4 and histogram.histogram_value.sum == 8
    assert histogram.histogram_value.max == 4 and histogram.histogram_value.min == 1
    scalars = read_scalars(tmp_path / "tb")
    assert scalars == {
        "val/loss": [(0, 5.5)],
        "train/loss": [(1, 5.25)],
        "train/grad_norm": [(1, 0.5)],
        "train/lr": [(1, pytest.approx(1e-3))],
        "train/step_time_s": [(1, 0.25)],
        "throughput/tokens_per_s": [(1, 1024.0)],
        "throughput/tflops_per_gpu": [(1, 0.125)],
        "throughput/mfu": [(1, 0.375)],
        "memory/peak_bytes": [(1, 2.0**20)],
        "train/loss_scale": [(2, 512.0)],
        **{f"moe/{k[4:]}": [(3, v)] for k, v in moe.items()},
        "moe/max_load/layer1": [(3, 2.0)],
        "moe/max_load/layer3": [(3, 1.0)],
    }


def test_only_rank_0_tracks_and_no_flag_tracks_nothing(tmp_path):
    assert not Trackers().active and not Trackers(with_train(), tmp_path).active
    log = RunLog(tmp_path, enabled=False, total_iters=1, progress=False, trackers=Trackers())
    assert log.trackers is None
    assert set(tracking.SCALARS) >= {
        "loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "val_loss",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "peak_memory_bytes",
    }


@pytest.mark.parametrize(
    "flags, module, extra",
    [
        (["--tensorboard-dir", "tb"], "tensorboard", "ptdp[tensorboard]"),
        (["--wandb-project", "p", "--wandb-save-dir", "wb"], "wandb", "ptdp[wandb]"),
    ],
)
def test_ptdp_train_exits_2_before_any_worker_when_a_tracker_is_missing(
    tmp_path, capsys, monkeypatch, flags, module, extra
):
    import warnings

    from helpers.cli import tiny_flags
    from ptdp import cli

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # ptdp train sets its own display
    launched = []
    monkeypatch.setattr("ptdp.run.launch.launch_local", lambda *a, **k: launched.append(a))
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        ["train", *tiny_flags(no_progress=True), "--data", str(tmp_path / "none"), "--output-dir", "run", *flags]
    )
    err = capsys.readouterr().err
    assert code == 2 and not launched, err
    assert f'pip install "{extra}"' in err and flags[0] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no tracker folder


def test_a_restarted_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """Every attempt of a run directory passes W&B the same run id with resume="allow" (a new
    directory gets a new id), so restarts continue one W&B run instead of starting one each."""
    import types

    calls: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = with_train(wandb_project="p")
    for run_dir in (tmp_path / "run", tmp_path / "run", tmp_path / "other"):
        run_dir.mkdir(exist_ok=True)
        Trackers(config, run_dir).close()
    first, restart, other = calls
    assert first["resume"] == restart["resume"] == other["resume"] == "allow"
    assert first["id"] == restart["id"] == (tmp_path / "run" / tracking.WANDB_ID_FILE).read_text().strip()
    assert other["id"] != first["id"] and len(first["id"]) == 16
