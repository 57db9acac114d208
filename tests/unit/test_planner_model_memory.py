"""Planner memory model: exact parameter counts, bytes per parameter, in-flight microbatches,
Korthikanti activation formulas (pure, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from ptdp.config.model import ModelConfig
from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.model.gpt import GPTModel
from ptdp.errors import ConfigError
from ptdp.layout.pipeline.partition import stage_layer_ids
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, GiB
from ptdp.planner.inputs.models import PRESETS, gpt
from ptdp.planner.memory.activations import inflight_microbatches, layer_activation_bytes
from ptdp.planner.memory.breakdown import memory_breakdown
from ptdp.planner.memory.overhead import runtime_overhead_bytes
from ptdp.planner.memory.params import bytes_per_param, stage_param_counts

A100 = CATALOG["a100-80gb"]


def _real_stage_numels(cfg: ModelConfig, tp: int, pp: int, split) -> list[int]:
    """numel of ptdp's own GPT stage on tp rank 0 of each pipeline stage (construction only)."""
    out = []
    for pp_rank in range(pp):
        axis = AxisGroup("tp", tuple(range(tp)), 0, None, CommStats())
        stage = GPTModel(
            cfg,
            axis,
            layer_ids=stage_layer_ids(cfg.num_layers, pp, pp_rank, split),
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp - 1,
        )
        out.append(sum(p.numel() for p in stage.parameters()))
    return out


@pytest.mark.parametrize(
    "tp,pp,tied,split,divisible",
    [
        (1, 1, True, None, 8),
        (2, 1, True, None, 8),
        (2, 2, True, None, 8),
        (4, 2, False, None, 8),
        (2, 3, True, (1, 3, 1), 8),
        (1, 2, False, (4, 1), 8),
        (4, 1, False, None, 8),
        (2, 4, True, None, 128),
        (4, 5, False, (1, 1, 1, 1, 1), 128),
    ],
)
def test_param_counts_equal_ptdp_gpt_numel(tp, pp, tied, split, divisible):
    layers = sum(split) if split else 4
    cfg = ModelConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=8,
        vocab_size=303,
        make_vocab_size_divisible_by=divisible,
        untie_embeddings_and_output_weights=not tied,
    )
    spec = gpt(
        layers, 32, 4, vocab_size=303, seq_length=8, untie_embeddings_and_output_weights=not tied, ffn_hidden_size=48
    )
    predicted = stage_param_counts(spec, tp, pp, make_vocab_size_divisible_by=divisible, layer_split=split)
    assert predicted == _real_stage_numels(cfg, tp, pp, split)


def test_param_counts_of_llama_presets_match_released_models():
    # Parameter totals of the released checkpoints (Touvron et al. 2023; Dubey et al. 2024).
    assert sum(stage_param_counts(PRESETS["llama2-7b"], 1, 1)) == 6_738_415_616
    assert sum(stage_param_counts(PRESETS["llama2-70b"], 1, 1)) == 68_976_648_192
    assert sum(stage_param_counts(PRESETS["llama3-8b"], 1, 1)) == 8_030_261_248


def test_param_counts_sum_to_narayanan_eq2_for_gpt():
    # [N21] eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) with 4h MLP, tied, tp = pp = 1;
    # eq. 2 leaves out the final LayerNorm (2h).
    m = PRESETS["gpt3-175b"]
    l, h, v, s = m.num_layers, m.hidden_size, m.vocab_size, m.seq_length
    eq2 = 12 * l * h * h + 13 * l * h + (v + s) * h
    assert eq2 == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)), rel=1e-12)
    assert sum(stage_param_counts(m, 1, 1)) == eq2 + 2 * h


def test_uneven_split_must_add_up():
    with pytest.raises(ConfigError):
        stage_param_counts(PRESETS["gpt-1.7b"], 1, 5)
    with pytest.raises(ConfigError):
        stage_param_counts(PRESETS["gpt-1.7b"], 1, 2, layer_split=(10, 10))


