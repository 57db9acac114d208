"""``--kv-repeated-before-attention``: a model (torchtitan's Llama) that expands its key/value
heads to every query head before the attention kernel keeps, and exchanges under context
parallelism, ``a / kv`` times the grouped key/value bytes; ptdp train refuses the setting."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ptdp.cli import main
from ptdp.config.rules.shape import model_option_violations
from ptdp.planner.inputs.models import get_model
from ptdp.planner.memory.activations import layer_activation_bytes
from ptdp.planner.memory.cp_local import kv_block_elements, kv_buffer_bytes

LLAMA = get_model("llama3-8b")  # 32 heads of 128, 8 key/value heads
REPEATED = dataclasses.replace(LLAMA, kv_repeated=True)


def test_the_attended_heads_are_every_query_heads():
    assert (LLAMA.attended_kv_heads, REPEATED.attended_kv_heads) == (8, 32)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_the_exchanged_blocks_hold_every_heads_keys_and_values(comm_type):
    tp, cp, b = 2, 4, 1
    assert kv_block_elements(REPEATED, tp, cp, b) == 4 * kv_block_elements(LLAMA, tp, cp, b)
    assert kv_block_elements(REPEATED, tp, cp, b) == LLAMA.seq_length / cp * b * 32 * 128 / tp
    assert kv_buffer_bytes(REPEATED, tp, cp, b, comm_type) == 4 * kv_buffer_bytes(LLAMA, tp, cp, b, comm_type)


def test_without_recompute_the_kernel_keeps_every_heads_keys_and_values():
    """Per token and tp rank, K and V of 32 heads instead of 8: ``2 e (a - kv) d / t`` bytes more."""
    tp, b, s = 2, 1, LLAMA.seq_length
    args = dict(tp=tp, micro_batch_size=b, sequence_parallel=True, recompute="none", precision="bf16")
    more = layer_activation_bytes(REPEATED, **args) - layer_activation_bytes(LLAMA, **args)
    assert more == 2 * 2 * (32 - 8) * 128 * b * s / tp
    for recompute in ("full", "op"):
        args["recompute"] = recompute
        assert layer_activation_bytes(REPEATED, **args) == layer_activation_bytes(LLAMA, **args)


def test_ptdp_train_refuses_it():
    messages = [v.message for v in model_option_violations(REPEATED)]
    assert any("kv_repeated=True is a ptdp plan setting" in m for m in messages), messages
    assert not any("kv_repeated" in v.message for v in model_option_violations(LLAMA))


def test_plan_exchanges_four_times_the_bytes_with_the_flag(capsys):
    flags = [
        "plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq-length", "65536",
        "--context-parallel-size", "4", "--data-parallel-size", "2", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--recompute-granularity", "full", "--cp-comm-type", "p2p", "--json",
    ]  # fmt: skip
    cp_comm = []
    for extra in ([], ["--kv-repeated-before-attention"]):
        assert main([*flags, *extra]) == 0
        cp_comm.append(json.loads(capsys.readouterr().out)[0]["time_s"]["cp_comm"])
    assert cp_comm[1] > cp_comm[0] > 0
