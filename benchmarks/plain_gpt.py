"""The plain PyTorch GPT the benchmarks compare ptdp with (``bench_step.py``, ``gpu_check.py``).

A textbook pre-LayerNorm GPT with tied embeddings, learned positions, exact GELU and biases, written
as one would write it without ptdp; :func:`copy_weights` gives it the weights of a ptdp model of the
same shape (tp = pp = dp = 1), so both compute the same loss. Like nanoGPT it pads its word
embedding to a multiple of 64 rows (GPT-2's 50,257 to 50,304), so its logits GEMM has an even
shape; the cross entropy reads the real vocabulary's columns only, as ptdp's does. :func:`plain_step` is its training
step: gradient accumulation over the microbatches, ``clip_grad_norm_`` and one AdamW step, with no
host synchronisation (the loss stays on the device).

Precision: float32 and float64 models run in their dtype; for bfloat16 the parameters stay float32
and the forward runs under ``torch.autocast`` (the usual way to train in bf16 without a framework).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainBlock(nn.Module):
    """One pre-LayerNorm transformer layer: ``[b, s, h] -> [b, s, h]``."""

    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


VOCAB_MULTIPLE = 64
"""The plain GPT's word embedding has a multiple of this many rows (nanoGPT's padding)."""


def padded_vocab(vocab: int) -> int:
    """``vocab`` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (50,257 -> 50,304)."""
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class PlainGPT(nn.Module):
    """Tokens ``[b, s]`` and labels ``[b, s]`` -> the mean cross entropy over the ``b * s`` tokens.

    The word embedding is ``[padded_vocab(vocab), h]``; the logits ``[b, s, V_pad]`` come from one
    GEMM on all of it, the cross entropy from their first ``vocab`` columns (the padding rows are
    never a label and get no gradient)."""

    def __init__(self, vocab: int, seq: int, h: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(padded_vocab(vocab), h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits[..., : self.vocab].flatten(0, 1), labels.flatten())

    def flop_params(self) -> int:
        """Parameters N of the FLOP count ``6N + 12 l h s`` per token: all but the position table
        (a lookup) and the padding rows; the tied word embedding counts once, for the logits GEMM,
        on the real vocabulary."""
        padding = (self.wte.weight.shape[0] - self.vocab) * self.wte.weight.shape[1]
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel() - padding


def plain_like(config) -> PlainGPT:
    """A :class:`PlainGPT` of the shape of a resolved ptdp ``config`` (GPT defaults only)."""
    m = config.model
    if (m.normalization, m.activation, m.position_embedding_type, m.swiglu) != (
        "LayerNorm",
        "gelu",
        "learned_absolute",
        False,
    ):
        raise ValueError("the plain GPT has LayerNorm, exact GELU and learned positions only")
    if (
        m.untie_embeddings_and_output_weights
        or not m.add_bias_linear
        or m.num_query_groups not in (None, m.num_attention_heads)
    ):
        raise ValueError("the plain GPT has tied embeddings, biases and multi-head attention only")
    return PlainGPT(m.vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn, m.num_layers)


def copy_weights(ptdp_model, plain: PlainGPT, vocab: int) -> None:
    """Copy a tp = pp = dp = 1 ptdp model's weights into ``plain``: the real vocabulary's rows of the
    word embedding (each model pads its own), the plain model's padding rows zero."""
    src = dict(ptdp_model.named_parameters())
    with torch.no_grad():
        plain.wte.weight[:vocab].copy_(src["word_embeddings.weight"][:vocab])
        plain.wte.weight[vocab:].zero_()
        plain.wpe.weight.copy_(src["position_embeddings"])
        plain.ln_f.weight.copy_(src["final_norm.weight"])
        plain.ln_f.bias.copy_(src["final_norm.bias"])
        names = {
            "ln1": "ln1",
            "ln2": "ln2",
            "qkv": "attention.qkv",
            "proj": "attention.proj",
            "fc1": "mlp.fc1",
            "fc2": "mlp.fc2",
        }
        for i, block in enumerate(plain.blocks):
            for mine, theirs in names.items():
                getattr(block, mine).weight.copy_(src[f"layers.{i}.{theirs}.weight"])
                getattr(block, mine).bias.copy_(src[f"layers.{i}.{theirs}.bias"])


def plain_optimizer(plain: PlainGPT, train_cfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW with ptdp's settings: decay on tensors of >= 2 dims only; fused on CUDA."""
    decay = [p for p in plain.parameters() if p.ndim >= 2]
    rest = [p for p in plain.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=train_cfg.lr,
        betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
        eps=train_cfg.adam_eps,
        fused=True if device.type == "cuda" else None,
    )


def plain_step(
    model,
    optimizer,
    microbatches,
    clip: float,
    *,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One step over ``microbatches`` (CPU ``(tokens, labels)`` pairs, copied to ``device`` one by
    one); returns the mean loss as a 0-dim tensor on the device (no host synchronisation)."""
    device = torch.device(device)
    optimizer.zero_grad(set_to_none=False)
    losses = []
    for tokens, labels in microbatches:
        tokens = tokens.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = model(tokens, labels) / len(microbatches)
        loss.backward()
        losses.append(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return torch.stack(losses).sum()


def with_compile(config):
    """``config`` with ptdp's compile option switched on, or None when this ptdp has no ``--compile``
    flag in its schema (the compiled comparison is then left out)."""
    import dataclasses

    from ptdp.config.schema import SECTIONS

    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag")
            if flag is not None and flag.name == "--compile":
                part = dataclasses.replace(getattr(config, section), **{f.name: True})
                return dataclasses.replace(config, **{section: part})
    return None
