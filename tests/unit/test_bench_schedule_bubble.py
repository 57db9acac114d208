"""The bubble benchmark's arithmetic: the simulated steps it compares with, the computes a program
must run per chunk, its arguments' checks and the error it reports for a kind the runtime rejects."""

from __future__ import annotations

import pytest
import torch

from helpers.bench_scripts import import_scripts
from ptdp.layout.pipeline.program import build_programs
from ptdp.layout.pipeline.timing import StageTimes


@pytest.fixture
def bench(monkeypatch):
    (module,) = import_scripts(monkeypatch, "bench_schedule_bubble")
    return module


def test_simulated_steps_at_p4_m8_and_40_ms(bench):
    """1F1B (m + p - 1)(F + B + W) = 11 x 120 ms; ZB-H1 m (F + B + W) + (p - 1)(F + B - W) (Qi et al. §2)."""
    t = StageTimes(0.04, 0.04, 0.04)
    assert bench.simulated_s("1f1b", 4, 8, 1, t) == pytest.approx(1.32)
    assert bench.simulated_s("zb-h1", 4, 8, 1, t) == pytest.approx(1.08)
    assert bench.simulated_s("gpipe", 4, 8, 1, t) == pytest.approx(1.32)
    assert bench.simulated_s("interleaved-1f1b", 4, 8, 2, t) == pytest.approx(1.14)
    # per-chunk durations: 1 ms more per whole backward on one chunk per rank, 3 on the critical path
    d = t.durations()
    assert bench.simulated_s("1f1b", 4, 8, 1, t, {**d, "backward": d["backward"] + 1e-3}) == pytest.approx(1.331)


def test_expected_calls_count_each_chunks_computes(bench):
    whole = bench.expected_calls(build_programs("interleaved-1f1b", 2, 4, 2)[1], 2)
    assert whole == [{"forward": 4, "backward": 4, "wgrad_inline": 4, "wgrad_queued": 0, "wgrad_run": 0}] * 2
    split = bench.expected_calls(build_programs("zb-h1", 2, 4, 1)[0], 1)
    assert split == [{"forward": 4, "backward": 4, "wgrad_inline": 0, "wgrad_queued": 4, "wgrad_run": 4}]


def test_a_chunk_defers_its_weight_gradient_only_when_its_queue_does(bench):
    durations = StageTimes(0.0, 0.0, 0.0).durations()
    chunk = bench.SleepChunk(durations, bench.stage_weight(0, torch.float64), first=False, last=False)
    x = torch.ones(bench.HIDDEN_SHAPE, dtype=torch.float64, requires_grad=True)
    chunk(x, None).sum().backward()
    inline = chunk.weight.grad.clone()
    chunk.reset()
    with chunk.wgrad_queue.defer():
        chunk(x, None).sum().backward()
    assert chunk.weight.grad is None and len(chunk.wgrad_queue) == 1
    assert chunk.wgrad_queue.run() == 1
    torch.testing.assert_close(chunk.weight.grad, inline, rtol=0, atol=0)
    assert chunk.calls == {"forward": 1, "backward": 1, "wgrad_inline": 0, "wgrad_queued": 1, "wgrad_run": 1}


def test_bad_arguments_exit_2_naming_the_rule(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--pp", "4", "-m", "4", "--kinds", "1f1b", "dualpipev"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "dualpipev needs num_microbatches >= 2 * pp: pp=4, num_microbatches=4" in err and "--kinds" in err
    with pytest.raises(SystemExit):
        bench.parse_args(["--pp", "1"])
    assert "--pp 1: needs at least 2" in capsys.readouterr().err
    args = bench.parse_args([])
    assert (args.pp, args.microbatches, args.forward_ms, args.backward_input_ms, args.backward_weight_ms) == (
        4,
        [8],
        40.0,
        40.0,
        40.0,
    )
