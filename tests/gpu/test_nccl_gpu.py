"""NCCL on real GPUs (skipped without CUDA, and where fewer GPUs than a test's world are visible):
layouts against a single-GPU reference in float64 (1e-9) and bfloat16, the interleaved schedule with
activation messages of 32 MiB (larger than NCCL's buffers: a send completes only while its receive
runs), the overlapped data-parallel reduction with the distributed optimizer, and a checkpoint saved
at one layout and resumed at another. Each worker r runs on ``cuda:r`` of one machine."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.dist_helpers import PG_TIMEOUT
from helpers.layout_cases import TOL, full_parameters, real_rows, tiny_config
from helpers.nccl_helpers import run_nccl_workers, train_on_device
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.stage import build_stage
from ptdp.layout.grid import ParallelLayout
from ptdp.run.checkpoint.io import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.gpu

#: a realistic layer width (the tiny vocabulary keeps the output layer small)
WIDE = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 4096, "seq_length": 256}
#: distributed optimizer, reduction overlapped with backward in several buckets, gathers overlapped with forward
DISTOPT = {
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "ddp_bucket_size": 2**20,
}
STEPS = 3
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]


def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


def _config(tp: int, pp: int, dp: int, variant: str):
    dtype = "bfloat16" if variant == "bfloat16" else "float64"
    parallel = DISTOPT if variant == "distopt" and dp > 1 else None
    return tiny_config(tp, pp, dp, dtype, parallel_overrides=parallel, **WIDE)


def _layout_worker(rank: int, world: int, tp: int, pp: int, dp: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=tp, pp=pp, dp=dp), PG_TIMEOUT)
    device = torch.device("cuda", rank)
    variants = ("float64", "bfloat16") + (("distopt",) if dp > 1 else ())
    return {v: train_on_device(_config(tp, pp, dp, v), groups, device, STEPS) for v in variants}


@functools.cache
def _reference(variant: str) -> dict:
    cfg = _config(1, 1, 1, variant)
    return train_on_device(cfg, ParallelGroups.single_process(), torch.device("cuda", 0), STEPS)


def _assert_matches(results: list[dict], variant: str, tol: dict) -> None:
    ref = _reference(variant)
    for res in results:
        torch.testing.assert_close(torch.tensor(res[variant]["losses"]), torch.tensor(ref["losses"]), **tol)
        torch.testing.assert_close(torch.tensor(res[variant]["norms"]), torch.tensor(ref["norms"]), **tol)
    got = full_parameters(results, variant)
    for name, (t, spec, _) in ref["params"].items():
        torch.testing.assert_close(got[name], real_rows(t, spec), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [pytest.param(l, marks=gpus(l[0] * l[1] * l[2])) for l in LAYOUTS],
    ids=lambda l: "tp{}pp{}dp{}".format(*l),
)
def test_layouts_on_nccl_match_one_gpu(layout):
    """float64 exactly (1e-9) with and without the overlapped distributed optimizer; bfloat16 to
    bf16 precision, replicas and tied copies bitwise equal."""
    results = run_nccl_workers(_layout_worker, layout[0] * layout[1] * layout[2], *layout)
    _assert_matches(results, "float64", TOL["float64"])
    if layout[2] > 1:
        _assert_matches(results, "distopt", TOL["float64"])
    ref = _reference("bfloat16")
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res["bfloat16"]["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(res["bfloat16"]["norms"]), torch.tensor(ref["norms"]), rtol=5e-2, atol=0
        )
    full_parameters(results, "bfloat16")


#: interleaved 1F1B at pp = 2, v = 2, m = 8 > p; each activation message b s h bf16 = 4 * 2048 * 2048 * 2 B = 32 MiB
INTERLEAVED = {
    "num_layers": 4,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "ffn_hidden_size": 8192,
    "seq_length": 2048,
}


def _interleaved_config(pp: int):
    parallel = {"pipeline_schedule": "interleaved-1f1b", "num_layers_per_virtual_pipeline_stage": 1} if pp > 1 else {}
    return tiny_config(
        1,
        pp,
        1,
        "bfloat16",
        parallel_overrides=parallel,
        train_overrides={"micro_batch_size": 4, "global_batch_size": 32},
        **INTERLEAVED,
    )


def _interleaved_worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=1), PG_TIMEOUT)
    return train_on_device(_interleaved_config(2), groups, torch.device("cuda", rank), 2)


@gpus(2)
@pytest.mark.timeout(600)
def test_interleaved_with_32_mib_messages_does_not_hang_on_nccl():
    results = run_nccl_workers(_interleaved_worker, 2, timeout=300)
    assert min(r["largest_p2p_bytes"] for r in results) >= 32 * 2**20
    ref = train_on_device(_interleaved_config(1), ParallelGroups.single_process(), torch.device("cuda", 0), 2)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-2, atol=0)


def _save_worker(rank: int, world: int, root: str) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=2, pp=1, dp=1), PG_TIMEOUT)
    cfg = _config(2, 1, 1, "float64")
    stage = build_stage(cfg, groups, torch.device("cuda", rank))
    out = train_on_device(cfg, groups, stage.device, 2, stage=stage)
    save_checkpoint(stage, root, 2, consumed_samples=2 * cfg.train.global_batch_size)
    return out


def _resume_worker(rank: int, world: int, root: str) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=2, dp=1), PG_TIMEOUT)
    cfg = _config(1, 2, 1, "float64")
    stage = build_stage(cfg, groups, torch.device("cuda", rank))
    meta = load_checkpoint(stage, root)
    return {"iteration": meta["iteration"], **train_on_device(cfg, groups, stage.device, 2, first=2, stage=stage)}


@gpus(2)
@pytest.mark.timeout(900)
def test_checkpoint_saved_at_tp2_resumes_at_pp2_on_nccl(tmp_path):
    """Two steps at tp = 2, saved; resumed at pp = 2 for two more: the same losses and parameters
    as four uninterrupted steps on one GPU (float64, 1e-9)."""
    run_nccl_workers(_save_worker, 2, str(tmp_path))
    resumed = run_nccl_workers(_resume_worker, 2, str(tmp_path))
    whole = train_on_device(_config(1, 1, 1, "float64"), ParallelGroups.single_process(), torch.device("cuda", 0), 4)
    for res in resumed:
        assert res["iteration"] == 2
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(whole["losses"][2:]), **TOL["float64"])
    got = full_parameters([{"r": r} for r in resumed], "r")
    for name, (t, spec, _) in whole["params"].items():
        torch.testing.assert_close(got[name], real_rows(t, spec), **TOL["float64"], msg=lambda m: f"{name}: {m}")
