"""Text generation from a checkpoint (saved at any layout), in one process.

The checkpoint is loaded at tp = pp = dp = 1 (:func:`ptdp.run.checkpoint.io.load_checkpoint`
reassembles any layout's shards) and the whole sequence is recomputed for every new token (no
key/value cache): simple and exact, meant for inspecting what a small model learned.
"""

from __future__ import annotations

import argparse
import sys

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ptdp.run.checkpoint.folders import CheckpointError, read_meta, resolve_checkpoint
from ptdp.run.checkpoint.io import load_checkpoint
from ptdp.spec import ConfigError, Config, ModelConfig, ParallelConfig, TrainConfig, resolve
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.step import build_stage


def load_for_inference(path: str | Path, dtype: str = "float32") -> tuple[GPTModel, dict, Path]:
    """The single-process model of the checkpoint at ``path``, its metadata and its folder."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in meta["model"].items() if k in fields} | {"params_dtype": dtype})
    config = resolve(Config(model=model_cfg, parallel=ParallelConfig(1, 1, 1),
                            train=TrainConfig(micro_batch_size=1, global_batch_size=1)), 1)
    stage = build_stage(config, ParallelGroups.single_process())
    load_checkpoint(stage, folder, load_optimizer=False, load_rng=False)
    stage.model.eval()
    return stage.model, meta, folder


@torch.no_grad()
def next_token_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` token ids -> ``[b, V]`` logits of the next token (float32; real vocabulary)."""
    x = model.embed(tokens)  # [s, b, h]
    for layer in model.layers.values():
        x = layer(x)
    out = model.output_layer if hasattr(model, "output_layer") else model.word_embeddings
    return F.linear(model.final_norm(x[-1]), out.real_weight()).float()


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` tokens: greedy when ``temperature`` is 0, else
    sampled from softmax(logits / temperature) restricted to the ``top_k`` most likely.

    Raises:
        ValueError: an empty prompt, a negative temperature, or top_k < 1.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if not math.isfinite(temperature) or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature={temperature} must be >= 0 and top_k={top_k} >= 1")
    window = model.cfg.seq_length  # a sliding window of the trained positions (context_note says so)
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, torch.tensor([tokens[-window:]]))[0]
        if temperature == 0:
            tokens.append(int(logits.argmax()))
            continue
        logits = (logits / temperature).clamp(min=-1e30, max=1e30)  # a tiny temperature must not give inf/nan
        if top_k is not None and top_k < logits.numel():
            cutoff = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
    return tokens


def context_note(prompt_tokens: int, max_new_tokens: int, window: int) -> str | None:
    """How the context is cut when the prompt and the new tokens exceed the model's ``window``
    (its sequence length: the positions it was trained on), or None when everything fits."""
    total = prompt_tokens + max_new_tokens
    if total <= window:
        return None
    text = (f"note: the model reads at most its last {window} tokens (the checkpoint's --seq-length); the prompt "
            f"({prompt_tokens} tokens) and {max_new_tokens} new tokens make {total}, so each token after "
            f"position {window} is predicted from a sliding window of the {window} tokens before it")
    if prompt_tokens > window:
        text += f", and the prompt's first {prompt_tokens - window} tokens are never seen"
    return text


def load_tokenizer(folder: Path, override: str | None):
    """The checkpoint's ``tokenizer.json`` (saved by ``ptdp train``) or ``override``."""
    from tokenizers import Tokenizer

    path = Path(override) if override else folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"no tokenizer at {path}; pass --tokenizer PATH (a tokenizers JSON file)")
    return Tokenizer.from_file(str(path))


def add_arguments(gen: argparse.ArgumentParser) -> None:
    from ptdp.commands.train_flags import HelpFormatter

    gen.formatter_class = HelpFormatter
    gen.add_argument("--load", required=True, metavar="DIR", help="checkpoint root or iteration folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    gen.add_argument("--top-k", type=int, default=None,
                     help="with --temperature > 0: sample among the K most likely tokens")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: the checkpoint's)")


def run(args: argparse.Namespace) -> int:
    """``ptdp generate``: print the prompt and its continuation; 0."""
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k={args.top_k} must be >= 1")
    if not args.prompt:
        raise ConfigError("--prompt must not be empty")
    model, meta, folder = load_for_inference(args.load)
    tokenizer = load_tokenizer(folder, args.tokenizer)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens")
    note = context_note(len(prompt), args.max_new_tokens, model.cfg.seq_length)
    if note:
        print(note, file=sys.stderr, flush=True)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed)
    print(tokenizer.decode(out), flush=True)
    return 0
