"""Experiment trackers: TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Optional extras (``ptdp[tensorboard]``, ``ptdp[wandb]``); a missing one stops the run before any
worker starts (:func:`check_trackers`). Global rank 0 logs the same records as ``metrics.jsonl``
(nothing extra is read from the device); scalar names are :data:`SCALARS`, the step is the line's
``iteration``. W&B mode: ``$WANDB_MODE``, else ``online`` with ``$WANDB_API_KEY``, else ``offline``
(under ``--wandb-save-dir``; ``wandb sync`` uploads later). A restarted run logs into the same W&B
run (id in :data:`WANDB_ID_FILE`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ptdp.config.schema import Config
from ptdp.errors import ConfigError

#: metrics.jsonl field -> tracker scalar name.
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "step_time_s": "train/step_time_s",
    "val_loss": "val/loss",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops_per_gpu": "throughput/tflops_per_gpu",
    "mfu": "throughput/mfu",
    "peak_memory_bytes": "memory/peak_bytes",
    "moe_aux_loss": "moe/aux_loss",
    "moe_z_loss": "moe/z_loss",
    "moe_dropped_fraction": "moe/dropped_fraction",
    "moe_max_load": "moe/max_load",
    "moe_max_rank_load": "moe/max_rank_load",
    "moe_expert_bias_min": "moe/expert_bias_min",
    "moe_expert_bias_max": "moe/expert_bias_max",
}

TOKENS_PER_EXPERT = "moe_tokens_per_expert"
"""The metrics line's ``{layer: [E] tokens}`` of an MoE step: per layer the scalar
``moe/max_load/layer<L>`` (most loaded expert over the mean) and the histogram
``moe/tokens_per_expert/layer<L>``."""

#: tracker -> (the package it needs, the extra that installs it, the flag asking for it, the module
#: rank 0 imports for it: :class:`Trackers`).
EXTRAS = {
    "tensorboard": ("tensorboard", "ptdp[tensorboard]", "--tensorboard-dir", "torch.utils.tensorboard"),
    "wandb": ("wandb", "ptdp[wandb]", "--wandb-project", "wandb"),
}


def requested(config: Config) -> list[str]:
    """The trackers ``config`` asks for (keys of :data:`EXTRAS`)."""
    t = config.train
    return [name for name, on in (("tensorboard", t.tensorboard_dir), ("wandb", t.wandb_project)) if on]


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; None in ``sys.modules`` blocks it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def import_problem(module: str) -> str | None:
    """Why ``module`` cannot be imported (its exception on one line), or None when it imports. A
    package that is installed but broken (a dependency missing or too old) raises more than
    ImportError at import time."""
    try:
        importlib.import_module(module)
    except Exception as e:
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
    return None


def check_trackers(config: Config) -> None:
    """Raise ConfigError for a tracker whose package is not installed or cannot be imported
    (:func:`import_problem`: what rank 0 would import, imported here), for ``--wandb-exp-name`` /
    ``--wandb-save-dir`` without ``--wandb-project``, or for a ``--tensorboard-dir`` or
    ``--wandb-save-dir`` that cannot be written (:func:`ptdp.run.paths.folder_problem`); each
    message names the fix or the path and why."""
    from ptdp.run.paths import folder_problem

    t = config.train
    stray = [
        flag
        for flag, value in (("--wandb-exp-name", t.wandb_exp_name), ("--wandb-save-dir", t.wandb_save_dir))
        if value is not None
    ]
    if stray and not t.wandb_project:
        raise ConfigError(f"{' and '.join(stray)} given without --wandb-project: name the W&B project too")
    for name in requested(config):
        module, extra, flag, entry = EXTRAS[name]
        if not installed(module):
            raise ConfigError(f'{flag} needs the {module!r} package, which is not installed: pip install "{extra}"')
        problem = import_problem(entry)
        if problem:
            raise ConfigError(f'{flag}: {entry!r} cannot be imported ({problem}); repair it: pip install "{extra}"')
    for flag, folder in (("--tensorboard-dir", t.tensorboard_dir), ("--wandb-save-dir", t.wandb_save_dir)):
        problem = folder_problem(folder) if folder else None
        if problem:
            raise ConfigError(f"{flag}: {problem}")


def wandb_mode(environ: dict[str, str] | None = None) -> str:
    """``$WANDB_MODE``, else ``online`` with ``$WANDB_API_KEY``, else ``offline``."""
    env = os.environ if environ is None else environ
    return env.get("WANDB_MODE") or ("online" if env.get("WANDB_API_KEY") else "offline")


#: the W&B run id of a run directory, kept in it so that a restart continues the same W&B run
WANDB_ID_FILE = "wandb-run-id"


def _run_id(run_dir: Path | None) -> str | None:
    """The W&B run id of the run directory, passed to ``wandb.init`` with ``resume="allow"``: made
    and written to :data:`WANDB_ID_FILE` by the first attempt, read back by every restart (and by a
    ``--load`` continuing the run in the same folder). No run directory: None (a new W&B run)."""
    if run_dir is None:
        return None
    import secrets

    path = Path(run_dir) / WANDB_ID_FILE
    run_id = path.read_text().strip() if path.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(8)
        path.write_text(run_id + "\n")
    return run_id


class Trackers:
    """The trackers of a run on global rank 0 (an instance with none on the other ranks).

    ``log(record)`` sends a metrics line's numeric fields of :data:`SCALARS` (and an MoE step's
    :data:`TOKENS_PER_EXPERT`) at step ``record["iteration"]``; other lines (restart events) and
    other fields are left out.
    ``close()`` flushes and closes them (W&B: ``finish``).
    """

    def __init__(self, config: Config | None = None, run_dir: Path | None = None) -> None:
        self._tensorboard = self._wandb = None
        if config is None:
            return
        t = config.train
        if t.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(t.tensorboard_dir))
        if t.wandb_project:
            import wandb

            save_dir = Path(t.wandb_save_dir or Path(run_dir or ".") / "wandb")
            save_dir.mkdir(parents=True, exist_ok=True)
            mode: Any = wandb_mode()  # one of wandb's modes, checked by wandb
            run_id = _run_id(run_dir)
            self._wandb = wandb.init(
                project=t.wandb_project,
                name=t.wandb_exp_name or Path(run_dir or ".").name,
                dir=str(save_dir),
                config=config.to_dict(),
                mode=mode,
                id=run_id,
                resume="allow" if run_id else None,
            )

    @property
    def active(self) -> bool:
        return self._tensorboard is not None or self._wandb is not None

    def log(self, record: dict[str, Any]) -> None:
        if not self.active or "iteration" not in record:
            return
        scalars = {
            SCALARS[k]: float(v)
            for k, v in record.items()
            if k in SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        tokens = record.get(TOKENS_PER_EXPERT) or {}
        for layer, counts in tokens.items():
            mean = sum(counts) / len(counts) if counts else 0.0
            scalars[f"moe/max_load/layer{layer}"] = max(counts) / mean if mean > 0 else 0.0
        if not scalars:
            return
        step = int(record["iteration"])
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            for layer, counts in tokens.items():
                self._tensorboard.add_histogram(
                    f"moe/tokens_per_expert/layer{layer}", np.asarray(counts, dtype=np.float64), global_step=step
                )
        if self._wandb is not None:
            import wandb

            histograms = {
                f"moe/tokens_per_expert/layer{layer}": wandb.Histogram(counts) for layer, counts in tokens.items()
            }
            self._wandb.log({**scalars, **histograms}, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
