"""The Llama-like model options piece by piece, in one process: rotary embeddings against their
formula, RMSNorm, grouped-query attention against repeated key/value heads, and the tensor-parallel
shards of the grouped QKV projection and of the SwiGLU MLP (tp = 1, 2, 4 give the same output).
The whole model at every layout is checked in tests/dist/test_layout_equivalence.py (variant ``llama``)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config.flags import config_from_args
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.config.train_flags import add_train_arguments
from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.model.attention import Attention
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.model.layer import MLP
from ptdp.engine.model.norms import RMSNorm
from ptdp.engine.model.rotary import RotaryEmbedding
from ptdp.engine.tensor_parallel.sharding import global_param, initialize_parameters, shard
from ptdp.errors import ConfigError

LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    num_query_groups=2,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
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
    return dataclasses.replace(base, **overrides)


def _tp(rank: int, size: int) -> AxisGroup:
    """A tp axis as rank ``rank`` of ``size`` sees it, without a process group: enough for the
    column-parallel forward (f is the identity forward); row-parallel sums are done by the test."""
    return AxisGroup("tp", tuple(range(size)), rank, None, CommStats())


class _PartialRowParallel(nn.Module):
    """Stands in for a RowParallelLinear: returns this rank's partial product (no all-reduce)."""

    def __init__(self, row: nn.Module) -> None:
        super().__init__()
        self.weight = row.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _sharded_output(make, x: torch.Tensor, tp_size: int, out_attr: str) -> torch.Tensor:
    """Sum over the tp ranks of the module's output with its row-parallel ``out_attr`` replaced by
    partial products: what the all-reduce of the real layer would give."""
    total = 0
    for rank in range(tp_size):
        module = make(_tp(rank, tp_size))
        initialize_parameters(module, seed=7, std=0.2, num_layers=2, tp_rank=rank, tp_size=tp_size)
        setattr(module, out_attr, _PartialRowParallel(getattr(module, out_attr)))
        total = total + module(x)
    return total


