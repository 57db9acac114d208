"""Save and load a training state with ``torch.distributed.checkpoint`` (DCP), at any layout.

A root holds ``iter_0000100``-style folders and a ``latest`` file naming the newest complete one. A
folder is written as ``.iter_0000100.tmp`` by all ranks (one ``.distcp`` per rank + ``.metadata``,
then ``ptdp.json`` and ``rng/rank<r>.json``), renamed when every rank is done, and only then is
``latest`` replaced atomically. DCP's collectives run over the given gloo group, never NCCL. Nothing
is cloned on the device or pickled (tensors via DCP, the rest JSON). A nan/inf in the state on any
rank stops every rank before anything is written.

Stored per parameter, layout-independent (:mod:`ptdp.run.checkpoint.tensors`; cp and dp replicas
written once, distributed-optimizer shards assembled): ``model/<name>``, ``optim/exp_avg/<name>``,
``optim/exp_avg_sq/<name>``, ``optim/main/<name>`` for 16-bit parameters (routed experts by
global expert index, whatever ep); ``optim/step``; ``moe/<layer>.expert_bias`` and
``moe/<layer>.global_counts``; ``fp8/<linear>.amax_history`` (delayed FP8 scaling, restored when the
run's history has the same length);
``residual/rank<r>`` (1-bit error feedback). The residual and ``rng/rank<r>.json`` (Python, NumPy,
torch and dropout streams) are restored only at the same layout (and without ``--no-load-rng``);
otherwise the dropout streams are reseeded from the checkpoint's iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import torch

from ptdp.config.moe import MoEConfig
from ptdp.engine.comm import AxisGroup, all_gather_object, barrier
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.tensor_parallel.sharding import global_param
from ptdp.run.checkpoint.folders import (
    FORMAT,
    META,
    CheckpointError,
    _first_line,
    _open,
    complete_checkpoints,
    residual_note,
    stored_moe,
)
from ptdp.run.checkpoint.optim_state import MOMENTS, gather_local_state, load_local_state, state_kinds, step_count
from ptdp.run.checkpoint.rng_state import host_rng_state, set_host_rng_state
from ptdp.run.checkpoint.tensors import expert_stored_form, stored_form, to_checkpoint_value


@contextlib.contextmanager
def _quiet():
    """DCP's deprecation notice for ShardedTensor, which ptdp needs for uneven vocabulary shards
    (DTensor cannot express them), once per tensor: not for users' eyes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process.*")
        yield


def _barrier(stage) -> None:
    barrier(stage.groups.world)


def _layout_key(stage) -> dict:
    p = stage.config.parallel
    split = stage.config.pipeline.layer_split  # the first/last stage counts as the split they give
    key = {
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "virtual_stages": stage.virtual_stages,
        "ddp_bucket_size": p.ddp_bucket_size,
        "use_distributed_optimizer": p.use_distributed_optimizer,
        "pipeline_layer_split": list(split) if split else None,
    }
    if p.cp > 1:  # absent at cp = 1, as in checkpoints written before context parallelism
        key["cp"] = p.cp
    if p.ep > 1:  # likewise before expert parallelism
        key["ep"] = p.ep
    return key


def _state_dict(
    stage, tensors: dict[int, dict[str, torch.Tensor]], model_values: dict[int, torch.Tensor], kinds: tuple[str, ...]
) -> dict:
    """DCP state dict: every entry in stored form (ShardedTensor over tp where split)."""
    g = stage.groups
    sd = {}
    for name, p in global_named_parameters(stage.model):
        spec = getattr(p, "ptdp_expert", None)
        if spec is not None:  # by global expert index, split over ep x etp (experts.ExpertParam)
            value = partial(_expert_value, spec=spec, groups=g)
        else:
            value = partial(_value, spec=global_param(p), tp=g.tp, global_rank=g.global_rank)
        sd[f"model/{name}"] = value(model_values[id(p)])
        for kind in kinds:
            sd[f"optim/{kind}/{name}"] = value(tensors[id(p)][kind])
    return sd


def _value(local: torch.Tensor, *, spec, tp, global_rank: int):
    return to_checkpoint_value(stored_form(local, spec, tp.rank, tp.size), tp, global_rank)


def _expert_value(local: torch.Tensor, *, spec, groups: ParallelGroups):
    one = AxisGroup.single("ep", groups.global_rank, groups.stats)
    ep, etp, ep_etp = groups.ep or one, groups.etp or one, groups.ep_etp or one
    form = expert_stored_form(local, spec, ep_rank=ep.rank, ep=ep.size, etp_rank=etp.rank, etp=etp.size)
    return to_checkpoint_value(form, ep_etp, groups.global_rank)


