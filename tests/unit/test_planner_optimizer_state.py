"""The optimizer state's dtypes (Megatron-Core's precision-aware optimizer: ``--main-params-dtype``,
``--exp-avg-dtype``, ``--exp-avg-sq-dtype``; planner only): their bytes under each sharding strategy,
the refusals, and NVIDIA's Nemotron-4 340B benchmark layout, which fits only with its 16-bit state."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG
from ptdp.planner.inputs.models import gpt
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.params import stage_param_counts
from ptdp.planner.memory.strategies import strategy_bytes_per_param

HALF = (2.0, 2.0, 2.0)  # fp16 main parameters, bf16 moments: 6 bytes instead of 12


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("no_shard", (2.0, 4.0, 6.0)),
        ("optim", (2.0, 4.0, 6.0 / 4)),
        ("optim_grads", (2.0, 1.0, 6.0 / 4)),
        ("optim_grads_params", (2.0 / 4, 1.0, 4.0 / 4)),  # the main parameters' shard is the copy kept
    ],
)
def test_state_bytes_follow_the_dtypes(strategy, expected):
    assert strategy_bytes_per_param("bf16", strategy, 4, optimizer=HALF) == expected
    default = strategy_bytes_per_param("bf16", strategy, 4)
    assert default == strategy_bytes_per_param("bf16", strategy, 4, optimizer=(4.0, 4.0, 4.0))


def test_a_candidate_counts_its_optimizer_dtypes():
    model = gpt(8, 512, 8, vocab_size=32000, seq_length=512)
    base = Candidate.of(1, 2, 4, 1, 8, distributed_optimizer=True)
    assert base.optimizer_state is None
    moments = base.replace(optimizer_dtypes=("fp32", "bf16", "bf16"))
    assert moments.optimizer_state == (4.0, 2.0, 2.0)
    mem, small = (memory_breakdown(model, c, CATALOG["h100-sxm"]) for c in (base, moments))
    n = stage_param_counts(model, 1, 2)[mem.stage]
    assert mem.optimizer == 12 * n / 4 and small.optimizer == 8 * n / 4
    assert (small.params, small.grads, small.activations) == (mem.params, mem.grads, mem.activations)


NEMOTRON = [
    "plan", "--model", "nemotron4-340b", "--gpus", "128", "--gpu", "h100-sxm", "--global-batch-size", "32",
    "--seq-length", "4096", "--tp", "8", "--pp", "8", "--virtual-pipeline-model-parallel-size", "12",
    "--dp", "2", "--use-distributed-optimizer", "--micro-batch-size", "1", "--recompute-granularity", "none",
    "--sequence-parallel", "--grad-reduce-in-bf16", "--json", "--top", "1",
]  # fmt: skip


def test_nvidias_nemotron_benchmark_fits_with_its_16_bit_optimizer_state(capsys):
    """NVIDIA's dgxc-benchmarking Nemotron-4 340B BF16 run on 128 H100 (tp 8, pp 8, v 12, dp 2, global
    batch 32; NeMo 24.11 at 4.61 s per step) keeps Apex DistributedFusedAdam's state in bf16
    (``optim.dtype: bf16``): 6 bytes per parameter over dp instead of 12. Planned so, it fits; with
    float32 state it does not."""
    assert main(NEMOTRON) == 1  # no layout fits: 80.5 GiB on stage 0 over the H100's 79.6
    rejected = json.loads(capsys.readouterr().out)
    assert rejected and not any(p["fits"] for p in rejected)
    assert rejected[0]["memory_bytes"]["total"] > CATALOG["h100-sxm"].memory_bytes
    half = ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"]
    half += ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    assert main([*NEMOTRON, *half]) == 0
    plan = json.loads(capsys.readouterr().out)[0]
    assert plan["optimizer_dtypes"] == ["fp16", "bf16", "bf16"] and plan["fits"]
    assert plan["memory_bytes"]["optimizer"] == pytest.approx(plan["memory_bytes"]["params"] * 3 / 2, rel=1e-9)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--fp32", "--use-precision-aware-optimizer"], "--use-precision-aware-optimizer needs 16-bit parameters"),
        (["--use-precision-aware-optimizer", "--main-params-dtype", "bf16"], "invalid choice: 'bf16'"),
    ],
)
def test_optimizer_dtype_refusals(capsys, extra, message):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "8"]
    try:
        code = main([*base, *extra])
    except SystemExit as e:  # argparse's own refusal of a choice
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
