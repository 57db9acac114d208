"""The training loop of one worker: data, steps, evaluation, metrics, summary, and what stops or
pauses it: steps skipped for non-finite values (:class:`TrainingError` past
``--max-skipped-steps``) and checkpoint saves (one that cannot be written stops training).

Runs inside an initialised process group (``ptdp.train``); every rank executes it, rank 0 logs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from ptdp.config.schema import Config
from ptdp.data.dataset import GlobalBatchSampler, TokenWindows, device_microbatches, dp_shard, eval_indices
from ptdp.data.prepared_data import PreparedData
from ptdp.data.tokenizer import tokenizer_config_beside
from ptdp.engine import activity
from ptdp.engine.comm import all_gather_object, all_reduce
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage, with_vocab
from ptdp.engine.step import NONFINITE_GRAD_NORM, PendingStep, eval_loss, read_results_with, train_step
from ptdp.layout.pipeline.timing import bubble_formula
from ptdp.run.checkpoint.folders import CheckpointError
from ptdp.run.checkpoint.io import load_checkpoint
from ptdp.run.checkpoint.saver import Checkpointer
from ptdp.run.metrics import RunLog, write_json
from ptdp.run.planner_report import check_run, measure_stage, moe_exchange_seconds
from ptdp.run.profiling import StepProfiler, peak_memory_bytes
from ptdp.run.throughput import Throughput
from ptdp.run.trace import Tracer, bubble_by_rank, write_trace
from ptdp.run.tracking import Trackers


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. more than ``max_skipped_steps`` steps in a row had a nan/inf loss
    or gradient norm, or a checkpoint would hold non-finite values); all ranks raise it."""


def non_finite_step(result, iteration: int, in_a_row: int, limit: int, log: RunLog, codec: str = "none") -> None:
    """A step skipped for a nan/inf loss or gradient norm: a warning, or :class:`TrainingError`
    (on every rank alike) when it makes more than ``limit`` such steps in a row. With
    ``--grad-compression fp16`` (``codec``) a non-finite norm after a finite loss says that a mean
    gradient beyond float16's range overflows it."""
    what = (
        f"loss {result.loss} / gradient norm {result.grad_norm} is not finite at iteration {iteration} "
        f"({result.skip_reason} on some rank)"
    )
    if codec == "fp16" and result.skip_reason == NONFINITE_GRAD_NORM and math.isfinite(result.loss):
        what += (
            " (with --grad-compression fp16 a mean gradient above 65,504 overflows float16; "
            "--grad-compression bf16 has float32's range)"
        )
    if in_a_row > limit:
        log.close()
        raise TrainingError(
            f"{what}: {in_a_row} such steps in a row, more than --max-skipped-steps {limit}; "
            f"stopping (try a lower --lr or --clip-grad, or check the data)"
        )
    log.message(f"warning: {what}; the step is skipped on every rank, no update ({in_a_row} in a row, at most {limit})")


def tokenizer_files(data: PreparedData, tokenizer_model: str | None) -> dict[str, Path]:
    """What a checkpoint keeps of the run's tokenizer: its ``tokenizer.json`` and, for a
    ``--tokenizer-model`` with one beside it, the ``tokenizer_config.json`` naming its special
    tokens (``ptdp convert to-hf`` writes them out as given), or the one the prepared data hold
    (written for an ``--eod-token`` added to the tokenizer)."""
    files = {"tokenizer.json": Path(data.tokenizer_path)}
    config = tokenizer_config_beside(data.tokenizer_path) if tokenizer_model else None
    config = config or (tokenizer_config_beside(tokenizer_model) if tokenizer_model else None)
    return files | ({"tokenizer_config.json": config} if config else {})