def test_bytes_per_param():
    assert sum(bytes_per_param("bf16")) == 18
    assert sum(bytes_per_param("fp16")) == 18
    assert bytes_per_param("bf16") == (2, 4, 12)
    assert sum(bytes_per_param("fp32")) == 16
    for dp in (1, 2, 8, 64):
        assert sum(bytes_per_param("bf16", dp, distributed_optimizer=True)) == pytest.approx(6 + 12 / dp)
        assert sum(bytes_per_param("fp32", dp, distributed_optimizer=True)) == pytest.approx(8 + 8 / dp)
    with pytest.raises(ValueError):
        bytes_per_param("int8")


def _layout(**kw) -> Candidate:
    base = dict(tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=8)
    return Candidate.of(**{**base, **kw})


def test_inflight_microbatches_1f1b_gpipe_interleaved():
    for m in (1, 2, 3, 8):
        layout = _layout(global_batch_size=m)
        assert [inflight_microbatches(layout, r) for r in range(4)] == [min(4 - r, m) for r in range(4)]
        assert [inflight_microbatches(layout, r, schedule="gpipe") for r in range(4)] == [m] * 4
    inter = _layout(pp=4, virtual_stages=2, global_batch_size=8)
    # rank 0 holds pp (1 + (pp - 1)/(pp v)) microbatches' worth [K22 §4.2]
    assert inflight_microbatches(inter, 0) == pytest.approx(4 * (1 + 3 / 8))
    assert inflight_microbatches(inter, 3) == pytest.approx(2.5)  # (v - 1) pp + 1 chunks / v
    few = _layout(pp=4, virtual_stages=2, global_batch_size=1)
    assert inflight_microbatches(few, 0) == 1  # capped at m v chunks


def test_activation_formulas_match_korthikanti():
    """[K22] eq. 1-2 and §5 for the 22B model of its Table 3 (t = 8, b = 4)."""
    m = gpt(48, 6144, 64, vocab_size=51200, seq_length=2048)
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    sbh = s * b * h
    assert layer_activation_bytes(m, 1, b, sequence_parallel=False, recompute="none") == pytest.approx(
        sbh * (34 + 5 * a * s / h)
    )
    assert layer_activation_bytes(m, t, b, sequence_parallel=False, recompute="none") == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert layer_activation_bytes(m, t, b, sequence_parallel=True, recompute="none") == pytest.approx(
        sbh / t * (34 + 5 * a * s / h)
    )
    assert layer_activation_bytes(m, t, b, sequence_parallel=True, recompute="selective") == pytest.approx(sbh / t * 34)
    assert layer_activation_bytes(m, t, b, sequence_parallel=False, recompute="selective") == pytest.approx(
        sbh * (10 + 24 / t)
    )
    assert layer_activation_bytes(m, t, b, sequence_parallel=False, recompute="full") == 2 * sbh
    # Hand computation: 2048*4*6144 * (10 + 3 + 13.333) * 48 layers = 59.25 GiB (K22 Figure 1).
    per_layer = layer_activation_bytes(m, t, b, sequence_parallel=False, recompute="none")
    assert per_layer * 48 / GiB == pytest.approx(59.25, abs=0.005)


def test_gqa_swiglu_generalisation_reduces_to_gpt():
    model_gpt = gpt(4, 1024, 16)
    as_gqa = dataclasses.replace(model_gpt, num_query_groups=16)
    for rec in ("none", "selective", "full"):
        for sp in (False, True):
            assert layer_activation_bytes(
                model_gpt, 4, 2, sequence_parallel=sp, recompute=rec
            ) == layer_activation_bytes(as_gqa, 4, 2, sequence_parallel=sp, recompute=rec)
    fewer_kv = dataclasses.replace(model_gpt, num_query_groups=4)
    assert layer_activation_bytes(
        fewer_kv, 1, 1, sequence_parallel=False, recompute="selective"
    ) < layer_activation_bytes(model_gpt, 1, 1, sequence_parallel=False, recompute="selective")