def test_rope_turns_each_channel_pair_by_position_times_frequency():
    torch.manual_seed(0)
    b, heads, s, d, base = 2, 3, 7, 8, 10000.0
    x = torch.randn(b, heads, s, d, dtype=torch.float64)
    got = RotaryEmbedding(d, base)(x)
    want = torch.empty_like(x)
    for p in range(s):
        for i in range(d // 2):
            theta = p * base ** (-2 * i / d)  # pair (i, i + d/2) as a complex number, times e^(i theta)
            turned = (x[:, :, p, i] + 1j * x[:, :, p, i + d // 2]) * complex(math.cos(theta), math.sin(theta))
            want[:, :, p, i], want[:, :, p, i + d // 2] = turned.real, turned.imag
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[:, :, 0], x[:, :, 0])  # position 0 is not turned


def test_rope_scores_depend_only_on_the_distance():
    torch.manual_seed(1)
    d, s = 16, 12
    rope = RotaryEmbedding(d, 500.0)
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    qs, ks = rope(q.expand(1, 1, s, d)), rope(k.expand(1, 1, s, d))
    scores = qs[0, 0] @ ks[0, 0].T  # [m, n]: q at position m . k at position n
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(scores[0, 0], scores[0, 1])


def test_rms_norm_matches_its_formula():
    torch.manual_seed(2)
    norm = RMSNorm(16, 1e-5, torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 4
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def _reference_gqa(cfg: ModelConfig, attention: Attention, x: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention written out: per group the rows [q of its a/G heads, k, v] of the
    fused weight, k and v repeated for each query head of the group, causal softmax, projection."""
    a, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.hidden_size // cfg.num_attention_heads
    w = attention.qkv.weight.view(g, a // g + 2, d, cfg.hidden_size)
    q = torch.einsum("bsh,gjdh->bgjsd", x, w[:, : a // g]).reshape(x.shape[0], a, x.shape[1], d)
    k = torch.einsum("bsh,gdh->bgsd", x, w[:, a // g]).repeat_interleave(a // g, dim=1)
    v = torch.einsum("bsh,gdh->bgsd", x, w[:, a // g + 1]).repeat_interleave(a // g, dim=1)
    if attention.rotary is not None:
        q, k = attention.rotary(q), attention.rotary(k)
    s = x.shape[1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return F.linear(out.transpose(1, 2).reshape(x.shape[0], s, a * d), attention.proj.weight)


@pytest.mark.parametrize("rope", [False, True])
def test_grouped_query_attention_equals_repeated_key_value_heads(rope):
    cfg = _model(
        num_attention_heads=8,
        num_query_groups=2,
        add_bias_linear=False,
        position_embedding_type="rope" if rope else "learned_absolute",
    )
    attention = Attention(cfg, AxisGroup.single("tp"), torch.float64)
    initialize_parameters(attention, seed=3, std=0.3, num_layers=2, tp_rank=0, tp_size=1)
    assert attention.qkv.weight.shape == ((8 + 2 * 2) * 4, 32)
    x = torch.randn(2, 6, 32, dtype=torch.float64)  # [b, s, h]; the layer takes [s, b, h]
    got = attention(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(got, _reference_gqa(cfg, attention, x), rtol=1e-10, atol=1e-12)


def test_grouped_qkv_shard_holds_whole_groups():
    """tp = 2, G = 4, a = 8: rank r holds groups 2r and 2r + 1, each [2 q heads, k, v] (d rows)."""
    cfg = _model(num_attention_heads=8, num_query_groups=4)
    full = Attention(cfg, AxisGroup.single("tp"), torch.float64)
    initialize_parameters(full, seed=3, std=0.3, num_layers=2, tp_rank=0, tp_size=1)
    d, rows_per_group = 4, (8 // 4 + 2) * 4
    w = full.qkv.weight.detach()
    for rank in range(2):
        mine = shard(w, global_param(full.qkv.weight), rank, 2)
        assert torch.equal(mine, w[rank * 2 * rows_per_group : (rank + 1) * 2 * rows_per_group])
        first_q_head_of_rank = rank * 4  # a / tp query heads per rank
        assert torch.equal(mine[:d], w[first_q_head_of_rank // 2 * rows_per_group :][:d])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_grouped_attention_shards_sum_to_the_single_process_output(tp_size):
    cfg = _model(num_attention_heads=8, num_query_groups=4, position_embedding_type="rope", add_bias_linear=False)
    x = torch.randn(6, 2, 32, dtype=torch.float64)  # [s, b, h]
    want = _sharded_output(lambda tp: Attention(cfg, tp, torch.float64), x, 1, "proj")
    got = _sharded_output(lambda tp: Attention(cfg, tp, torch.float64), x, tp_size, "proj")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_shards_hold_matching_gate_and_up_columns(bias):
    """fc1 = [gate | up]; at tp = 1, 2 and 4 every rank's shard holds the gate and up rows of the
    same ffn / tp channels, so the summed partial outputs equal the single-process MLP, which is
    fc2(silu(x gate^T) * (x up^T))."""
    cfg = _model(swiglu=True, add_bias_linear=bias)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    mlp = MLP(cfg, AxisGroup.single("tp"), torch.float64)
    initialize_parameters(mlp, seed=7, std=0.2, num_layers=2, tp_rank=0, tp_size=1)
    w1, ffn = mlp.fc1.weight, cfg.ffn
    y = F.linear(x, w1, mlp.fc1.bias)
    want = F.linear(F.silu(y[..., :ffn]) * y[..., ffn:], mlp.fc2.weight)
    torch.testing.assert_close(_sharded_output(lambda tp: MLP(cfg, tp, torch.float64), x, 1, "fc2"), want)
    for tp_size in (2, 4):
        got = _sharded_output(lambda tp: MLP(cfg, tp, torch.float64), x, tp_size, "fc2")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        rows = ffn // tp_size
        for rank in range(tp_size):
            mine = shard(w1.detach(), global_param(w1), rank, tp_size)
            assert torch.equal(mine[:rows], w1[rank * rows : (rank + 1) * rows])  # gate
            assert torch.equal(mine[rows:], w1[ffn + rank * rows : ffn + (rank + 1) * rows])  # up


def test_llama_model_has_no_biases_and_no_position_table():
    model = GPTModel(_model(**LLAMA), AxisGroup.single("tp"), layer_ids=range(2), pre_process=True, post_process=True)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith(".bias") for n in names), names
    assert "position_embeddings" not in names and "output_layer.weight" in names
    assert model.layers["0"].mlp.fc1.weight.shape == (2 * 48, 32)
    assert model.layers["0"].attention.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    gpt = GPTModel(_model(), AxisGroup.single("tp"), layer_ids=range(2), pre_process=True, post_process=True)
    assert "position_embeddings" in dict(gpt.named_parameters())


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
    "model,tp,message",
    [
        (
            {"num_query_groups": 2},
            4,
            "num_query_groups=2 is not divisible by tensor_model_parallel_size=4 (rule: query groups must divide by tp",
        ),
        ({"num_query_groups": 3}, 1, "num_attention_heads=4 is not divisible by num_query_groups=3"),
        ({"num_query_groups": 0}, 1, "num_query_groups=0 must be a positive integer"),
        (
            {"position_embedding_type": "rope", "hidden_size": 36, "num_attention_heads": 4},
            1,
            "head dim hidden_size / num_attention_heads = 36/4 = 9 is odd",
        ),
        ({"normalization": "BatchNorm"}, 1, "normalization='BatchNorm' must be one of"),
        ({"position_embedding_type": "alibi"}, 1, "position_embedding_type='alibi' must be one of"),
        ({"rotary_base": -1.0}, 1, "rotary_base=-1.0 must be > 0"),
        ({"swiglu": True, "activation": "gelu_tanh"}, 1, "activation='gelu_tanh' has no effect with swiglu"),
    ],
)
def test_invalid_llama_options_are_named(model, tp, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        _resolve(tp, **model)


def test_flags_set_the_model_options():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=False)
    args = parser.parse_args(
        [
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "500000",
            "--num-query-groups",
            "2",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
        ]
    )
    m = config_from_args(args).model
    assert (
        m.normalization,
        m.swiglu,
        m.position_embedding_type,
        m.rotary_base,
        m.num_query_groups,
        m.add_bias_linear,
        m.untie_embeddings_and_output_weights,
    ) == ("RMSNorm", True, "rope", 500000.0, 2, False, True)
    m = config_from_args(parser.parse_args([])).model
    assert (m.normalization, m.swiglu, m.position_embedding_type, m.num_query_groups, m.add_bias_linear) == (
        "LayerNorm",
        False,
        "learned_absolute",
        None,
        True,
    )


def test_gpt2_export_refuses_llama_options():
    from ptdp.run.checkpoint.folders import CheckpointError
    from ptdp.run.checkpoint.hf import _gpt2_config

    meta = dataclasses.asdict(_model(**LLAMA)) | {"ffn": 48}
    with pytest.raises(CheckpointError, match="normalization='RMSNorm', swiglu=True, position_embedding_type='rope'"):
        _gpt2_config(meta)
    assert _gpt2_config(dataclasses.asdict(_model()) | {"ffn": 48})["model_type"] == "gpt2"


def test_generation_works_without_a_position_table():
    from ptdp.commands.generate import generate, next_token_logits

    model = GPTModel(_model(**LLAMA), AxisGroup.single("tp"), layer_ids=range(2), pre_process=True, post_process=True)
    initialize_parameters(model, seed=5, std=0.2, num_layers=2, tp_rank=0, tp_size=1)
    tokens = generate(model, [1, 2, 3], 8)  # longer than seq_length = 6: the window slides
    assert len(tokens) == 11 and tokens[:3] == [1, 2, 3]
    x = model.word_embeddings(torch.tensor([[1, 2, 3]]).t())  # [s, b, h]; no positions: rotary acts in attention
    for layer in model.layers.values():
        x = layer(x)
    want = F.linear(model.final_norm(x[-1]), model.output_layer.real_weight()).float()
    torch.testing.assert_close(next_token_logits(model, torch.tensor([[1, 2, 3]])), want)