def save_and_log(
    saver: Checkpointer, stage, ck, iteration: int, consumed_samples: int, log: RunLog, files: dict[str, Path]
) -> None:
    """Save a checkpoint (after completing one still being written, ``--async-save``); one that
    cannot be written (e.g. non-finite values, refused on every rank) stops training with
    :class:`TrainingError`."""
    start = time.perf_counter()
    activity.set_phase(activity.CHECKPOINT, iteration)
    try:
        folder, earlier = saver.save(
            stage,
            ck.save,
            iteration,
            consumed_samples=consumed_samples,
            keep_last=ck.keep_last,
            files=files,
        )
    except CheckpointError as e:
        log.close()
        raise TrainingError(str(e)) from e
    if earlier is not None:
        log.message(f"iteration {iteration:>6}: saved checkpoint {earlier} (written in the background)")
    took = f"{time.perf_counter() - start:.1f} s"
    log.message(
        f"iteration {iteration:>6}: checkpoint {folder} staged in CPU memory ({took}), written in the background"
        if saver.async_save
        else f"iteration {iteration:>6}: saved checkpoint {folder} ({took})"
    )


def complete_save(complete, log: RunLog) -> None:
    """Complete a save written in the background (``--async-save``): ``complete`` is the saver's
    ``wait`` (every rank waits for it) or ``poll`` (only once every rank has written it)."""
    try:
        folder = complete()
    except CheckpointError as e:
        log.close()
        raise TrainingError(str(e)) from e
    if folder is not None:
        log.message(f"saved checkpoint {folder} (written in the background)")


def train(
    config: Config,
    groups: ParallelGroups,
    data: PreparedData,
    run_dir: Path,
    device: torch.device,
    *,
    progress: bool = True,
    restart: int = 0,
) -> dict:
    """Train ``config.train.train_iters`` steps; returns the summary (same on every rank).

    Evaluates the validation loss before the first step, every ``eval_interval`` steps and after
    the last. ``config.model.vocab_size`` is replaced by the tokenizer's real size. ``restart``:
    the launcher's restart count (:mod:`ptdp.run.restart`; ``config`` already points ``load`` at the
    checkpoint to resume from), marked on the metrics lines.
    """
    config = with_vocab(config, data.vocab_size)
    t, ck = config.train, config.checkpoint
    stage = build_stage(config, groups, device)
    start, consumed, note = 0, 0, None  # resumed runs continue from the checkpoint's sample position
    saver = Checkpointer(groups, async_save=ck.async_save) if ck.save or ck.load else None
    if ck.load:
        meta = load_checkpoint(
            stage,
            ck.load,
            load_optimizer=not ck.no_load_optim,
            load_rng=not ck.no_load_rng,
            group=saver.group if saver is not None else None,
        )
        start, consumed, note = meta["iteration"], meta["consumed_samples"], meta.get("residual_note")
        if start >= t.train_iters:
            raise CheckpointError(
                f"checkpoint {ck.load} is at iteration {start}: --train-iters {t.train_iters} leaves nothing to train"
            )
    log = RunLog(
        run_dir,
        enabled=groups.global_rank == 0,
        total_iters=t.train_iters,
        progress=progress,
        restart=restart,
        trackers=Trackers(config, run_dir) if groups.global_rank == 0 else None,
    )
    if note:
        log.message(f"warning: {note}")
    loop = _Loop(config, groups, data, stage, log, start, consumed, run_dir=Path(run_dir), saver=saver)
    if restart:
        log.restarted(start, ck.load)
    elif ck.load:
        log.message(f"resumed from {ck.load} at iteration {start}")
    started = time.perf_counter()
    loop.evaluate(start)
    for it in range(start, t.train_iters):
        loop.step(it)
    loop.flush()
    loop.evaluate(t.train_iters)
    stage.wait_for_params()
    if ck.save and saver is not None:  # --save always has a saver
        files = tokenizer_files(data, config.data.tokenizer_model)
        save_and_log(saver, stage, ck, t.train_iters, loop.samples_before(t.train_iters), log, files)
        complete_save(saver.wait, log)  # the end of training waits for a save in the background
    log.close()
    return loop.finish(Path(run_dir), time.perf_counter() - started)