def moe_buffers(moe: MoEConfig) -> set[str]:
    """The MoE layers' state outside the parameters that ``moe`` creates: the expert biases
    (aux-loss-free balancing) and ``global_aux_loss``'s counts of the previous step."""
    kinds = set()
    if moe.moe_router_enable_expert_bias:
        kinds.add("expert_bias")
    if moe.moe_router_load_balancing_type == "global_aux_loss":
        kinds.add("global_counts")
    return kinds


def _moe_buffers(stage, saved: MoEConfig | None = None) -> dict[str, torch.Tensor]:
    """``moe/<layer>.<buffer>`` of :func:`moe_buffers`, the same on every rank of a stage; with
    ``saved`` (a checkpoint's MoE options) only those it holds."""
    kinds = moe_buffers(stage.config.moe if saved is None else saved)
    return {
        f"moe/{name}": buf
        for chunk in stage.chunks
        for name, buf in chunk.named_buffers()
        if name.rsplit(".", 1)[-1] in kinds
    }


def _fp8_histories(stage) -> dict[str, torch.Tensor]:
    """``fp8/<linear>.amax_history``: each linear layer's delayed-scaling history (float32
    ``[amax_history_len, 3]``), the same on every rank of a stage; empty without delayed scaling."""
    return {
        f"fp8/{name}.amax_history": module.fp8.delayed.history
        for chunk in stage.chunks
        for name, module in chunk.named_modules()
        if getattr(module, "fp8", None) is not None and module.fp8.delayed is not None
    }


def _loads_fp8_history(stage, meta: dict) -> bool:
    """Whether the checkpoint holds delayed-scaling histories this run can take (same length)."""
    saved, fp8 = meta.get("fp8") or {}, stage.config.fp8
    return (
        fp8.enabled
        and fp8.fp8_recipe == "delayed"
        and saved.get("fp8_format") is not None
        and saved.get("fp8_recipe") == "delayed"
        and saved.get("fp8_amax_history_len") == fp8.fp8_amax_history_len
    )


def _split_by_optimizer(stage, params: list) -> list[tuple[object, list, object]]:
    """``(optimizer, its parameters, the group its distributed state is sharded over)``: the dense
    ones over dp x cp, and with expert parallelism the routed experts over edp."""
    if stage.expert_optimizer is None:
        return [(stage.optimizer, params, stage.groups.dp_cp)]
    experts = {id(p) for p in stage.expert_grads.params}
    return [
        (stage.optimizer, [p for p in params if id(p) not in experts], stage.groups.dp_cp),
        (stage.expert_optimizer, [p for p in params if id(p) in experts], stage.groups.edp),
    ]


def save_checkpoint(
    stage,
    root: str | Path,
    iteration: int,
    *,
    consumed_samples: int,
    keep_last: int | None = None,
    files: dict[str, Path] | None = None,
    group=None,
) -> Path:
    """Save the whole training state after ``iteration`` steps into ``root/iter_<iteration>``
    (collective over the world) and return the folder: :func:`start_save` and
    :meth:`PendingSave.finish` at once."""
    return start_save(
        stage, root, iteration, consumed_samples=consumed_samples, keep_last=keep_last, files=files, group=group
    ).finish()


