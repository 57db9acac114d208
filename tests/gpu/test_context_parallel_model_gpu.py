"""The model under context parallelism on CUDA (skipped without it): the attention core takes the
model's strided q/k/v views (permuted out of the fused QKV projection) through the fused
flash-attention kernel in bfloat16; and training at cp = 2 over NCCL on 2 GPUs equals one GPU
(float64 within 1e-9, the math kernel; bfloat16 to bf16 precision, the fused kernel), both comm
types, the Llama-like model with dropout."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from helpers.cp_cases import cp_config
from helpers.dist_helpers import PG_TIMEOUT
from helpers.layout_cases import TOL, full_parameters, real_rows
from helpers.nccl_helpers import run_nccl_workers, train_on_device
from ptdp.config.model import ModelConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.context_parallel.cp_attention import context_parallel_attention
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.attention import Attention
from ptdp.layout.grid import ParallelLayout

pytestmark = pytest.mark.gpu
VARIANTS = ("gpt_p2p", "llama_all_gather", "llama_dropout_full_p2p", "gpt_bf16_p2p")


@pytest.mark.parametrize("grouped", [False, True], ids=["mha", "gqa"])
def test_fused_kernel_takes_the_models_strided_views(grouped):
    cfg = ModelConfig(
        hidden_size=512, num_attention_heads=8, num_query_groups=2 if grouped else None, params_dtype="bfloat16"
    )
    attention = Attention(cfg, AxisGroup.single("tp"), torch.bfloat16)
    rows = attention.qkv.weight.shape[0]
    qkv = torch.randn(256, 2, rows, device="cuda", dtype=torch.bfloat16)
    q, k, v = attention.split_heads(qkv)  # [b, heads, s, d] views, not contiguous
    assert not q.is_contiguous()
    got = context_parallel_attention(q, k, v, AxisGroup.single("cp"), "p2p", kernel="fused")
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=grouped)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def _worker(rank: int, world: int) -> dict:
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=1, cp=2), PG_TIMEOUT)
    device = torch.device("cuda", rank)
    return {name: train_on_device(cp_config(name, 1, 2, 1, 1), groups, device, 3) for name in VARIANTS}


@functools.cache
def _reference(name: str) -> dict:
    return train_on_device(cp_config(name, 1, 1, 1, 1), ParallelGroups.single_process(), torch.device("cuda", 0), 3)


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp2_on_nccl_trains_like_one_gpu():
    results = run_nccl_workers(_worker, 2)
    for name in VARIANTS:
        ref = _reference(name)
        bf16 = name == "gpt_bf16_p2p"
        tol = dict(rtol=1e-2, atol=0) if bf16 else TOL["float64"]
        for res in results:
            torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), **tol)
            if not bf16:
                torch.testing.assert_close(torch.tensor(res[name]["norms"]), torch.tensor(ref["norms"]), **tol)
        got = full_parameters(results, name)  # the cp replicas bitwise equal
        if not bf16:
            for key, (t, spec, _) in ref["params"].items():
                torch.testing.assert_close(
                    got[key], real_rows(t, spec), **tol, msg=lambda m, name=name, key=key: f"{name} {key}: {m}"
                )
