"""Time one training step of ptdp's GPT at tp=pp=dp=1 against a plain PyTorch GPT of the same shape.

Both models start from the same weights, see the same microbatches, accumulate gradients over them,
clip the global norm and take one ``torch.optim.AdamW`` step. Steps alternate between the two
(ptdp, plain, ptdp, plain, ...) so machine noise hits both alike; the report gives the median step
time of each and the ratio ptdp / plain (target <= 1.05). It also checks that both compute the
same first-step loss.

    python benchmarks/bench_step.py                   # default ptdp train model shape
    python benchmarks/bench_step.py --hidden-size 256 --num-layers 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.spec import Config, ModelConfig, ParallelConfig, TrainConfig, resolve
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.step import build_stage, train_step


class PlainBlock(nn.Module):
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


class PlainGPT(nn.Module):
    """A textbook pre-LayerNorm GPT with tied embeddings, as one would write it without ptdp."""

    def __init__(self, vocab: int, seq: int, h: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def copy_weights(ptdp_model, plain: PlainGPT, vocab: int) -> None:
    src = dict(ptdp_model.named_parameters())
    with torch.no_grad():
        plain.wte.weight.copy_(src["word_embeddings.weight"][:vocab])
        plain.wpe.weight.copy_(src["position_embeddings"])
        plain.ln_f.weight.copy_(src["final_norm.weight"])
        plain.ln_f.bias.copy_(src["final_norm.bias"])
        names = {"ln1": "ln1", "ln2": "ln2", "qkv": "attention.qkv", "proj": "attention.proj",
                 "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
        for i, block in enumerate(plain.blocks):
            for mine, theirs in names.items():
                getattr(block, mine).weight.copy_(src[f"layers.{i}.{theirs}.weight"])
                getattr(block, mine).bias.copy_(src[f"layers.{i}.{theirs}.bias"])


def plain_step(model, optimizer, microbatches, clip: float) -> float:
    optimizer.zero_grad(set_to_none=False)
    total = 0.0
    for tokens, labels in microbatches:
        loss = model(tokens, labels) / len(microbatches)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                            vocab_size=args.vocab_size)
    train_cfg = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                            train_iters=10_000, lr_warmup_iters=0, lr=1e-4, min_lr=1e-4)
    config = resolve(Config(model=model_cfg, parallel=ParallelConfig(), train=train_cfg), 1)
    stage = build_stage(config, ParallelGroups.single_process())
    plain = PlainGPT(args.vocab_size, args.seq_length, args.hidden_size, args.num_attention_heads,
                     model_cfg.ffn, args.num_layers)
    copy_weights(stage.model, plain, args.vocab_size)
    decay = [p for p in plain.parameters() if p.ndim >= 2]
    rest = [p for p in plain.parameters() if p.ndim < 2]
    plain_opt = torch.optim.AdamW([{"params": decay, "weight_decay": train_cfg.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-4, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=train_cfg.adam_eps)

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=gen)
    b = args.micro_batch_size
    mbs = [(data[i : i + b, :-1], data[i : i + b, 1:]) for i in range(0, args.global_batch_size, b)]

    ptdp_loss = train_step(stage, mbs, 0).loss
    plain_loss = plain_step(plain, plain_opt, mbs, train_cfg.clip_grad)
    if abs(ptdp_loss - plain_loss) > 1e-4 * abs(plain_loss):
        raise SystemExit(f"models differ: ptdp loss {ptdp_loss} vs plain {plain_loss}")

    times = {"ptdp": [], "plain": []}
    for i in range(args.warmup + args.steps):
        for name in ("ptdp", "plain"):
            start = time.perf_counter()
            if name == "ptdp":
                train_step(stage, mbs, i + 1)
            else:
                plain_step(plain, plain_opt, mbs, train_cfg.clip_grad)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "model": {"layers": args.num_layers, "hidden": args.hidden_size, "heads": args.num_attention_heads,
                  "seq": args.seq_length, "vocab": args.vocab_size},
        "batch": {"micro": b, "global": args.global_batch_size, "microbatches": len(mbs)},
        "threads": args.threads, "steps": args.steps,
        "median_step_s": med, "ratio_ptdp_over_plain": med["ptdp"] / med["plain"],
        "first_step_loss": {"ptdp": ptdp_loss, "plain": plain_loss},
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
