"""Checkpoints: save at one layout, load at others (parameters, Adam state), resume, failures."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.checkpoints import record_run, stored_tensors, train_steps
from helpers.dist_helpers import PG_TIMEOUT, run_in_pool, run_workers
from helpers.layout_cases import LLAMA_OPTIONS, rank_microbatches, tiny_config
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.model_chunks import global_named_parameters
from ptdp.engine.stage import build_stage
from ptdp.engine.step import eval_loss, train_step
from ptdp.engine.tensor_parallel.sharding import global_param, unshard
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.folders import CheckpointError, resolve_checkpoint
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint
from ptdp.run.checkpoint.optim_state import gather_local_state

SAVE_LAYOUT = (2, 2, 2)


def _groups(tp: int, pp: int, dp: int) -> ParallelGroups:
    if tp * pp * dp == 1:
        return ParallelGroups.single_process()
    return ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)


def _config(tp, pp, dp, **parallel):
    return tiny_config(tp, pp, dp, "float64", parallel_overrides=parallel or None)


def _full_state(stage, groups: ParallelGroups) -> dict:
    """Global parameters and Adam moments of the ranks of dp = 0, gathered over tp (per name)."""
    params = list(global_named_parameters(stage.model))
    moments = gather_local_state(stage.optimizer, [p for _, p in params], groups.dp)
    out = {}
    for name, p in params:
        for kind, local in [("param", p.detach())] + [(k, v) for k, v in moments[id(p)].items()]:
            shards = [torch.empty_like(local) for _ in range(groups.tp.size)]
            if groups.tp.size > 1:
                torch.distributed.all_gather(shards, local.contiguous(), group=groups.tp.group)
            else:
                shards = [local]
            full = unshard([s.clone() for s in shards], global_param(p))
            real = global_param(p).real_rows
            out[f"{kind}/{name}"] = full[:real] if real is not None else full
    return out


def _eval(stage, cfg, groups) -> float:
    return eval_loss(stage, [rank_microbatches(100, cfg, groups.dp.rank, groups.dp.size)])


def save_worker(rank: int, world: int, root: str) -> dict:
    groups = _groups(*SAVE_LAYOUT)
    cfg = _config(*SAVE_LAYOUT, use_distributed_optimizer=True, ddp_bucket_size=777)
    stage = build_stage(cfg, groups)
    for i in range(2):
        train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i)
    save_checkpoint(stage, root, 2, consumed_samples=2 * cfg.train.global_batch_size)
    return {"state": _full_state(stage, groups), "eval": _eval(stage, cfg, groups)}


def load_worker(rank: int, world: int, root: str, cases: list) -> list[dict]:
    """Load the checkpoint at each (layout, parallel overrides) of ``cases`` (same world size)."""
    out = []
    for layout, parallel in cases:
        groups = _groups(*layout)
        cfg = _config(*layout, **parallel)
        stage = build_stage(cfg, groups)
        meta = load_checkpoint(stage, root)
        out.append(
            {"state": _full_state(stage, groups), "eval": _eval(stage, cfg, groups), "iteration": meta["iteration"]}
        )
    return out


@functools.cache
def saved(root: str) -> dict:
    return _merge_stages([dict(r, iteration=2) for r in run_in_pool(save_worker, 8, root)])


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ckpt"))
    saved(root)
    return root


RESHARD = {  # by world size: one spawn loads at several layouts
    1: [((1, 1, 1), {}), ((1, 1, 1), {"use_distributed_optimizer": True})],
    2: [
        ((1, 2, 1), {"pipeline_schedule": "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage": 1}),
        ((1, 2, 1), {"pipeline_schedule": "zb-v"}),  # rank 0: the first and the last stage, one embedding
    ],
    4: [((1, 4, 1), {}), ((1, 1, 4), {"use_distributed_optimizer": True, "ddp_bucket_size": 1001})],
    8: [((4, 1, 2), {}), ((2, 1, 4), {"use_distributed_optimizer": True})],
}


@pytest.mark.parametrize("world", sorted(RESHARD))
def test_checkpoint_loads_at_any_layout(checkpoint_root, world):
    """Saved at (2,2,2) with the distributed optimizer after 2 steps; loaded at (1,1,1), (1,2,1)
    with v = 2 (interleaved, and ZB-V's V placement), (1,4,1), (1,1,4) with the distributed optimizer and another bucket size, (4,1,2)
    and (2,1,4): parameters and Adam moments bitwise, evaluation loss within 1e-9."""
    ref = saved(checkpoint_root)
    cases = RESHARD[world]
    if world == 1:
        per_rank = [load_worker(0, 1, checkpoint_root, cases)]
    else:
        per_rank = run_in_pool(load_worker, world, checkpoint_root, cases)
    for i, case in enumerate(cases):
        res = _merge_stages([r[i] for r in per_rank])
        assert res["iteration"] == 2, case
        torch.testing.assert_close(res["eval"], ref["eval"], rtol=1e-9, atol=0)
        assert set(res["state"]) == set(ref["state"]), case
        for key, value in ref["state"].items():
            assert torch.equal(res["state"][key], value), (case, key)


def _merge_stages(results: list[dict]) -> dict:
    state = {}
    for r in results:
        state.update(r["state"])
    return {"state": state, "eval": results[0]["eval"], "iteration": results[0]["iteration"]}


LLAMA_SAVE_LAYOUT = (2, 2, 1)


def llama_save_worker(rank: int, world: int, root: str) -> dict:
    groups = _groups(*LLAMA_SAVE_LAYOUT)
    cfg = tiny_config(*LLAMA_SAVE_LAYOUT, "float64", **LLAMA_OPTIONS)
    stage = build_stage(cfg, groups)
    for i in range(2):
        train_step(stage, rank_microbatches(i, cfg, groups.dp.rank, groups.dp.size), i)
    save_checkpoint(stage, root, 2, consumed_samples=2 * cfg.train.global_batch_size)
    return {"state": _full_state(stage, groups), "eval": _eval(stage, cfg, groups), "iteration": 2}


def test_llama_checkpoint_loads_at_another_layout(tmp_path):
    """The Llama-like model (grouped QKV stored whole groups at a time, SwiGLU's [gate | up] as
    [2, ffn, h], untied output layer, no biases, no position table) saved at (2,2,1) loads in one
    process: parameters and Adam moments bitwise, evaluation loss within 1e-9; a GPT of the same
    shape is told which option differs."""
    root = str(tmp_path)
    ref = _merge_stages(run_in_pool(llama_save_worker, 4, root))
    groups = _groups(1, 1, 1)
    cfg = tiny_config(1, 1, 1, "float64", **LLAMA_OPTIONS)
    stage = build_stage(cfg, groups)
    assert load_checkpoint(stage, root)["iteration"] == 2
    got = _full_state(stage, groups)
    assert set(got) == set(ref["state"])
    for key, value in ref["state"].items():
        assert torch.equal(got[key], value), key
    torch.testing.assert_close(_eval(stage, cfg, groups), ref["eval"], rtol=1e-9, atol=0)
    gpt = build_stage(tiny_config(1, 1, 1, "float64", untie_embeddings_and_output_weights=True), groups)
    with pytest.raises(
        CheckpointError,
        match="normalization='RMSNorm' in the checkpoint, 'LayerNorm' here "
        r"\(set --normalization\); swiglu=True in the checkpoint",
    ):
        load_checkpoint(gpt, root)


def test_latest_and_failures(checkpoint_root, tmp_path):
    folder = resolve_checkpoint(checkpoint_root)
    assert folder.name == "iter_0000002"
    with pytest.raises(CheckpointError, match="is not a ptdp checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    groups = ParallelGroups.single_process()
    other = build_stage(tiny_config(1, 1, 1, "float64", hidden_size=48), groups)
    with pytest.raises(CheckpointError, match="different model: hidden_size=32 in the checkpoint, 48 here"):
        load_checkpoint(other, checkpoint_root)


RESUME = [
    ((1, 1, 1), {}),
    ((2, 2, 2), {"use_distributed_optimizer": True, "ddp_bucket_size": 777}),
    ((1, 2, 2), {"use_distributed_optimizer": True, "overlap_param_gather": True, "overlap_grad_reduce": True}),
    # interleaved with the embedding and the loss counted as layers: chunks of only the embedding /
    # only the loss (4 + 2 units, v = 3)
    (
        (1, 2, 1),
        {
            "account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True,
            "num_layers_per_virtual_pipeline_stage": 1,
        },
    ),
    ((1, 2, 1), {"pipeline_schedule": "zb-v"}),
]


def resume_worker(rank: int, world: int, root: str, layout: tuple, parallel: dict, resume: bool) -> dict:
    """``resume=False``: 4 steps in one go, then (a new stage) 2 steps and a save; ``True``: load
    and run steps 3 and 4."""
    groups = _groups(*layout)
    cfg = _config(*layout, **parallel)
    stage = build_stage(cfg, groups)
    if resume:
        first = load_checkpoint(stage, root)["iteration"]
        return record_run(stage, train_steps(stage, cfg, groups, first, 4))
    whole = record_run(stage, train_steps(stage, cfg, groups, 0, 4))
    stage = build_stage(cfg, groups)
    train_steps(stage, cfg, groups, 0, 2)
    save_checkpoint(stage, root, 2, consumed_samples=2 * cfg.train.global_batch_size)
    return whole


@pytest.mark.parametrize("layout,parallel", RESUME, ids=[str(l) for l, _ in RESUME])
def test_resume_is_bit_exact(tmp_path, layout, parallel):
    """4 steps in one go == 2 steps, save, then 2 more in new processes after loading."""
    world = layout[0] * layout[1] * layout[2]
    root = str(tmp_path)
    whole = run_in_pool(resume_worker, world, root, layout, parallel, False)
    resumed = run_workers(resume_worker, world, root, layout, parallel, True)
    for a, b in zip(whole, resumed):
        assert a["losses"][2:] == b["losses"] and a["norms"][2:] == b["norms"]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name


def test_truncated_or_missing_shard_is_named(checkpoint_root, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_root, copy)
    folder = resolve_checkpoint(copy)
    shard = sorted(folder.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    before = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    with pytest.raises(CheckpointError, match=f"corrupted: shard file {shard.name} has 100 bytes"):
        load_checkpoint(stage, copy)
    assert all(torch.equal(before[n], p) for n, p in stage.model.named_parameters())
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"incomplete: shard file {shard.name} is missing"):
        load_checkpoint(stage, copy)


def test_interrupted_save_leaves_latest_on_the_previous_checkpoint(checkpoint_root, tmp_path):
    """A save that died after writing part of its folder: the temporary folder is ignored."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_root, copy)
    partial = copy / ".iter_0000004.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    assert resolve_checkpoint(copy).name == "iter_0000002"
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    assert load_checkpoint(stage, copy)["iteration"] == 2


def resave_worker(rank: int, world: int, source: str, target: str, layout: tuple, parallel: dict) -> None:
    groups = _groups(*layout)
    stage = build_stage(_config(*layout, **parallel), groups)
    load_checkpoint(stage, source)
    save_checkpoint(stage, target, 2, consumed_samples=16)


def test_round_trip_through_one_process_gives_the_same_files(checkpoint_root, tmp_path):
    """(2,2,2) -> (1,1,1) -> (2,2,2), distributed optimizer at both ends: every stored tensor of
    the final checkpoint is bitwise the original's."""
    one, back = str(tmp_path / "one"), str(tmp_path / "back")
    resave_worker(0, 1, checkpoint_root, one, (1, 1, 1), {})
    run_in_pool(resave_worker, 8, one, back, SAVE_LAYOUT, {"use_distributed_optimizer": True, "ddp_bucket_size": 777})
    original = stored_tensors(resolve_checkpoint(checkpoint_root))
    again = stored_tensors(resolve_checkpoint(back))
    assert set(original) == set(again)
    for key, value in original.items():
        assert torch.equal(again[key], value), key


def test_a_save_that_dies_before_completing_leaves_latest_alone(checkpoint_root, tmp_path, monkeypatch):
    """The save fails after writing its temporary folder (as a killed process would): ``latest``
    still names the previous checkpoint, which loads; the next save succeeds."""
    import shutil

    import ptdp.run.checkpoint.io as io

    root = tmp_path / "root"
    shutil.copytree(checkpoint_root, root)
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    real_replace = io.os.replace

    def dies(src, dst):
        if str(src).endswith(".tmp") and "iter_" in str(src):
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", dies)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(stage, root, 5, consumed_samples=40)
    assert (root / ".iter_0000005.tmp").is_dir() and (root / "latest").read_text().strip() == "iter_0000002"
    assert load_checkpoint(stage, root)["iteration"] == 2
    monkeypatch.setattr(io.os, "replace", real_replace)
    save_checkpoint(stage, root, 5, consumed_samples=40)
    assert (root / "latest").read_text().strip() == "iter_0000005" and not (root / ".iter_0000005.tmp").exists()


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_never_runs_code_from_the_checkpoint(checkpoint_root, tmp_path):
    """DCP's index is a pickle: a crafted one is refused before it can run anything."""
    import pickle
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_root, copy)
    folder = resolve_checkpoint(copy)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Exploit(str(marker))))
    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    with pytest.raises(CheckpointError, match="not a DCP metadata type"):
        load_checkpoint(stage, copy)
    assert not marker.exists()