def start_save(
    stage,
    root: str | Path,
    iteration: int,
    *,
    consumed_samples: int,
    keep_last: int | None = None,
    files: dict[str, Path] | None = None,
    group=None,
    async_save: bool = False,
) -> PendingSave:
    """Begin saving the training state after ``iteration`` steps into ``root/iter_<iteration>``
    (collective over the world). ``group``: DCP's process group (a gloo group of the world; None: the
    world group). ``async_save``: DCP copies tensors to CPU memory and writes in a background thread.
    ``keep_last``: keep only that many newest complete checkpoints. ``files``: copied in by rank 0.

    Raises:
        CheckpointError: a nan/inf in the state on some rank (on every rank, nothing written).
    """
    root, g = Path(root), stage.groups
    name = f"iter_{iteration:07d}"
    tmp, final = root / f".{name}.tmp", root / name
    stage.wait_for_params()
    named = list(global_named_parameters(stage.model))
    params = [p for _, p in named]
    kinds = state_kinds(stage.optimizer)
    tensors = {}
    for optimizer, some, shards_over in _split_by_optimizer(stage, params):  # over dp x cp, or edp
        tensors.update(gather_local_state(optimizer, some, shards_over, kinds))
    _refuse_non_finite(stage, iteration, named, tensors)
    if g.global_rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    _barrier(stage)
    sd = _state_dict(stage, tensors, {id(p): p.detach() for p in params}, kinds)
    sd["optim/step"] = torch.tensor(step_count(stage.optimizer), dtype=torch.int64)
    sd.update(_moe_buffers(stage))
    sd.update(_fp8_histories(stage))
    if stage.grads.residual is not None:
        sd[f"residual/rank{g.global_rank}"] = stage.grads.residual
    if group is None and g.world.size > 1:
        group = g.world.group
    import torch.distributed.checkpoint as dcp  # here, not at import: slow, and a worker that never saves skips it

    writer = dcp.FileSystemWriter(tmp)
    with _quiet():
        future: Future | None
        if async_save:
            started = dcp.async_save(sd, storage_writer=writer, process_group=group)
            # an AsyncSaveResponse (newer torch, staging in the background too) holds the write's future
            future = started if isinstance(started, Future) else started.upload_completion
        else:
            dcp.save(sd, storage_writer=writer, process_group=group)
            future = None
    _write_json(tmp / "rng" / f"rank{g.global_rank}.json", host_rng_state(stage))
    if g.global_rank == 0:
        for name_in_folder, source in (files or {}).items():
            shutil.copyfile(source, tmp / name_in_folder)
        _write_json(tmp / META, _meta(stage, iteration, consumed_samples, kinds))
    return PendingSave(future, stage.groups, tmp, final, keep_last)


@dataclasses.dataclass
class PendingSave:
    """A checkpoint whose folder is not complete yet (its DCP files may still be being written)."""

    future: Future | None
    """DCP's write in the background (``dcp.async_save``), None when written already."""
    groups: ParallelGroups
    tmp: Path
    final: Path
    keep_last: int | None = None

    def finish(self) -> Path:
        """Wait for this rank's files, then (collective over the world: every rank, once) rank 0
        renames the folder, updates ``latest`` and prunes; returns the folder.

        Raises:
            CheckpointError: the background write failed on this rank (the folder stays incomplete
                and ``latest`` unchanged; the other ranks then fail in DCP's own collectives).
        """
        if self.future is not None:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                with _quiet():
                    self.future.result()
            except (Exception, CheckpointException) as err:
                raise CheckpointError(f"writing checkpoint {self.final} failed: {_first_line(err)}") from err
            self.future = None
        barrier(self.groups.world)
        if self.groups.global_rank == 0:
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            _write_text_atomic(self.final.parent / "latest", self.final.name)
            if self.keep_last:
                _prune(self.final.parent, self.keep_last, keep=self.final.name)
        barrier(self.groups.world)
        return self.final


