"""The run directory: resolved config, per-iteration metrics (JSON lines), summary; and the live
progress bar. Only global rank 0 writes."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunLog:
    """Writes ``metrics.jsonl`` (one JSON object per line) and a progress bar, on rank 0 only.

    Training lines: ``iteration, loss, grad_norm, lr, step_time_s, tokens_per_s, tflops_per_gpu, mfu,
    peak_memory_bytes`` (``mfu`` when the peak is known; ``loss_scale`` with float16); evaluation lines:
    ``iteration, val_loss``. Units: nats per token, seconds, tokens/s (all ranks), TFLOP/s per GPU,
    fraction, bytes (largest rank's peak). After a restart every line has ``"restart"`` and the file is
    appended to; ``trackers`` get every line too.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_iters: int,
        progress: bool = True,
        restart: int = 0,
        trackers: Any = None,
    ) -> None:
        self.enabled = enabled
        self.restart = restart
        self.trackers = trackers if enabled else None
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._bar = (
            tqdm(total=total_iters, desc="train", unit="it", ncols=bar_width(), file=sys.stderr, mininterval=0.5)
            if enabled and progress
            else None
        )

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            if self.restart:
                record = record | {"restart": self.restart}
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        if self.trackers is not None:
            self.trackers.log(json_safe(record))

    def restarted(self, iteration: int, checkpoint: str | None) -> None:
        """The restart event line, and a message saying where the restarted job resumes."""
        self.write({"event": "restart", "resumed_from_iteration": iteration, "checkpoint": checkpoint})
        where = (
            f"resumed from {checkpoint} at iteration {iteration}"
            if checkpoint
            else "no checkpoint to resume from (no --save, or nothing saved yet): starting from scratch"
        )
        self.message(f"restart {self.restart} of the job: {where}")

    def step(
        self,
        iteration: int,
        loss: float,
        step_time_s: float,
        tokens_per_s: float,
        lr: float,
        max_load: float | None = None,
    ) -> None:
        """Advance the progress bar; ``max_load``: an MoE step's most loaded expert over the mean."""
        if self._bar is not None:
            postfix = {"loss": f"{loss:.3f}"}
            if max_load is not None:  # next to the loss: a narrow bar cuts the end of the line
                postfix["load"] = f"{max_load:.2f}x"  # the most loaded expert over the mean
            postfix |= {"tok/s": f"{tokens_per_s:,.0f}", "step": f"{step_time_s:.2f}s", "lr": f"{lr:.2e}"}
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()


#: Width of the progress bar when the terminal does not say (not a terminal, or 0 columns reported).
FALLBACK_COLUMNS = 100


def bar_width() -> int:
    """The terminal's width in columns (stderr's, where the bar goes), or :data:`FALLBACK_COLUMNS`
    when it reports none or 0 (a bar of width 0 would show no bar at all)."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 0 else FALLBACK_COLUMNS


def json_safe(obj: Any) -> Any:
    """``obj`` with nan/inf floats replaced by None, so the output is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def format_summary(s: dict, run_dir) -> str:
    """The few lines printed at the end of a run."""
    lines = [f"done: {s['iterations']} iterations in {s['elapsed_s']:.1f} s"]
    if s.get("tokens_per_s"):
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""
        lines.append(
            f"  throughput: {s['tokens_per_s']:,.0f} tokens/s, {s['mean_step_time_s']:.3f} s/step, "
            f"{s.get('tflops_per_gpu', 0.0):.4g} model TFLOP/s per GPU{mfu}"
        )
    if s.get("final_loss") is not None:
        lines.append(f"  train loss: {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s.get("val_loss_ratio") is not None:
        lines.append(
            f"  validation loss: {s['initial_val_loss']:.4f} -> {s['final_val_loss']:.4f} "
            f"({s['val_loss_ratio']:.2f} of its start)"
        )
    dp_bytes = sum(c["bytes"] for k, c in s.get("comm_per_step_rank0", {}).items() if k.startswith("dp/"))
    if dp_bytes:
        exact = " (still in its exact warmup)" if s.get("last_step_reduced_exactly") else ""
        lines.append(
            f"  data-parallel payload of the last step on rank 0: {dp_bytes:,} bytes "
            f"(gradient compression: {s.get('grad_compression', 'none')}{exact})"
        )
    cp_bytes = sum(c["bytes"] for k, c in s.get("comm_per_step_rank0", {}).items() if k.startswith("cp/"))
    if cp_bytes:
        lines.append(
            f"  context-parallel traffic of the last step on rank 0: {cp_bytes:,} bytes (keys, values and "
            f"their gradients over {s['layout'].get('cp')} cp ranks)"
        )
    if s.get("bubble"):
        b = s["bubble"]
        by_rank = b["measured_idle_over_compute_by_rank"]
        lines.append(
            f"  pipeline bubble ({b['schedule']}): idle/compute per rank "
            + ", ".join(f"{r}: {v:.2f}" for r, v in sorted(by_rank.items(), key=lambda kv: int(kv[0])))
            + f"; formula {_formula(b)}; trace.json, timeline.png written"
        )
    if s.get("peak_memory_bytes_by_rank"):
        lines.append(format_peak_memory(s["peak_memory_bytes_by_rank"], s["peak_memory_measure"]))
    if s.get("profile"):
        p = s["profile"]
        if p["iterations"]:
            lines.append(
                f"  torch.profiler trace of iterations {p['iterations'][0]}-{p['iterations'][1]}: "
                + ", ".join(p["files"])
            )
        else:
            lines.append(f"  --profile: {p['note']}")
    if s.get("planner_check"):
        from ptdp.run.planner_report import format_comparison

        lines += format_comparison(s["planner_check"])
    lines.append(f"  run directory: {run_dir} (config.json, metrics.jsonl, summary.json)")
    return "\n".join(lines)


def format_peak_memory(by_rank: dict, measure: str) -> str:
    """One line: every rank's peak memory in MiB (up to 8 ranks), else the largest and smallest."""
    mib = {int(r): b / 2**20 for r, b in by_rank.items()}
    if len(mib) <= 8:
        values = ", ".join(f"{r}: {v:,.0f}" for r, v in sorted(mib.items()))
    else:
        hi, lo = max(mib, key=lambda r: mib[r]), min(mib, key=lambda r: mib[r])
        values = f"largest {mib[hi]:,.0f} (rank {hi}), smallest {mib[lo]:,.0f} (rank {lo}) over {len(mib)} ranks"
    return f"  peak memory per rank, MiB ({measure}): {values}"


def _formula(bubble: dict) -> str:
    """The schedule's bubble formula with its value (1F1B's in a summary written without it)."""
    formula = bubble.get("schedule_formula")
    if formula is None:
        return f"(p-1)/(v m) = {bubble['formula_(p-1)/(v*m)']:.2f}"
    value = bubble.get("schedule_formula_value")
    return formula if value is None else f"{formula} = {value:.2f}"
