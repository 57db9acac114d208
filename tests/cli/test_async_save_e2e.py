"""``--async-save`` from the command line: checkpoints written in the background while training
goes on; the end of training waits for the last one; resuming equals the uninterrupted run."""

from __future__ import annotations

from helpers.cli import save_and_resume


def test_async_save_and_resume_from_the_command_line(corpus, tmp_path, uninterrupted):
    """6 iterations in one run (the session's ``uninterrupted`` run) == 3 with an asynchronous save
    after each (the last completed by the end of training, --keep-last 2), then resumed from the
    newest for 3 more (bitwise)."""
    _, _, first, _ = save_and_resume(corpus, tmp_path, uninterrupted, ("--async-save",))
    assert "written in the background" in first.stderr, first.stderr[-3000:]