class _Loop:
    """The state of one worker's training loop: data, evaluation, history, trace."""

    def __init__(
        self,
        config: Config,
        groups: ParallelGroups,
        data: PreparedData,
        stage,
        log: RunLog,
        start: int,
        consumed: int,
        *,
        run_dir: Path = Path("."),
        saver: Checkpointer | None = None,
    ) -> None:
        t = config.train
        self.config, self.groups, self.data, self.stage, self.log = config, groups, data, stage, log
        self.start, self.consumed = start, consumed
        self.train_windows = TokenWindows(data.train_tokens(), config.model.seq_length)
        self.sampler = GlobalBatchSampler(len(self.train_windows), t.global_batch_size, t.seed)
        self.valid_batches = _valid_batches(config, groups, data, stage.device)
        self.throughput = Throughput.for_run(config, stage.device)
        """Turns a step time into tokens/s, TFLOP/s per GPU and MFU (:mod:`ptdp.run.throughput`)."""
        self.history: dict[str, Any] = {"val": [], "train": [], "comm": {}}
        self.tracer = Tracer(groups.global_rank, groups.pp.rank, stage.device) if t.traced_iters else None
        self.profiler = StepProfiler.for_run(config, groups.global_rank, run_dir, stage.device, first_step=start)
        self.first_traced = 2 if t.train_iters >= 2 else 1
        self.skipped_in_a_row = 0
        self.saver = saver
        """Checkpoint saves over their own gloo group (``--save``; it also served ``--load``)."""
        self.pending: list[tuple[int, PendingStep]] = []
        """Steps not read to the host yet (1-based iteration, its pending metrics)."""
        self.interval_start: float | None = None
        p = config.parallel
        self.moe_exchange_s: list[float] | None = None
        """Host seconds of each step's MoE row exchanges, for the planner report: CPU runs with ep or
        etp > 1 (gloo's exchanges are synchronous); None otherwise (on CUDA timing them would make
        the host wait inside the step)."""
        if config.moe.enabled and p.ep * p.etp > 1 and stage.device.type == "cpu":
            groups.stats.clock = True
            self.moe_exchange_s = []

    def samples_before(self, iteration: int) -> int:
        """Global samples consumed before 0-based step ``iteration`` (the data position)."""
        return self.consumed + (iteration - self.start) * self.config.train.global_batch_size

    def evaluate(self, iteration: int) -> None:
        if not self.valid_batches:
            return
        activity.set_phase(activity.EVALUATION, iteration)
        val = eval_loss(self.stage, self.valid_batches)
        self.history["val"].append((iteration, val))
        self.log.write({"iteration": iteration, "val_loss": val})
        self.log.message(f"iteration {iteration:>6}: validation loss {val:.4f}")

    def step(self, it: int) -> None:
        """0-based step ``it``: train, log, evaluate and save when due."""
        t, ck, g, iteration = self.config.train, self.config.checkpoint, self.groups, it + 1
        if self.tracer is not None:
            self.tracer.iteration = iteration
            self.tracer.active = self.first_traced <= iteration < self.first_traced + t.traced_iters
        mine = dp_shard(self.sampler.global_batch(self.samples_before(it)), g.dp.rank, g.dp.size)
        g.stats.reset()
        if self.interval_start is None:
            self.interval_start = time.perf_counter()
        mbs = device_microbatches(self.train_windows, mine, t.micro_batch_size, self.stage.device)
        with self.profiler.around(it):
            self.pending.append((iteration, train_step(self.stage, mbs, it, self.tracer)))
        self.history["comm"] = g.stats.as_dict()
        if self.moe_exchange_s is not None:
            self.moe_exchange_s.append(moe_exchange_seconds(self.config, g.stats))
        evaluate = iteration % t.eval_interval == 0 and iteration != t.train_iters
        save = bool(ck.save and ck.save_interval and iteration % ck.save_interval == 0 and iteration != t.train_iters)
        if evaluate or save or iteration % t.log_interval == 0 or iteration in (1, t.train_iters):
            self.flush()
            if self.saver is not None and self.saver.async_save and not save:
                complete_save(self.saver.poll, self.log)
        if evaluate:
            self.evaluate(iteration)
        if save and self.saver is not None:  # --save always has a saver
            files = tokenizer_files(self.data, self.config.data.tokenizer_model)
            save_and_log(self.saver, self.stage, ck, iteration, self.samples_before(iteration), self.log, files)
        if evaluate or save:
            self.interval_start = None  # the next interval's time starts at its first step

    def flush(self) -> None:
        """Read the steps since the last flush to the host in one synchronisation
        (:func:`~ptdp.engine.step.read_results_with`) and record them in order. Called at logged steps and
        before an evaluation or a checkpoint, so unlogged steps never wait for the device. Each step gets
        the interval's mean step time and the largest rank's peak memory so far (a max all-reduce).
        """
        if not self.pending:
            return
        if self.interval_start is None:  # step() sets it before a step joins pending
            raise RuntimeError("steps are pending without the start of their interval")
        results, reduced = read_results_with([step for _, step in self.pending], self._peak_memory())
        step_time = (time.perf_counter() - self.interval_start) / len(results)
        self.interval_start = time.perf_counter()
        done, self.pending = self.pending, []
        for (iteration, _), result in zip(done, results):
            self._record(result, iteration, step_time, int(reduced[0]))

    def _peak_memory(self) -> torch.Tensor:
        """A float64 ``[5]`` tensor on the stage's device whose first value is the largest peak
        memory of any rank in bytes (:func:`~ptdp.run.profiling.peak_memory_bytes`; a max
        all-reduce over the world, not read here; the other values are 0). The host value is copied
        from pinned memory on CUDA, so nothing waits for the device."""
        host = torch.zeros(5, dtype=torch.float64)
        host[0] = peak_memory_bytes(self.stage.device)[0]
        if self.stage.device.type == "cuda":
            host = host.pin_memory()
        return all_reduce(host.to(self.stage.device, non_blocking=True), self.groups.world, op="max", tag="peak memory")

    def _record(self, result, iteration: int, step_time: float, peak_memory: int) -> None:
        """Log one step read to the host: its metrics line (logged steps and skipped steps; with
        the throughput of :class:`~ptdp.run.throughput.Throughput` and ``peak_memory`` bytes), the
        progress bar, and the warning or :class:`TrainingError` of a non-finite step."""
        t = self.config.train
        record = {
            "iteration": iteration,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "step_time_s": step_time,
            **self.throughput.of(step_time),
            "peak_memory_bytes": peak_memory,
        }
        self.history["train"].append(record)
        if result.moe is not None:  # mixture of experts: balancing losses, drops, load
            record.update(result.moe)
        if result.loss_scale is not None:  # float16: the scale the step used
            record["loss_scale"] = result.loss_scale
        if result.skipped:  # on every rank, without any update (ptdp.engine.step)
            record.update(skipped=True, reason=result.skip_reason)
        if result.skipped or iteration % t.log_interval == 0 or iteration in (1, t.train_iters):
            self.log.write(record)
        max_load = result.moe["moe_max_load"] if result.moe is not None else None
        self.log.step(iteration, result.loss, step_time, record["tokens_per_s"], result.lr, max_load)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if result.nonfinite else 0
        if result.nonfinite:
            non_finite_step(
                result,
                iteration,
                self.skipped_in_a_row,
                t.max_skipped_steps,
                self.log,
                self.config.parallel.grad_compression,
            )

    def finish(self, run_dir: Path, elapsed: float) -> dict:
        """The summary (same on every rank); rank 0 adds the bubble and the planner's comparison
        and writes summary.json (and the trace)."""
        g, is_logger = self.groups, self.groups.global_rank == 0
        summary = _summary(self.config, self.history, elapsed)
        if summary["mean_step_time_s"]:  # TFLOP/s per GPU and MFU of the mean step (tokens/s: _summary's)
            summary.update(
                {k: v for k, v in self.throughput.of(summary["mean_step_time_s"]).items() if k != "tokens_per_s"}
            )
        mine = measure_stage(self.stage)
        if self.moe_exchange_s:  # the steady steps' mean, as the step time's
            steady = self.moe_exchange_s[1:] or self.moe_exchange_s
            mine["moe_exchange_s"] = sum(steady) / len(steady)
        per_rank = all_gather_object(mine, g.world)
        if self.tracer is not None:
            events = [e for rank_events in all_gather_object(self.tracer.collect(), g.world) for e in rank_events]
            if is_logger:
                summary["bubble"] = _write_trace(self.config, g, events, run_dir)
        peaks = all_gather_object(peak_memory_bytes(self.stage.device), g.world)
        summary["peak_memory_bytes_by_rank"] = {r: peak for r, (peak, _) in enumerate(peaks)}
        summary["peak_memory_measure"] = peaks[0][1]
        if self.profiler.summary():
            summary["profile"] = self.profiler.summary()
        if is_logger:
            loads = [r["moe_max_rank_load"] for r in self.history["train"] if "moe_max_rank_load" in r]
            summary["planner_check"] = check_run(
                self.config,
                per_rank,
                summary["mean_step_time_s"],
                moe_max_rank_load=sum(loads) / len(loads) if loads else None,
            )
            write_json(run_dir / "summary.json", summary)
        return summary