def test_monotonicity():
    model = PRESETS["gpt3-175b"]
    base = Candidate.of(tp=2, pp=8, dp=4, micro_batch_size=1, global_batch_size=512, recompute="none")
    prev = None
    for tp in (1, 2, 4, 8):
        total = memory_breakdown(model, base.replace(tp=tp), A100).total
        assert prev is None or total < prev, "more tp -> less memory per GPU"
        prev = total
    act = {
        (rec, sp): memory_breakdown(model, base.replace(recompute=rec, sequence_parallel=sp), A100).activations
        for rec in ("none", "selective", "full")
        for sp in (False, True)
    }
    assert act["none", True] < act["none", False]
    assert act["selective", False] < act["none", False]
    assert act["selective", True] < act["selective", False]
    assert act["full", False] < act["selective", False]
    zero = memory_breakdown(model, base.replace(distributed_optimizer=True), A100)
    plain = memory_breakdown(model, base, A100)
    assert zero.optimizer == pytest.approx(plain.optimizer / 4)
    assert zero.params == plain.params and zero.grads == plain.grads


def test_memory_breakdown_fields_and_stage():
    model = gpt(8, 256, 8, vocab_size=50000, seq_length=512)
    layout = Candidate.of(tp=2, pp=4, dp=1, micro_batch_size=2, global_batch_size=16, precision="bf16")
    mem = memory_breakdown(model, layout, A100)
    counts = stage_param_counts(model, 2, 4)
    assert mem.stage in (0, 3)
    assert mem.params == 2 * counts[mem.stage]
    assert mem.grads == 4 * counts[mem.stage]
    assert mem.optimizer == 12 * counts[mem.stage]
    assert mem.overhead == runtime_overhead_bytes(layout, A100.gpus_per_node, model.tied)
    assert memory_breakdown(model, layout, A100, overhead_bytes=0).total == pytest.approx(mem.total - mem.overhead)
    # an explicit even split takes the all-stages path and agrees with the O(1) path
    assert memory_breakdown(model, layout, A100, layer_split=(2, 2, 2, 2)) == mem
    # fp32 (what `ptdp train` runs): 16 bytes per parameter, 4-byte activations; dropout masks
    # stay 1 byte and the logits were fp32 already, so less than twice the bf16 bytes
    fp32 = memory_breakdown(model, layout.replace(precision="fp32"), A100)
    assert fp32.params + fp32.grads + fp32.optimizer == 16 * counts[fp32.stage]
    assert mem.activations < fp32.activations < 2 * mem.activations
    no_dropout = dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0)
    for rec in ("none", "selective", "full"):
        assert layer_activation_bytes(
            no_dropout, 2, 2, sequence_parallel=False, recompute=rec, precision="fp32"
        ) == 2 * layer_activation_bytes(no_dropout, 2, 2, sequence_parallel=False, recompute=rec)


def test_gpipe_holds_more_than_1f1b():
    model = PRESETS["gpt-7.5b"]
    layout = Candidate.of(tp=4, pp=4, dp=1, micro_batch_size=1, global_batch_size=32, recompute="selective")
    assert (
        memory_breakdown(model, layout, A100, schedule="gpipe").activations
        > memory_breakdown(model, layout, A100).activations
    )


