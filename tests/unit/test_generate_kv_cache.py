"""Generation with a key/value cache equals recomputing the whole sequence: logits within 1e-9 in
float64 at every step (prompt, one position at a time, and past ``seq_length`` where the window
slides), the same greedy and sampled tokens in float64 and float32, for GPT (learned positions),
the Llama-like model (rotary, grouped-query attention) and Qwen3's heads (12 channels, query/key
norms); the cache is preallocated and written in place; ``ptdp generate`` and ``--no-kv-cache``
print the same text."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from helpers.host_sync import count_cuda_syncs, count_host_syncs
from helpers.layout_cases import VOCAB, tiny_config
from ptdp import cli
from ptdp.commands.generate import CachedDecoder, Recompute, generate, load_for_inference, next_token_logits
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.stage import build_stage
from ptdp.engine.tensor_parallel.sharding import initialize_parameters
from ptdp.run.checkpoint.folders import CheckpointError, check_model_shape, stored_moe
from ptdp.run.checkpoint.io import save_checkpoint

SEQ = 16
LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "num_query_groups": 2,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
}
KINDS = {"gpt": {}, "llama-gqa": LLAMA, "qwen3-heads": LLAMA | {"kv_channels": 12, "qk_layernorm": True}}


def _model(kind: str, dtype: str) -> GPTModel:
    """A 2-layer model (h 32, 4 heads, s 16, V 97) with weights large enough (std 0.2) that the
    tokens it picks vary."""
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=SEQ,
        vocab_size=97,
        make_vocab_size_divisible_by=8,
        params_dtype=dtype,
        **KINDS[kind],
    )
    model = GPTModel(cfg, AxisGroup.single("tp"), layer_ids=range(2), pre_process=True, post_process=True)
    initialize_parameters(model, seed=11, std=0.2, num_layers=2, tp_rank=0, tp_size=1)
    return model.eval()


class _Counting:
    """Records the number of positions of every ``decode`` call of ``model``."""

    def __init__(self, model: GPTModel) -> None:
        self.calls: list[int] = []
        original = model.decode

        def decode(tokens, cache):
            self.calls.append(tokens.shape[1])
            return original(tokens, cache)

        model.decode = decode


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_logits_equal_the_recomputed_ones_at_every_step_in_float64(kind):
    model = _model(kind, "float64")
    prompt, new = [3, 14, 15, 92, 65], 20  # 25 tokens > seq_length 16: the window slides after position 16
    tokens = generate(model, prompt, new, kv_cache=False)
    assert len(set(tokens[len(prompt) :])) > 3  # the model does not repeat one token
    decoder, recompute = CachedDecoder(model, len(prompt) + new), Recompute(model)
    counting = _Counting(model)
    for n in range(len(prompt), len(tokens)):
        torch.testing.assert_close(decoder(tokens[:n]), recompute(tokens[:n]), rtol=1e-9, atol=1e-9, msg=f"step {n}")
    # the prompt once, then one position per token up to the limit, then the 16-token window each step
    slides = len(tokens) - 1 - SEQ
    assert counting.calls == [len(prompt)] + [1] * (SEQ - len(prompt)) + [SEQ] * slides
    assert generate(model, prompt, new, kv_cache=True) == tokens


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_and_sampled_tokens_are_the_same_with_and_without_the_cache(kind, dtype):
    model = _model(kind, dtype)
    for prompt, new in (([7], 12), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 3), (list(range(20, 40)), 4)):
        greedy = generate(model, prompt, new, kv_cache=False)
        assert generate(model, prompt, new) == greedy, (prompt, new)
        for seed in (0, 5):
            sampled = generate(model, prompt, new, temperature=1.0, top_k=20, seed=seed, kv_cache=False)
            assert generate(model, prompt, new, temperature=1.0, top_k=20, seed=seed) == sampled, (prompt, seed)


def test_the_cache_holds_the_key_value_heads_only_and_is_written_in_place():
    model = _model("llama-gqa", "float64")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = CachedDecoder(model, 10)
    keys, values = decoder.cache.keys["0"], decoder.cache.values["1"]
    assert keys.shape == values.shape == (1, 2, 10, 8)  # [b, G/tp, max_len, d]: 2 groups, not 4 heads
    pointers = (keys.data_ptr(), values.data_ptr())
    tokens = [5, 6, 7]
    for _ in range(6):
        tokens.append(int(decoder(tokens).argmax()))
    assert decoder.cache.length == 8
    assert (decoder.cache.keys["0"].data_ptr(), decoder.cache.values["1"].data_ptr()) == pointers
    assert model.state_dict().keys() == state.keys() and not list(model.buffers())  # nothing kept on the model
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prompt_read_in_pieces_equals_one_prefill(kind):
    """Several positions after a prefix (the masked case of ``cached_attention``), batch of 2."""
    model = _model(kind, "float64")
    tokens = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model.hidden_states(tokens)  # [s, b, h], the training path
        cache = model.kv_cache(2, SEQ)
        pieces = [model.decode(tokens[:, a:b], cache) for a, b in ((0, 5), (5, 11), (11, 12), (12, SEQ))]
    assert cache.length == SEQ
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", list(KINDS))
def test_reading_into_the_cache_makes_no_host_synchronisation(kind):
    """The shim counts every call that would make the host wait for a GPU: prefill, single
    positions and a masked piece make none."""
    model = _model(kind, "float64")
    tokens = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(4))
    cache = model.kv_cache(2, SEQ)
    with torch.no_grad(), count_host_syncs() as syncs:
        model.decode(tokens[:, :5], cache)
        for i in range(5, 9):
            model.decode(tokens[:, i : i + 1], cache)
        model.decode(tokens[:, 9:12], cache)
    assert syncs.calls == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_bfloat16_cached_logits_are_the_recomputed_ones_to_its_rounding(kind):
    model = _model(kind, "bfloat16")
    tokens = generate(model, [3, 4, 5], 16, kv_cache=False)
    decoder, recompute = CachedDecoder(model, 19), Recompute(model)
    for n in range(3, len(tokens)):
        torch.testing.assert_close(decoder(tokens[:n]), recompute(tokens[:n]), rtol=0.02, atol=0.05)
    assert decoder.cache.keys["0"].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_on_cuda_the_cache_gives_the_same_tokens_and_no_synchronisation(kind):
    model = _model(kind, "float32").cuda()
    prompt, new = [3, 14, 15, 92, 65], 20
    assert generate(model, prompt, new) == generate(model, prompt, new, kv_cache=False)
    tokens = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(4)).cuda()
    for dtype in ("float32", "bfloat16"):
        model = _model(kind, dtype).cuda()
        with torch.no_grad():
            whole = model.hidden_states(tokens)
            model.decode(tokens[:, :2], model.kv_cache(2, SEQ))  # warm-up: rotary tables, kernels
            cache = model.kv_cache(2, SEQ)
            with count_cuda_syncs() as syncs:
                pieces = [model.decode(tokens[:, :5], cache)]
                pieces += [model.decode(tokens[:, i : i + 1], cache) for i in range(5, 9)]
                pieces.append(model.decode(tokens[:, 9:], cache))
        assert syncs.calls == [], dtype
        tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == "float32" else {"rtol": 0.02, "atol": 0.05}
        torch.testing.assert_close(torch.cat(pieces), whole, **tol)


def test_what_the_cache_refuses():
    model = _model("gpt", "float64")
    with pytest.raises(ValueError, match="max_len=17 exceeds the model's seq_length=16"):
        model.kv_cache(1, SEQ + 1)
    cache = model.kv_cache(1, 4)
    with torch.no_grad():
        model.decode(torch.tensor([[1, 2, 3]]), cache)
        with pytest.raises(ValueError, match="holds 4 positions; 3 \\+ 2 do not fit"):
            model.decode(torch.tensor([[4, 5]]), cache)
    stage = GPTModel(model.cfg, AxisGroup.single("tp"), layer_ids=range(1), pre_process=True, post_process=False)
    with pytest.raises(ValueError, match="needs the whole model"):
        stage.kv_cache(1, 4)


def test_ptdp_generate_prints_the_same_text_with_and_without_the_cache(tmp_path, capsys):
    cfg = tiny_config(1, 1, 1, "float32", **LLAMA)
    stage = build_stage(cfg, ParallelGroups.single_process())
    initialize_parameters(stage.model, seed=4, std=0.2, num_layers=cfg.model.num_layers, tp_rank=0, tp_size=1)
    save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=0)
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    args = [
        "generate",
        "--load",
        str(tmp_path / "ckpt"),
        "--prompt",
        "w5 w9 w200",
        "--max-new-tokens",
        "10",
        "--tokenizer",
        str(tmp_path / "tok.json"),
    ]  # 13 tokens > seq_length 8
    texts = []
    for extra in ([], ["--no-kv-cache"], ["--temperature", "1"], ["--temperature", "1", "--no-kv-cache"]):
        assert cli.main(args + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert texts[0].startswith("w5 w9 w200 ") and len(texts[0].split()) == 13 and texts[0] != texts[2]


def test_ptdp_generate_refuses_a_tokenizer_of_another_size(tmp_path, capsys):
    """A tokenizer whose vocabulary differs from the model's is a bad request (exit 2 naming both
    sizes), not an index error or garbage text; a --tokenizer that is not a file is named as given."""
    cfg = tiny_config(1, 1, 1, "float32", **LLAMA)
    stage = build_stage(cfg, ParallelGroups.single_process())
    save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=0)
    base = ["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "w5 w9", "--max-new-tokens", "2"]
    for size in (VOCAB - 1, VOCAB + 7):
        tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
        tokenizer.pre_tokenizer = Whitespace()
        tokenizer.save(str(tmp_path / f"tok{size}.json"))
        assert cli.main(base + ["--tokenizer", str(tmp_path / f"tok{size}.json")]) == 2
        err = capsys.readouterr().err
        assert f"has {size} tokens but the model has a vocabulary of {VOCAB}: they must be equal" in err
    assert cli.main(base + ["--tokenizer", str(tmp_path)]) == 2
    assert f"--tokenizer {tmp_path}: not a file" in capsys.readouterr().err


def test_an_moe_checkpoint_generates_dropless_with_and_without_the_cache(tmp_path):
    """An MoE checkpoint (4 experts, top-2, a dense first layer, Qwen3's heads, trained with a
    capacity) records its MoE options: it loads for generation with them, dropless, its logits
    those of the model saved, the cached ones equal to the recomputed ones; a dense model does not
    load it."""
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=(0, 1, 1, 1))
    model = dataclasses.replace(
        tiny_config(1, 1, 1, "float64").model, **LLAMA, kv_channels=12, qk_layernorm=True, seq_length=SEQ
    )
    train = TrainConfig(micro_batch_size=1, global_batch_size=1)
    cfg = resolve(
        Config(
            model=model,
            moe=dataclasses.replace(moe, moe_expert_capacity_factor=0.5),
            parallel=ParallelConfig(1, 1, 1),
            train=train,
        ),
        1,
    )
    stage = build_stage(cfg, ParallelGroups.single_process())
    initialize_parameters(stage.model, seed=4, std=0.2, num_layers=4, tp_rank=0, tp_size=1)
    save_checkpoint(stage, tmp_path / "ckpt", 1, consumed_samples=0)
    loaded, meta, _ = load_for_inference(tmp_path / "ckpt", "float64")
    assert stored_moe(meta) == dataclasses.replace(moe, moe_expert_capacity_factor=0.5)
    assert [type(layer.mlp).__name__ for layer in loaded.layers.values()] == ["MLP"] + ["MoELayer"] * 3
    assert loaded.layers["1"].mlp.moe.moe_expert_capacity_factor is None
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    dropless = dataclasses.replace(cfg, moe=moe)
    reference = build_stage(dropless, ParallelGroups.single_process()).model.eval()
    reference.load_state_dict(stage.model.state_dict())
    x = torch.tensor([prompt])
    torch.testing.assert_close(next_token_logits(loaded, x), next_token_logits(reference, x), rtol=0, atol=0)
    tokens = generate(loaded, prompt, 12, kv_cache=False)
    decoder, recompute = CachedDecoder(loaded, len(tokens)), Recompute(loaded)
    for n in range(len(prompt), len(tokens)):
        torch.testing.assert_close(decoder(tokens[:n]), recompute(tokens[:n]), rtol=1e-9, atol=1e-9, msg=f"step {n}")
    assert generate(loaded, prompt, 12) == tokens
    with pytest.raises(CheckpointError, match="different model: 4 experts in the checkpoint, a dense model here"):
        check_model_shape(tmp_path / "ckpt", dataclasses.replace(cfg, moe=MoEConfig()))
    other = dataclasses.replace(moe, moe_layer_freq=(1,), num_experts=8)
    with pytest.raises(CheckpointError, match=r"num_experts 4 in the checkpoint, 8 here .*MoE layers \[1, 2, 3\] in"):
        check_model_shape(tmp_path / "ckpt", dataclasses.replace(cfg, moe=other))
