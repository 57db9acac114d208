"""The checkpoint saves (and the ``--load``) of one training run: DCP over a gloo group of its own,
and ``--async-save``.

A :class:`Checkpointer` is built by every rank (collective: it creates the group), so DCP never
talks over NCCL nor shares a group with training, even when ``--async-save``
(``torch.distributed.checkpoint.async_save``) writes in the background. A pending save is completed
at the next save, the end of training, or a logged step once every rank has written
(:meth:`Checkpointer.poll`); only then is the folder renamed and ``latest`` moved to it.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from ptdp.engine.comm import AxisGroup, all_reduce
from ptdp.run.checkpoint.io import PendingSave, start_save


def checkpoint_group(groups, timeout: datetime.timedelta | None = None):
    """A new gloo process group over the whole world for DCP (collective: every rank calls it, in
    the same order); None without torch.distributed (a process on its own), or when the stage's
    world is not torch's (a one-process stage inside a larger test world). A world of one
    process gets one too: on a GPU its default group is NCCL only, and ``async_save`` needs a CPU
    backend. ``timeout``: default the world group's."""
    world = groups.world
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world.size:
        return None
    if timeout is None and world.timeout_s is not None:
        timeout = datetime.timedelta(seconds=world.timeout_s)
    return dist.new_group(ranks=list(range(world.size)), timeout=timeout, backend="gloo", group_desc="ptdp_checkpoint")


class Checkpointer:
    """Saves of one run (module docstring). ``async_save``: write in the background."""

    def __init__(self, groups, *, async_save: bool = False) -> None:
        self.group = checkpoint_group(groups)
        w = groups.world
        self.axis = (
            AxisGroup("checkpoint", w.ranks, w.rank, self.group, w.stats, w.timeout_s)
            if self.group is not None
            else None
        )
        """The checkpoint group as an axis, for :meth:`poll`'s flag (None: a process on its own)."""
        self.async_save = async_save
        self.pending: PendingSave | None = None

    def save(
        self,
        stage,
        root: str | Path,
        iteration: int,
        *,
        consumed_samples: int,
        keep_last: int | None = None,
        files: dict[str, Path] | None = None,
    ) -> tuple[Path, Path | None]:
        """Save after ``iteration`` steps (collective over the world); returns (this save's
        folder, the folder of an earlier save completed first or None). Without ``async_save``
        the folder is complete on return; with it, at the next :meth:`save` or :meth:`wait`.

        Raises:
            CheckpointError: a nan/inf in the state (nothing written), or an earlier background
                write that failed.
        """
        earlier = self.wait()
        pending = start_save(
            stage,
            root,
            iteration,
            consumed_samples=consumed_samples,
            keep_last=keep_last,
            files=files,
            group=self.group,
            async_save=self.async_save,
        )
        if not self.async_save:
            return pending.finish(), earlier
        self.pending = pending
        return pending.final, earlier

    def poll(self) -> Path | None:
        """Complete the save being written if every rank has finished writing its files (collective
        over the world: one all-reduce of a flag on the checkpoint's gloo group, no device
        involved); its folder, or None while some rank is still writing. Called at logged steps,
        it makes a background save ``latest`` soon after it is written instead of at the next save."""
        if self.pending is None:
            return None
        future = self.pending.future
        done = torch.tensor([int(future is None or future.done())], dtype=torch.int32)
        if self.axis is not None:
            all_reduce(done, self.axis, op="min", tag="checkpoint_written")
        return self.wait() if int(done) else None

    def wait(self) -> Path | None:
        """Complete the save being written, if any (collective over the world); its folder, or None."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return pending.finish()
