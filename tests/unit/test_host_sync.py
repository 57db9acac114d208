"""A steady-state training step synchronises the host at most once per logged step and never in a
step that is not logged (tp = pp = dp = 1; the (2, 2, 2) case: tests/dist/test_host_sync_dist.py;
on a GPU: tests/unit/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.host_sync import count_host_syncs, label_check_on_device
from helpers.sync_cases import ITERS, counted_run, logged
from ptdp.engine.groups import ParallelGroups


def test_the_shim_counts_what_would_synchronise():
    x = torch.ones(3)
    with count_host_syncs() as count:
        x.sum().item()
        bool(x.any())
        float(x[0])
        x.tolist()
        x.to("meta")  # a blocking copy to another device
        x.to("meta", non_blocking=True)  # not counted
        x.mul(2).add_(1)  # not counted
    assert [c.split(" ")[0] for c in count.calls] == ["item", "__bool__", "__float__", "tolist", "to"], count.calls


def test_one_synchronisation_per_logged_step_none_otherwise(tmp_path):
    for dtype, parallel in (
        ("float64", {}),
        ("bfloat16", {"overlap_grad_reduce": True}),
        ("float16", {"overlap_grad_reduce": True}),
    ):  # the loss scaler included
        with label_check_on_device():
            run = counted_run(ParallelGroups.single_process(), 1, 1, 1, tmp_path / dtype, dtype, **parallel)
        assert run["iterations"] == ITERS and run["final_loss"] is not None
        for iteration, calls in run["per_step"].items():
            if iteration == 1:
                continue  # the first step builds optimizer state
            assert len(calls) == (1 if logged(iteration) else 0), (dtype, iteration, calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_no_cuda_synchronisation_in_a_step_that_is_not_logged(tmp_path, dtype):
    """On a GPU, CUDA itself reports the synchronisations (the label check is asynchronous there);
    float16 with its loss scaler on the device."""
    run = counted_run(
        ParallelGroups.single_process(), 1, 1, 1, tmp_path, dtype, device="cuda", overlap_grad_reduce=True
    )
    assert run["iterations"] == ITERS
    for iteration, calls in run["per_step"].items():
        if iteration > 2:  # the first steps create state and warm up kernels
            assert len(calls) <= (1 if logged(iteration) else 0), (iteration, calls)


def test_mixture_of_experts_steps_synchronise_only_for_the_loop_splits(tmp_path):
    """On one rank the grouped GEMM runs from device offsets and capacity padding fixes every
    split: no synchronisation in a step that is not logged. The per-expert loop reads its splits:
    one per MoE layer and micro-batch."""
    from ptdp.config.moe import MoEConfig

    runs = {
        "grouped": ("float32", MoEConfig(num_experts=4, moe_grouped_gemm=True, moe_aux_loss_coeff=0.01), 0),
        "padded": (
            "float64",
            MoEConfig(num_experts=4, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
            0,
        ),
        "loop": ("float64", MoEConfig(num_experts=4, moe_z_loss_coeff=1e-3), 4 * 4),  # 4 layers x 4 micro-batches
    }
    for name, (dtype, moe, per_step) in runs.items():
        with label_check_on_device():
            run = counted_run(ParallelGroups.single_process(), 1, 1, 1, tmp_path / name, dtype, moe=moe)
        assert run["iterations"] == ITERS and run["final_loss"] is not None
        for iteration, calls in run["per_step"].items():
            if iteration == 1:
                continue
            moe_calls = [c for c in calls if "experts.py" in c]
            assert len(moe_calls) == per_step, (name, iteration, calls)
            assert len(calls) - len(moe_calls) == (1 if logged(iteration) else 0), (name, iteration, calls)
