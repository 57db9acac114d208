"""A random local Hugging Face Llama model and the tokens and comparisons of the Llama interop tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

SEQ, HIDDEN, VOCAB = 16, 64, 300  # 300 real rows, padded to 512 at tp = 2


def random_llama(path, *, kv_heads=2, tied=False, bias=False, shard=None, head_dim=None) -> LlamaForCausalLM:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        head_dim=head_dim,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms (and biases) too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return model


def tokens(vocab: int = VOCAB, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def assert_same_state(theirs: dict, ours: dict) -> None:
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