def _write_trace(config: Config, groups: ParallelGroups, events: list[dict], run_dir: Path) -> dict:
    """trace.json + timeline.png; returns the measured bubble per rank, 1F1B's formula and the
    schedule's own (with F = B = W, :func:`~ptdp.layout.pipeline.timing.bubble_formula`)."""
    layout = groups.layout
    labels = {}
    for r in range(layout.world_size):
        c = layout.coords(r)
        cp = f" cp{c.cp_rank}" if layout.cp > 1 else ""
        labels[r] = f"rank {r} (tp{c.tp_rank}{cp} dp{c.dp_rank} pp{c.pp_rank})"
    write_trace(events, run_dir, labels)
    p = config.parallel
    v, m = config.pipeline.virtual_stages, config.num_microbatches
    formula, value = bubble_formula(p.schedule, p.pp, m, v)
    return {
        "measured_idle_over_compute_by_rank": bubble_by_rank(events),
        "formula_(p-1)/(v*m)": (p.pp - 1) / (v * m),
        "schedule": p.schedule,
        "schedule_formula": formula,
        "schedule_formula_value": value,
        "files": ["trace.json", "timeline.png"],
    }


def _valid_batches(config: Config, groups: ParallelGroups, data: PreparedData, device: torch.device) -> list:
    """The fixed validation batches, this rank's microbatches of each, on ``device`` (copied once)."""
    t = config.train
    if t.eval_iters == 0:
        return []
    windows = TokenWindows(data.valid_tokens(), config.model.seq_length)
    return [
        device_microbatches(windows, dp_shard(batch, groups.dp.rank, groups.dp.size), t.micro_batch_size, device)
        for batch in eval_indices(len(windows), t.global_batch_size, t.eval_iters)
    ]


