"""The head options of Qwen3-like models in one process: ``--kv-channels`` (heads of d channels,
not h / a) and ``--qk-layernorm`` (each head's q and k normalized before rotary positions) against
the attention written out, their tensor-parallel shards summing to the single-process output, the
tp marks of the norms' gradients, the rules, the flags and the planner's parameter counts (the
whole model at tp = 2, with and without sequence parallelism:
tests/dist/test_layout_equivalence.py, variants ``qk_norm`` and ``sp_qk_norm``)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.flags import config_from_args
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.config.train_flags import add_train_arguments
from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.model.attention import Attention
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.tensor_parallel.sequence import is_sequence_parallel
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.errors import ConfigError
from ptdp.planner.memory.chunk_params import layer_param_sizes
from ptdp.planner.memory.params import layer_param_count, stage_param_counts

QWEN3 = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    kv_channels=12,  # h / a = 8
    qk_layernorm=True,
)


def _model(**overrides) -> ModelConfig:
    base = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=6,
        vocab_size=300,
        params_dtype="float64",
    )
    return dataclasses.replace(base, **(QWEN3 | overrides))


def _tp(rank: int, size: int) -> AxisGroup:
    return AxisGroup("tp", tuple(range(size)), rank, None, CommStats())


def _attention(cfg: ModelConfig, tp: AxisGroup, seed: int = 3) -> Attention:
    attention = Attention(cfg, tp, torch.float64)
    initialize_parameters(attention, seed=seed, std=0.3, num_layers=2, tp_rank=tp.rank, tp_size=tp.size)
    with torch.no_grad():  # norms that are not the identity
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:
                for p in norm.parameters():
                    p.copy_(1 + 0.5 * torch.sin(torch.arange(p.numel(), dtype=torch.float64) + seed))
    return attention


def _reference(cfg: ModelConfig, attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """The attention written out for ``x`` ``[b, s, h]``: per group the rows [q of its a/G heads, k, v]
    of the fused weight, RMSNorm of each head's q and k over its d channels, rotary positions, k
    and v repeated for each query head, causal softmax with scale 1/sqrt(d), projection from a d."""
    a, g, d, h = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    b, s, _ = x.shape
    w = attention.qkv.weight.view(g, a // g + 2, d, h)
    q = torch.einsum("bsh,gjdh->bgjsd", x, w[:, : a // g]).reshape(b, a, s, d)
    k = torch.einsum("bsh,gdh->bgsd", x, w[:, a // g])
    v = torch.einsum("bsh,gdh->bgsd", x, w[:, a // g + 1])

    def rms(t, weight):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * weight

    q, k = rms(q, attention.q_norm.weight), rms(k, attention.k_norm.weight)
    q, k = attention.rotary(q), attention.rotary(k)
    k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    out = scores.softmax(-1) @ v
    return F.linear(out.transpose(1, 2).reshape(b, s, a * d), attention.proj.weight)


@pytest.mark.parametrize("groups", [None, 2], ids=["multi-head", "grouped"])
def test_attention_with_wide_heads_and_qk_norms_equals_its_formula(groups):
    cfg = _model(num_query_groups=groups)
    attention = _attention(cfg, AxisGroup.single("tp"))
    assert attention.qkv.weight.shape == ((4 + 2 * cfg.kv_heads) * 12, 32)
    assert attention.proj.weight.shape == (32, 4 * 12)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (12,)
    x = torch.randn(2, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = attention(x.transpose(0, 1)).transpose(0, 1)
    if groups is None:  # [q | k | v] blocks: the same as one group per head
        ref_cfg = dataclasses.replace(cfg, num_query_groups=4)
        w = attention.qkv.weight.view(3, 4, 12, 32).transpose(0, 1).reshape(-1, 32)
        ref = _attention(ref_cfg, AxisGroup.single("tp"))
        with torch.no_grad():
            ref.qkv.weight.copy_(w)
            ref.proj.weight.copy_(attention.proj.weight)
            ref.q_norm.weight.copy_(attention.q_norm.weight)
            ref.k_norm.weight.copy_(attention.k_norm.weight)
        cfg, attention = ref_cfg, ref
    torch.testing.assert_close(got, _reference(cfg, attention, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_attention_shards_sum_to_the_single_process_output(tp_size, normalization):
    """Each tp rank's heads with the replicated norms; the partial projections sum to tp = 1's."""
    cfg = _model(num_attention_heads=8, num_query_groups=4, normalization=normalization)
    x = torch.randn(6, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def summed(size: int) -> torch.Tensor:
        total = torch.zeros(())
        for rank in range(size):
            attention = _attention(cfg, _tp(rank, size))
            q, k, v = attention.project(x)
            q, k = attention.rotary(q), attention.rotary(k)
            out = attention.core(q, k, v).permute(2, 0, 1, 3).flatten(2)
            total = total + F.linear(out, attention.proj.weight)  # this rank's partial sum
        return total

    torch.testing.assert_close(summed(tp_size), summed(1), rtol=1e-10, atol=1e-12)


def test_qk_norm_gradients_are_marked_for_the_tp_sum_at_tp_above_one():
    for size, marked in ((1, False), (2, True)):
        attention = Attention(_model(num_query_groups=2), _tp(0, size), torch.float64)
        norms = [*attention.q_norm.parameters(), *attention.k_norm.parameters()]
        assert [is_sequence_parallel(p) for p in norms] == [marked] * len(norms)
        assert not is_sequence_parallel(attention.qkv.weight)
    assert Attention(_model(qk_layernorm=False), _tp(0, 2), torch.float64).q_norm is None


def _resolve(tp: int = 1, **model) -> Config:
    return resolve(
        Config(
            model=_model(**model),
            parallel=ParallelConfig(tp, 1, 1),
            train=TrainConfig(micro_batch_size=1, global_batch_size=1),
        ),
        tp,
    )


@pytest.mark.parametrize(
    "model,message",
    [
        ({"kv_channels": 7}, "kv_channels=7 is odd (rule: rotary embeddings turn pairs of channels"),
        ({"kv_channels": 0}, "kv_channels=0 must be a positive integer"),
        ({"kv_channels": None, "hidden_size": 30}, "hidden_size=30 is not divisible by num_attention_heads=4"),
    ],
)
def test_invalid_head_options_are_named(model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _resolve(**model)


def test_wide_heads_need_no_hidden_size_divisible_by_heads():
    assert _resolve(hidden_size=30, kv_channels=8).model.head_dim == 8
    assert _resolve(kv_channels=None).model.head_dim == 32 // 4


def test_flags_set_the_head_options():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=False)
    m = config_from_args(parser.parse_args(["--kv-channels", "128", "--qk-layernorm"])).model
    assert (m.kv_channels, m.qk_layernorm) == (128, True)
    m = config_from_args(parser.parse_args([])).model
    assert (m.kv_channels, m.qk_layernorm, m.head_dim) == (None, False, m.hidden_size // m.num_attention_heads)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_planner_counts_the_parameters_ptdp_builds(tp, pp, normalization):
    cfg = _model(num_attention_heads=8, num_query_groups=2, normalization=normalization, num_layers=4)
    want = []
    for pp_rank in range(pp):
        stage = GPTModel(
            cfg,
            _tp(0, tp),
            layer_ids=range(pp_rank * 4 // pp, (pp_rank + 1) * 4 // pp),
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp - 1,
        )
        want.append(sum(p.numel() for p in stage.parameters()))
    assert stage_param_counts(cfg, tp, pp, make_vocab_size_divisible_by=128) == want
    layer = GPTModel(cfg, _tp(0, tp), layer_ids=range(1), pre_process=False, post_process=False).layers["0"]
    assert layer_param_sizes(cfg, tp) == tuple(p.numel() for p in layer.parameters())
    assert sum(layer_param_sizes(cfg, tp)) == layer_param_count(cfg, tp)


def test_ptdp_plan_refuses_the_head_sizes_ptdp_train_refuses(capsys):
    from ptdp import cli

    shape = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 512 --vocab-size 1000"
    for d in ("0", "-4"):
        argv = ["plan", *shape.split(), "--seq-length", "128", "--gpus", "1", "--gpu", "h100-sxm", "--kv-channels", d]
        assert cli.main(argv) == 2
        assert f"kv_channels={d} must be a positive integer (the channels of a head)" in capsys.readouterr().err


def test_hugging_face_head_shapes_import_as_transformers_reads_them(tmp_path):
    """A head size of hidden // heads when heads do not divide hidden is kept; a Qwen3 config without
    head_dim or key/value heads has transformers' 128 and 32; Qwen3's attention biases are planned."""
    import json

    from ptdp.planner.inputs.hf_config import load_hf_config
    from ptdp.run.checkpoint.hf import configs_from_hf

    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 66,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "max_position_embeddings": 16,
    }
    model, _ = configs_from_hf(qwen3)
    assert model.kv_channels == 16 and model.head_dim == 16
    bare = {k: v for k, v in qwen3.items() if k not in ("head_dim", "num_key_value_heads")}
    bare |= {"hidden_size": 64, "num_attention_heads": 32}
    model, _ = configs_from_hf(bare)
    assert (model.head_dim, model.kv_heads) == (128, 32)
    (tmp_path / "config.json").write_text(json.dumps(bare | {"attention_bias": True}))
    planned, _ = load_hf_config(tmp_path)
    assert (planned.head_dim, planned.kv_heads, planned.linears_with_bias) == (128, 32, ("qkv", "proj"))


def test_a_gpt2_export_names_the_options_gpt2_lacks():
    from ptdp.run.checkpoint.folders import CheckpointError
    from ptdp.run.checkpoint.hf_llama import check_options, is_gpt2_like

    m = {"hidden_size": 64, "num_attention_heads": 4}
    assert is_gpt2_like(m | {"kv_channels": 16})  # hidden / heads: GPT-2's own head size
    assert not is_gpt2_like(m | {"kv_channels": 24})
    with pytest.raises(CheckpointError, match="kv_channels=24, qk_layernorm=True, which GPT-2 cannot express"):
        check_options(m | {"kv_channels": 24, "qk_layernorm": True}, "Llama", qk_layernorm=False)