@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_bf16_gradients_halve_gradient_bytes_and_count_the_steps_float32_copy(sharding):
    """--grad-reduce-in-bf16: 2 bytes per gradient under every strategy; the optimizer step's
    float32 copy of the gradients it applies (all, or the 1/(dp cp) shard) counts where it exceeds
    the activations (freed by then)."""
    model = gpt(8, 256, 8, vocab_size=50000, seq_length=512)
    base = Candidate.of(tp=2, pp=4, dp=2, micro_batch_size=2, global_batch_size=16, sharding=sharding)
    bf16 = base.replace(grad_reduce_in_bf16=True)
    assert bf16.bf16_grads and bf16.grad_bytes == 2.0 and base.grad_bytes == 4.0
    m32, m16 = memory_breakdown(model, base, A100), memory_breakdown(model, bf16, A100)
    n = stage_param_counts(model, 2, 4)[m16.stage]
    shard = 1 if sharding == "no_shard" else 2
    copy = 4.0 * n / shard
    assert m16.grads == pytest.approx(m32.grads / 2 + max(0.0, copy - m16.activations))
    assert (m16.params, m16.optimizer, m16.activations) == (m32.params, m32.optimizer, m32.activations)
    tiny_batch = Candidate.of(tp=2, pp=4, dp=2, micro_batch_size=1, global_batch_size=8, sharding=sharding)
    tiny = dataclasses.replace(model, seq_length=8)
    small = memory_breakdown(tiny, tiny_batch.replace(grad_reduce_in_bf16=True), A100)
    n = stage_param_counts(tiny, 2, 4)[small.stage]
    assert small.activations < 4.0 * n / shard  # the copy is the peak
    without_copy = memory_breakdown(tiny, tiny_batch, A100).grads / 2
    # (the bf16 plan's most loaded stage can be another one: a few kB apart)
    assert small.grads - without_copy == pytest.approx(4.0 * n / shard - small.activations, rel=1e-3)


def test_op_level_checkpointing_keeps_the_input_attention_output_and_every_second_matmul():
    """--selective-ac-option op (torchtitan's per-op SAC): per token the layer input, Q, V, fc1's
    first output, the attention output (bf16) and its fp32 log-sum-exp, and with SwiGLU fc2's
    h-wide output; between full recompute and none in memory, in recompute time and in FLOPs."""
    from ptdp.planner.time import flops

    llama = PRESETS["llama3-8b"]
    h, a, kv, f = llama.hidden_size, llama.num_attention_heads, llama.kv_heads, llama.ffn
    d = h // a
    op = layer_activation_bytes(llama, 1, 1, sequence_parallel=False, recompute="op")
    per_token = 2 * (h + a * d + kv * d + f + a * d + h) + 4 * a
    assert op == llama.seq_length * per_token
    none = layer_activation_bytes(llama, 1, 1, sequence_parallel=False, recompute="none")
    full = layer_activation_bytes(llama, 1, 1, sequence_parallel=False, recompute="full")
    assert full < op < none
    args = (llama, 1, 1, False, 989e12, 3.35e12, 0.8, 128.0)
    rec = flops.op_sac_recompute_time(*args)
    fwd, _, _ = flops.layer_compute_times(*args)
    assert 0 < rec < fwd
    model_flops = flops.model_flops_per_step(llama, 8)
    assert model_flops < flops.hardware_flops_per_step(llama, 8, "op") < flops.hardware_flops_per_step(llama, 8, "full")
    # K (a fraction of the QKV GEMM), the projection and SwiGLU's up half of fc1 run again
    assert flops.op_sac_shares(llama) == (kv / (a + 2 * kv), 0.0, 0.0, 1.0, 0.5, 0.0)


def test_selective_ac_option_op_needs_selective_granularity(capsys):
    from ptdp.cli import main

    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "16"]
    assert main([*base, "--recompute-granularity", "full", "--selective-ac-option", "op"]) == 2
    assert "--selective-ac-option op is a kind of selective checkpointing" in capsys.readouterr().err
    assert main([*base, "--selective-ac-option", "op", "--tp", "1", "--pp", "1", "--top", "1", "--json"]) == 0
    plans = __import__("json").loads(capsys.readouterr().out)
    assert plans and all(p["recompute"] == "op" for p in plans)