def _refuse_non_finite(stage, iteration: int, named, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
    """Raise :class:`CheckpointError` on every rank if some rank holds a nan/inf parameter,
    optimizer tensor or 1-bit residual (one host synchronisation per device holding them, then one
    all-gather of a short string or None over the world)."""
    order = [t for _, p in named for t in (p, *tensors[id(p)].values())]
    residual = stage.grads.residual
    finite = iter(_all_finite(order + ([residual] if residual is not None else [])))
    bad = None
    for name, p in named:  # in the order of ``order``: the parameter, then its optimizer tensors
        param_ok = next(finite)
        kinds = [kind for kind in tensors[id(p)] if not next(finite)]
        if bad is None and (kinds or not param_ok):
            bad = f"optimizer {kinds[0]} of {name}" if kinds else f"parameter {name}"
    if bad is None and residual is not None and not next(finite):
        bad = "the 1-bit error-feedback residual"
    found = [(rank, what) for rank, what in enumerate(all_gather_object(bad, stage.groups.world)) if what]
    if found:
        more = f" (and on {len(found) - 1} more rank(s))" if len(found) > 1 else ""
        raise CheckpointError(
            f"refusing to save the checkpoint of iteration {iteration}: {found[0][1]} holds "
            f"nan/inf values on rank {found[0][0]}{more}; nothing was written"
        )


def _all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is free of nan/inf: the flags of one device are stacked and read at once."""
    out = [False] * len(tensors)  # every entry set below
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        flags = torch.stack([torch.isfinite(tensors[i]).all() for i in indices]).tolist()
        for i, ok in zip(indices, flags):
            out[i] = ok
    return out


def _meta(stage, iteration: int, consumed_samples: int, kinds) -> dict:
    m = stage.config.model
    scaler = stage.scaler
    return {
        "format": FORMAT,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "model": dataclasses.asdict(m) | {"ffn": m.ffn},
        "moe": dataclasses.asdict(stage.config.moe),
        "fp8": dataclasses.asdict(stage.config.fp8),
        "layout": _layout_key(stage),
        "world_size": stage.groups.world.size,
        "optimizer_state": list(kinds),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "grad_compression": stage.config.parallel.grad_compression,
    }


def _prune(root: Path, keep_last: int, keep: str) -> None:
    done = complete_checkpoints(root)
    for old in done[:-keep_last]:
        if old.name != keep:
            shutil.rmtree(old)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def load_checkpoint(stage, path: str | Path, *, load_optimizer: bool = True, load_rng: bool = True, group=None) -> dict:
    """Load a checkpoint saved at any layout into ``stage`` (collective over the world): parameters,
    Adam state and step, loss scale, and, at the same layout, the 1-bit residual and RNG states.
    Returns the checkpoint's metadata (``iteration``, ``consumed_samples``, ...). ``group``: the
    process group of DCP's collectives, as for :func:`start_save` (None: the world group).

    Raises:
        CheckpointError: no checkpoint at ``path``, an incomplete or corrupted one, or one saved
            for a different model shape (checked before anything is read into ``stage``).
    """
    folder, meta = _open(path, stage.config)
    g = stage.groups
    stage.wait_for_params()
    params = [p for _, p in global_named_parameters(stage.model)]
    wide = {
        id(p): torch.zeros_like(p, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32) for p in params
    }
    saved_kinds = tuple(meta.get("optimizer_state", ())) if load_optimizer else ()
    tensors = {id(p): {k: torch.zeros_like(wide[id(p)]) for k in saved_kinds} for p in params}
    sd = _state_dict(stage, tensors, wide, saved_kinds)
    sd["optim/step"] = torch.zeros((), dtype=torch.int64)
    sd.update(_moe_buffers(stage, stored_moe(meta)))  # in place; those not saved start from zero
    if _loads_fp8_history(stage, meta):  # in place; otherwise the history starts empty (scale 1)
        sd.update(_fp8_histories(stage))
    same_layout = meta["layout"] == _layout_key(stage) and meta["world_size"] == g.world.size
    residual = stage.grads.residual
    restore_residual = residual is not None and same_layout and meta.get("grad_compression") == "1bit"
    if restore_residual:
        sd[f"residual/rank{g.global_rank}"] = residual
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ptdp.run.checkpoint.safe_reader import SafeFileSystemReader

    try:
        with _quiet():
            dcp.load(
                sd,
                storage_reader=SafeFileSystemReader(folder),
                process_group=group if group is not None else g.world.group if g.world.size > 1 else None,
            )
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"loading checkpoint {folder} failed: {_first_line(err)}") from err
    for p in params:  # 16-bit runs saved float32 main parameters: the exact values
        p.copy_(tensors[id(p)].get("main", wide[id(p)]))
    stage.params_written()  # optim_grads_params: the rank keeps its shard of what was loaded
    kinds = state_kinds(stage.optimizer)
    step = int(sd["optim/step"]) if load_optimizer and "exp_avg" in saved_kinds else 0
    for p in params:  # fresh Adam state (step 0) unless loaded; 16-bit main copies always set
        entry = tensors[id(p)]
        for kind in MOMENTS:
            entry.setdefault(kind, torch.zeros_like(wide[id(p)]))
        if "main" in kinds and "main" not in entry:
            entry["main"] = wide[id(p)]
    for optimizer, some, _ in _split_by_optimizer(stage, params):
        load_local_state(optimizer, some, tensors, step)
    if stage.scaler is not None and meta.get("loss_scaler"):
        stage.scaler.load_state_dict(meta["loss_scaler"])
    rng_file = folder / "rng" / f"rank{g.global_rank}.json"
    rng_state = json.loads(rng_file.read_text()) if load_rng and same_layout and rng_file.is_file() else None
    if rng_state is not None:
        set_host_rng_state(rng_state)
    if stage.dropout_rng is not None:  # the saved streams, else fresh ones seeded with the iteration
        if rng_state is not None and "dropout" in rng_state:
            stage.dropout_rng.load_state_dict(rng_state["dropout"])
        else:
            stage.dropout_rng.reseed(meta["iteration"])
    meta["restored"] = {"optimizer": load_optimizer, "residual": restore_residual, "rng": load_rng and same_layout}
    meta["residual_note"] = residual_note(
        meta, _layout_key(stage), g.world.size, stage.config.parallel.grad_compression
    )
    return meta