def test_damaged_checkpoints_and_bad_targets_are_clear_errors(checkpoint_root, tmp_path):
    import dataclasses
    import shutil

    from ptdp.run.checkpoint.folders import check_save_dir, precheck
    from ptdp.run.checkpoint.hf import import_hf

    stage = build_stage(tiny_config(1, 1, 1, "float64"), ParallelGroups.single_process())
    # same-size shard with flipped bytes: DCP's own error (a BaseException) becomes a CheckpointError
    garbage = tmp_path / "garbage"
    shutil.copytree(checkpoint_root, garbage)
    shard = sorted(resolve_checkpoint(garbage).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    for i in range(0, len(data), 7):
        data[i] = (data[i] + 1) % 256
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="failed"):
        load_checkpoint(stage, garbage)
    # ptdp.json that is JSON but not a checkpoint's
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint_root, damaged)
    (resolve_checkpoint(checkpoint_root).name and (damaged / "iter_0000002" / "ptdp.json").write_text('{"format": 1}'))
    with pytest.raises(CheckpointError, match="is damaged"):
        load_checkpoint(stage, damaged)
    # another activation is another model
    cfg = tiny_config(1, 1, 1, "float64", activation="gelu_tanh")
    with pytest.raises(CheckpointError, match="activation='gelu' in the checkpoint, 'gelu_tanh' here"):
        precheck(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=checkpoint_root)))
    # nothing left to train
    cfg = tiny_config(1, 1, 1, "float64", train_overrides={"train_iters": 2})
    with pytest.raises(CheckpointError, match="leaves nothing to train"):
        precheck(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=checkpoint_root)))
    # --save onto a file; importing into a non-empty folder
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot use"):
        check_save_dir(tmp_path / "file")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        import_hf(tmp_path, garbage)