def test_recompute_modules_free_what_megatron_core_recomputes():
    """--recompute-modules (Megatron-Core's, with selective recompute): layernorm drops the QKV and
    fc1 inputs, mlp everything the MLP keeps but its input; core_attn alone is selective recompute;
    each costs its forward again (the MLP's GEMMs counted in the executed FLOPs)."""
    from ptdp.planner.time import flops

    llama = PRESETS["llama3-8b"]
    h, f = llama.hidden_size, llama.ffn
    kw = dict(sequence_parallel=True, recompute="selective")
    act = {m: layer_activation_bytes(llama, 4, 1, modules=m, **kw) for m in [("core_attn",), ("layernorm",), ("mlp",)]}
    both = layer_activation_bytes(llama, 4, 1, modules=("layernorm", "mlp"), **kw)
    s = llama.seq_length
    assert act[("core_attn",)] - act[("layernorm",)] == s * 2 * 2 * h / 4
    assert act[("core_attn",)] - act[("mlp",)] == s * (2 * h / 4 + (2 * 2 * f + 2 * f) / 4)
    assert act[("core_attn",)] - both == s * (2 * 2 * h / 4 + (2 * 2 * f + 2 * f) / 4)
    assert flops.module_recompute_time(llama, 4, 1, True, ("core_attn",), 989e12, 3.35e12, 0.8, 128.0) == 0.0
    mlp = flops.module_recompute_time(llama, 4, 1, True, ("mlp",), 989e12, 3.35e12, 0.8, 128.0)
    norms = flops.module_recompute_time(llama, 4, 1, True, ("layernorm",), 989e12, 3.35e12, 0.8, 128.0)
    assert mlp > norms > 0
    # the attention core counts only where core_attn is recomputed (unfused kernel), as its time does
    unfused = dataclasses.replace(PRESETS["gpt-1.7b"], use_flash_attn=False)
    core = 8 * unfused.num_layers * flops.attention_core_flops(unfused, 1, 1)
    base = flops.model_flops_per_step(unfused, 8)
    assert flops.hardware_flops_per_step(unfused, 8, "selective") == pytest.approx(base + core)
    assert flops.hardware_flops_per_step(unfused, 8, "selective", ("layernorm",)) == base
    gemms = flops.layer_gemms(llama, 1, 1)
    assert flops.hardware_flops_per_step(llama, 8, "selective", ("mlp",)) - flops.model_flops_per_step(
        llama, 8
    ) == pytest.approx(8 * llama.num_layers * (flops.gemm_flops(*gemms[4]) + flops.gemm_flops(*gemms[5])))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recompute-modules", "moe_act"], "--recompute-modules moe_act: the model has no MoE layers"),
        (
            ["--recompute-modules", "attn"],
            "--recompute-modules attn: unknown (known: core_attn, layernorm, mlp, moe_act, moe, shared_experts, mla_up_proj)",
        ),
        (
            ["--recompute-modules", "mlp", "--recompute-granularity", "full"],
            "it needs --recompute-granularity selective, not full",
        ),
        (["--recompute-modules", "mlp", "--selective-ac-option", "op"], "give one"),
    ],
)
def test_recompute_modules_refusals(capsys, extra, message):
    from ptdp.cli import main

    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "16"]
    assert main([*base, *extra]) == 2
    assert message in capsys.readouterr().err


def test_recompute_modules_are_planned_and_reported(capsys):
    from ptdp.cli import main

    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch-size", "16"]
    assert main([*base, "--tp", "2", "--recompute-modules", "layernorm", "mlp", "--top", "1", "--json"]) == 0
    plans = __import__("json").loads(capsys.readouterr().out)
    assert plans[0]["recompute"] == "selective" and plans[0]["recompute_modules"] == ["layernorm", "mlp"]
    assert main([*base, "--tp", "2", "--recompute-modules", "mlp", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "recompute=selective" in out or " selective " in out
    assert "changes nothing with flash attention" not in out
