"""The run log's progress bar and JSON lines."""

from __future__ import annotations

import io
import os

from ptdp.run import metrics


def test_the_progress_bar_has_a_width_when_the_terminal_reports_zero_columns(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((0, 0)))
    assert metrics.bar_width() == metrics.FALLBACK_COLUMNS
    err = io.StringIO()
    monkeypatch.setattr(metrics.sys, "stderr", err)
    log = metrics.RunLog(tmp_path, enabled=True, total_iters=10, progress=True)
    log.step(1, 3.5, 0.2, 1000.0, 1e-3)
    log._bar.refresh()
    line = err.getvalue().split("\r")[-1]
    assert "|" in line and "1/10" in line and len(line) <= metrics.FALLBACK_COLUMNS
    assert len(line.split("|")[1]) >= 4, line  # the bar itself is drawn (nothing between the | at width 0)
    log.close()


def test_the_progress_bar_follows_the_terminal_width(monkeypatch):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((132, 40)))
    assert metrics.bar_width() == 132

    def no_terminal(fd=None):
        raise OSError("not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    assert metrics.bar_width() == metrics.FALLBACK_COLUMNS


def test_an_moe_step_shows_its_load_balance(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((200, 40)))
    err = io.StringIO()
    monkeypatch.setattr(metrics.sys, "stderr", err)
    log = metrics.RunLog(tmp_path, enabled=True, total_iters=10, progress=True)
    log.step(1, 3.5, 0.2, 1000.0, 1e-3, max_load=1.375)
    assert "load=1.38x" in log._bar.postfix
    log.close()
