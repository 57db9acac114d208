"""The run directory: resolved config, per-iteration metrics (JSON lines), summary; and the live
progress bar. Only global rank 0 writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLog:
    """Writes ``metrics.jsonl`` (one JSON object per line) and a progress bar, on rank 0 only.

    Training lines: ``{"iteration", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}``;
    evaluation lines: ``{"iteration", "val_loss"}``. Units: loss in nats per token, seconds,
    tokens per second (all ranks together).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, total_iters: int, progress: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._bar = (
            tqdm(total=total_iters, desc="train", unit="it", dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
            if enabled and progress
            else None
        )

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def step(self, iteration: int, loss: float, step_time_s: float, tokens_per_s: float, lr: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(
                {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_s:,.0f}", "step": f"{step_time_s:.2f}s",
                 "lr": f"{lr:.2e}"},
                refresh=False,
            )
            self._bar.update(1)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()


def write_json(path: Path, obj: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
