"""``--profile`` (torch.profiler around chosen steps), peak memory, and ``--trace`` spans timed by
events (the CUDA path, run on a CPU with stand-in events)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from ptdp.run.profiling import StepProfiler
from ptdp.run.trace import Tracer


def _work(n: int = 64) -> None:
    a = torch.randn(n, n)
    (a @ a).sum()


@pytest.mark.parametrize(
    "start, end, iterations",
    [
        (1, 3, {2, 3}),
        pytest.param(
            0, 1, {1}, marks=pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
        ),  # no step before
    ],
)
def test_profiler_writes_a_chrome_trace_of_the_chosen_steps(tmp_path, start, end, iterations):
    """Steps [start, end) (0-based) are in the trace; the warm-up step before them is not."""
    prof = StepProfiler(rank=1, ranks=(0, 1), start=start, end=end, run_dir=tmp_path, device="cpu")
    for step in range(5):
        with prof.around(step):
            _work()
    assert prof.written == tmp_path / "profile" / "rank1.json"
    events = json.loads(prof.written.read_text())["traceEvents"]
    marks = {e["name"] for e in events if e.get("name", "").startswith("ptdp iteration")}
    assert marks == {f"ptdp iteration {i}" for i in iterations}
    assert any(e.get("name") == "aten::mm" for e in events)


def test_profiler_does_nothing_on_other_ranks(tmp_path):
    prof = StepProfiler(rank=2, ranks=(0, 1), start=0, end=2, run_dir=tmp_path, device="cpu")
    for step in range(3):
        with prof.around(step):
            _work()
    assert prof.written is None and not (tmp_path / "profile").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_peak_memory_on_cpu_is_the_process_peak_rss():
    """In a fresh process (this one's peak may be anything): with 256 MiB more touched, the peak is
    at least the resident size before plus 256 MiB, and rose by at most that (VmHWM is in KiB, the
    function gives bytes)."""
    code = (
        "import os, torch; from ptdp.run.profiling import peak_memory_bytes as p; a, kind = p('cpu'); "
        "rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'); "
        "t = torch.ones(256 * 2**20 // 4); b, _ = p('cpu'); print(a, rss, b, kind)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, rss, after, kind = out.stdout.split(maxsplit=3)
    assert kind.strip() == "peak RSS"
    assert int(after) >= int(rss) + 250 * 2**20 and int(after) - int(before) <= 270 * 2**20


class _Event:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)``: records the wall clock."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, like CUDA events


def test_the_peak_so_far_never_falls_when_the_kernel_s_count_does(monkeypatch):
    """VmHWM read twice can fall by a page (Linux's approximate per-CPU page counters): each read
    gives the highest value read so far, so a metrics line never exceeds the run's summary."""
    import ptdp.run.profiling as profiling

    readings = iter([343_568_384, 343_564_288, 350_000_000, 349_995_904])
    monkeypatch.setattr(profiling, "_HIGHEST", [0])
    monkeypatch.setattr(profiling, "_read_peak_rss", lambda: next(readings))
    assert [profiling.process_peak_rss() for _ in range(4)] == [343_568_384, 343_568_384, 350_000_000, 350_000_000]


def test_event_timed_spans_are_read_once_and_placed_on_the_wall_clock():
    syncs = []
    tracer = Tracer(0, 0, make_event=_Event, synchronize=lambda: syncs.append(1))
    tracer.span("outside").end()  # not active: nothing recorded, no event made
    assert tracer.collect() == [] and syncs == []
    tracer.active, tracer.iteration = True, 2
    wall_before = time.time()
    span = tracer.span("optimizer", "optimizer")
    time.sleep(0.05)
    span.end()
    inner = tracer.span("grad sync + clip", "grad_sync")
    time.sleep(0.02)
    inner.end()
    assert len(syncs) == 1  # the anchor's synchronisation; nothing read yet
    events = tracer.collect()
    assert len(syncs) == 2 and tracer.collect() is events and len(syncs) == 2
    first, second = events
    assert first["name"] == "optimizer" and first["args"] == {"iteration": 2}
    assert 50e3 <= first["dur"] < 50e3 + 30e3 and 20e3 <= second["dur"] < 20e3 + 30e3  # microseconds
    assert wall_before * 1e6 - 1e3 <= first["ts"] <= second["ts"] - first["dur"] + 1e3
    assert second["ts"] <= time.time() * 1e6


def test_wall_clock_spans_without_a_device():
    tracer = Tracer(3, 1, "cpu")
    tracer.active = True
    span = tracer.span("optimizer", "optimizer")
    time.sleep(0.01)
    span.end()
    (event,) = tracer.collect()
    assert event["pid"] == 3 and event["dur"] >= 10e3


@pytest.mark.gpu
def test_cuda_event_spans_measure_device_time():
    tracer = Tracer(0, 0, "cuda")
    tracer.active = True
    a = torch.randn(4096, 4096, device="cuda")
    span = tracer.span("forward work", "forward")
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    span.end()  # the host gets here long before the device is done
    (event,) = tracer.collect()
    assert event["dur"] > 0


def test_profile_step_range_is_checked_against_train_iters(tmp_path, capsys, monkeypatch):
    """Megatron-LM's default steps (10, 12) with --train-iters 6: exit 2 naming the numbers, no worker."""
    from helpers.cli import tiny_flags
    from ptdp import cli

    launched = []
    monkeypatch.setattr("ptdp.run.launch.launch_local", lambda *a, **k: launched.append(a) or {"error": "stub"})
    argv = ["train", *tiny_flags(no_progress=True), "--data-cache-dir", str(tmp_path / "cache"), "--profile"]
    assert cli.main(argv) == 2 and not launched
    err = capsys.readouterr().err
    assert "--profile-step-start 10 and --profile-step-end 12" in err and "--train-iters 6" in err
    assert (
        cli.main(
            argv[:-1]
            + [
                "--profile",
                "--profile-step-start",
                "2",
                "--profile-step-end",
                "4",
                "--profile-ranks",
                "0,9",
                "--tp",
                "1",
                "--pp",
                "2",
                "--dp",
                "1",
            ]
        )
        == 2
    )
    assert "--profile-ranks 0,9: each rank must be in [0, world_size=2)" in capsys.readouterr().err
    assert not launched and not (tmp_path / "cache").exists()


def test_profile_fields_round_trip_through_config_json():
    from ptdp.config.schema import Config, TrainConfig

    config = Config(train=TrainConfig(profile=True, profile_ranks=(0, 3)))
    again = Config.from_dict(json.loads(config.to_json()))
    assert again == config and again.train.profile_ranks == (0, 3)


def test_peak_memory_on_cpu_is_not_the_parent_process_peak():
    """A worker started (fork + exec) by a process holding 1 GiB reports its own peak, not the
    parent's (``ru_maxrss`` keeps the forked copy's resident size across the exec)."""
    child = "from ptdp.run.profiling import peak_memory_bytes as p; print(p('cpu')[0])"
    code = (
        "import subprocess, sys; big = b'\\x01' * 2**30; "
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    rss_of_child = int(out.stdout.split()[0])
    assert rss_of_child < 900 * 2**20, rss_of_child


def test_a_resumed_run_profiles_only_the_steps_it_runs(tmp_path):
    """--profile-step-start 1 --profile-step-end 3 (iterations 2-3): a run resumed at iteration 4
    profiles nothing and says so; one resumed at iteration 2 profiles iteration 3 only, without a
    warm-up step before its first; the ranks are listed once."""
    from ptdp.config.schema import Config, TrainConfig
    from ptdp.run.profiling import StepProfiler

    config = Config(
        train=TrainConfig(train_iters=6, profile=True, profile_step_start=1, profile_step_end=3, profile_ranks=(0, 0))
    )

    def profiler(first_step: int, rank: int = 0) -> StepProfiler:
        return StepProfiler.for_run(config, rank, tmp_path, "cpu", first_step=first_step)

    assert profiler(0).summary() == {"iterations": [2, 3], "files": ["profile/rank0.json"]}
    assert profiler(0, rank=1).summary() == profiler(0).summary()  # every rank says the same
    late = profiler(4).summary()
    assert late["iterations"] == [] and late["files"] == [] and "resumed at iteration 4" in late["note"]
    assert not profiler(4).enabled
    assert profiler(2).summary() == {"iterations": [3, 3], "files": ["profile/rank0.json"]}
    mid = profiler(2)
    assert mid.enabled and (mid.first, mid.start, mid.end) == (2, 2, 3)
    for step in (2, 3):
        with mid.around(step):
            torch.ones(4).sum()
    assert mid.written == tmp_path / "profile" / "rank0.json" and mid.written.exists()
