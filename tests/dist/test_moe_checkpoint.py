"""MoE checkpoints store the experts by global index, so a run saved at one expert layout resumes at
any other: two steps of one process and of (tp, cp, pp, dp, ep, etp) = (1,1,1,4,2,2) with
optim_grads are saved; the first is loaded at (1,1,1,4,4,1) with ZeRO-1 (ep 1 -> 4) and at
(2,1,1,2,1,2) with optim_grads (etp 1 -> 2), the second at (2,1,1,2,2,1) with optim_grads_params
(etp 2 -> 1, tp 1 -> 2, experts' state sharded over edp 2) and in one process (ep, etp -> 1).
Each third step equals one uninterrupted process's (float64, 1e-9): loss, norm, every parameter
and the expert biases and global_aux_loss's counts, which the checkpoint carries; resumed at the
layout it was saved at, the step equals the uninterrupted run's bitwise. The ep 4 run, saved after
its third step, loads in one process (ep 4 -> 1) as one process's state after three steps."""

from __future__ import annotations

import torch

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from helpers.layout_cases import TOL, rank_microbatches
from helpers.moe_cases import check_like_one_process, collect_ep, ep_full_parameters, moe_config, reference
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.engine.step import train_step
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint

NAME = "moe_ep_bias"
SAVED = (1, 1, 1, 4, 2, 2)
#: where each checkpoint is loaded: (saved by, (tp, cp, pp, dp, ep, etp), sharding)
EP4 = (1, 1, 1, 4, 4, 1)
LOADS = [
    ("one", (1, 1, 1, 4, 4, 1), "optim"),
    ("one", (2, 1, 1, 2, 1, 2), "optim_grads"),
    ("ep", (2, 1, 1, 2, 2, 1), "optim_grads_params"),
]


def _groups(tp: int, cp: int, pp: int, dp: int, ep: int, etp: int) -> ParallelGroups:
    if tp * cp * pp * dp == 1:
        return ParallelGroups.single_process()
    return ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp), PG_TIMEOUT, ep=ep, etp=etp)


def _save_after_two_steps(name: str, layout: tuple, root: str) -> dict:
    """Two steps saved, then the third of the same run (uninterrupted)."""
    cfg, groups = moe_config(name, *layout), _groups(*layout)
    stage = build_stage(cfg, groups)
    for step in range(2):
        train_step(stage, rank_microbatches(step, cfg, groups.dp.rank, groups.dp.size), step).result()
    save_checkpoint(stage, root, 2, consumed_samples=16)
    return collect_ep(cfg, groups, stage, steps=range(2, 3))


def _resume(name: str, layout: tuple, root: str, save_to: str | None = None) -> dict:
    """The third step after loading ``root``; then saved to ``save_to`` if given."""
    cfg, groups = moe_config(name, *layout), _groups(*layout)
    stage = build_stage(cfg, groups)
    meta = load_checkpoint(stage, root)
    assert meta["iteration"] == 2
    out = {NAME: collect_ep(cfg, groups, stage, steps=range(2, 3))}
    if save_to is not None:
        save_checkpoint(stage, save_to, 3, consumed_samples=24)
    return out


def resume_worker(rank: int, world: int, roots: dict[str, str]) -> dict:
    out: dict = {"uninterrupted": _save_after_two_steps(f"{NAME}:optim_grads", SAVED, roots["ep"])}
    out["same layout"] = _resume(f"{NAME}:optim_grads", SAVED, roots["ep"])[NAME]
    return out | {
        layout: _resume(f"{NAME}:{sharding}", layout, roots[saved_by], roots["ep4"] if layout == EP4 else None)
        for saved_by, layout, sharding in LOADS
    }


def test_moe_checkpoint_resumes_at_other_expert_layouts(tmp_path):
    roots = {"one": str(tmp_path / "one"), "ep": str(tmp_path / "ep"), "ep4": str(tmp_path / "ep4")}
    _save_after_two_steps(NAME, (1, 1, 1, 1, 1, 1), roots["one"])  # its third step unused
    ref = reference(NAME)
    assert all(bias.abs().sum() > 0 for bias in ref["buffers"].values()) and ref["buffers"]
    third = {"losses": ref["losses"][2:], "norms": ref["norms"][2:], "params": ref["params"]}
    resumed = run_in_pool(resume_worker, 4, roots)
    for res in resumed:  # at the layout it was saved at, the resumed step is the uninterrupted one, bitwise
        same, whole = res["same layout"], res["uninterrupted"]
        assert (same["losses"], same["norms"]) == (whole["losses"], whole["norms"])
        for key, (tensor, _, _) in whole["params"].items():
            assert torch.equal(same["params"][key][0], tensor), key
        assert all(torch.equal(same["buffers"][key], b) for key, b in whole["buffers"].items())
    runs = {f"{saved_by} -> {layout}": [res[layout] for res in resumed] for saved_by, layout, _ in LOADS}
    runs["ep -> one process"] = [_resume(NAME, (1, 1, 1, 1, 1, 1), roots["ep"])]
    for what, results in runs.items():
        check_like_one_process(results, NAME, third, ep_full_parameters(results, NAME))
        for res in results:
            assert sorted(res[NAME]["buffers"]) == sorted(ref["buffers"]), what
            for key, bias in res[NAME]["buffers"].items():
                torch.testing.assert_close(bias, ref["buffers"][key], **TOL["float64"], msg=f"{what} {key}")
    # the ep 4 run saved after its third step: one process loads the state of three steps
    stage = build_stage(moe_config(NAME, 1, 1, 1, 1), ParallelGroups.single_process())
    assert load_checkpoint(stage, roots["ep4"])["layout"]["ep"] == 4
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.detach(), ref["params"][name][0], **TOL["float64"], msg=name)
    for name, b in stage.model.named_buffers():
        if name in ref["buffers"]:
            torch.testing.assert_close(b, ref["buffers"][name], **TOL["float64"], msg=name)
