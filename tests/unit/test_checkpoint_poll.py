"""``--async-save``: a checkpoint written in the background becomes ``latest`` at the first poll
(a logged step) after its files are written, not only at the next save."""

from __future__ import annotations

from concurrent.futures import Future

from ptdp.engine.groups import ParallelGroups
from ptdp.run.checkpoint.io import PendingSave
from ptdp.run.checkpoint.saver import Checkpointer


def test_poll_completes_a_written_save_and_leaves_one_still_writing(tmp_path):
    groups = ParallelGroups.single_process()
    saver = Checkpointer(groups, async_save=True)
    tmp, final = tmp_path / "iter_0000002.tmp", tmp_path / "iter_0000002"
    tmp.mkdir()
    (tmp / "shard").write_text("x")
    future: Future = Future()
    saver.pending = PendingSave(future, groups, tmp, final)
    assert saver.poll() is None  # still being written
    assert not final.exists() and not (tmp_path / "latest").exists()
    future.set_result(None)
    assert saver.poll() == final
    assert (final / "shard").read_text() == "x" and (tmp_path / "latest").read_text().strip() == final.name
    assert saver.pending is None and saver.poll() is None