def _summary(config: Config, history: dict, elapsed: float) -> dict:
    train_hist, val = history["train"], history["val"]
    times = [r["step_time_s"] for r in train_hist]
    steady = times[1:] or times
    tokens = config.train.global_batch_size * config.model.seq_length
    p = config.parallel
    return {
        "layout": {
            "tp": p.tp,
            "cp": p.cp,
            "pp": p.pp,
            "dp": p.dp,
            "world_size": config.world_size,
            "num_microbatches": config.num_microbatches,
        },
        "iterations": len(train_hist),
        "skipped_steps": sum(1 for r in train_hist if r.get("skipped")),
        "vocab_size": config.model.vocab_size,
        "first_loss": train_hist[0]["loss"] if train_hist else None,
        "final_loss": train_hist[-1]["loss"] if train_hist else None,
        "initial_val_loss": val[0][1] if val else None,
        "final_val_loss": val[-1][1] if val else None,
        "val_loss_ratio": val[-1][1] / val[0][1] if len(val) > 1 else None,
        "mean_step_time_s": sum(steady) / len(steady) if steady else None,
        "tokens_per_s": tokens * len(steady) / sum(steady) if steady else None,
        "elapsed_s": elapsed,
        "comm_per_step_rank0": history["comm"],
        "grad_compression": p.grad_compression,
        "last_step_reduced_exactly": p.grad_compression != "none"
        and config.train.train_iters <= config.grad_compression_warmup,
    }
