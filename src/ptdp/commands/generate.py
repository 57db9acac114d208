"""Text generation from a checkpoint (saved at any layout), in one process, at tp = pp = dp = 1.

By default the prompt is read once into a key/value cache and each new token runs one position
(:class:`CachedDecoder`); ``--no-kv-cache`` recomputes the whole sequence per token
(:class:`Recompute`); both give the same logits up to rounding. Past ``seq_length`` the context is
a sliding window of the last ``seq_length`` tokens (:func:`context_note`), which every position
shifts with, so the cached path then reads the whole window each step too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.resolve import resolve
from ptdp.config.schema import Config, TrainConfig
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.stage import build_stage
from ptdp.errors import ConfigError
from ptdp.run.checkpoint.folders import CheckpointError, read_meta, resolve_checkpoint, stored_moe
from ptdp.run.checkpoint.io import load_checkpoint


def load_for_inference(path: str | Path, dtype: str = "float32") -> tuple[GPTModel, dict, Path]:
    """The single-process model of the checkpoint at ``path``, its metadata and its folder. An MoE
    model runs dropless (no expert capacity, as Hugging Face runs MoE models), its experts all in
    this process (ep = 1)."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in meta["model"].items() if k in fields} | {"params_dtype": dtype})
    moe = dataclasses.replace(stored_moe(meta), moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)
    config = resolve(
        Config(
            model=model_cfg,
            moe=moe,
            parallel=ParallelConfig(1, 1, 1),
            train=TrainConfig(micro_batch_size=1, global_batch_size=1),
        ),
        1,
    )
    stage = build_stage(config, ParallelGroups.single_process())
    load_checkpoint(stage, folder, load_optimizer=False, load_rng=False)
    model = stage.model
    if not isinstance(model, GPTModel):  # one process, pp = 1: never the chunks of an interleaved rank
        raise TypeError(f"expected one GPTModel stage, got {type(model).__name__}")
    model.eval()
    return model, meta, folder


@torch.no_grad()
def next_token_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` token ids -> ``[b, V]`` logits of the next token (float32; real vocabulary)."""
    x = model.embed(tokens)  # [s, b, h]
    for layer in model.layers.values():
        x = layer(x)
    out = model.output_layer if hasattr(model, "output_layer") else model.word_embeddings
    return F.linear(model.final_norm(x[-1]), out.real_weight()).float()


def output_logits(model: GPTModel, x: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states ``[b, h]`` -> ``[b, V]`` logits (float32; real vocabulary)."""
    out = model.output_layer if hasattr(model, "output_layer") else model.word_embeddings
    return F.linear(x, out.real_weight()).float()


def _device(model: GPTModel) -> torch.device:
    """Where the model's token embedding lives (token ids are made there)."""
    return model.word_embeddings.weight.device


class Recompute:
    """Next-token logits ``[V]`` of a token list, recomputing its last ``seq_length`` tokens
    (:func:`next_token_logits`) at every call."""

    def __init__(self, model: GPTModel) -> None:
        self.model = model

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        context = torch.tensor([tokens[-self.model.cfg.seq_length :]], device=_device(self.model))
        return next_token_logits(self.model, context)[0]


class CachedDecoder:
    """Next-token logits ``[V]`` of a growing token list through a key/value cache of
    ``max_len <= seq_length`` positions (:meth:`GPTModel.decode`).

    A call whose list is the previous one plus one token, with room left in the cache, runs that
    token alone at the next position; any other call (the first, a list that does not extend the
    last by one, or a full cache) empties the cache and reads the last ``min(seq_length,
    max_len)`` tokens again (a prefill at positions from 0), which is what the uncached path reads.
    """

    def __init__(self, model: GPTModel, max_len: int) -> None:
        self.model = model
        self.cache = model.kv_cache(1, min(max_len, model.cfg.seq_length))
        self.read = 0  # length of the token list the cache last read

    @torch.no_grad()
    def __call__(self, tokens: list[int]) -> torch.Tensor:
        cache = self.cache
        if self.read and len(tokens) == self.read + 1 and cache.length < cache.max_len:
            x = self.model.decode(torch.tensor([tokens[-1:]], device=_device(self.model)), cache)
        else:
            cache.length = 0
            x = self.model.decode(torch.tensor([tokens[-cache.max_len :]], device=_device(self.model)), cache)
        self.read = len(tokens)
        return output_logits(self.model, x[-1])[0]


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    kv_cache: bool = True,
) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` tokens: greedy when ``temperature`` is 0, else sampled
    from softmax(logits / temperature) over the ``top_k`` most likely, with a CPU generator seeded
    ``seed``. ``kv_cache``: :class:`CachedDecoder` (``min(len(prompt) + max_new_tokens, seq_length)``
    positions), else :class:`Recompute`; same tokens. One host synchronisation per token.

    Raises:
        ValueError: an empty prompt, a negative temperature, or top_k < 1.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if not math.isfinite(temperature) or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature={temperature} must be >= 0 and top_k={top_k} >= 1")
    # both read a sliding window of the trained positions (context_note says so)
    next_logits = CachedDecoder(model, len(prompt) + max_new_tokens) if kv_cache else Recompute(model)
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = next_logits(tokens).cpu()  # the choice runs on the host, with the CPU generator
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
    text = (
        f"note: the model reads at most its last {window} tokens (the checkpoint's --seq-length); the prompt "
        f"({prompt_tokens} tokens) and {max_new_tokens} new tokens make {total}, so each token after "
        f"position {window} is predicted from a sliding window of the {window} tokens before it"
    )
    if prompt_tokens > window:
        text += f", and the prompt's first {prompt_tokens - window} tokens are never seen"
    return text


def load_tokenizer(folder: Path, override: str | None):
    """The checkpoint's ``tokenizer.json`` (saved by ``ptdp train``) or ``override``."""
    from tokenizers import Tokenizer

    path = Path(override) if override else folder / "tokenizer.json"
    if not path.is_file():
        if override:
            raise CheckpointError(f"--tokenizer {path}: not a file (a tokenizers JSON file)")
        raise CheckpointError(f"no tokenizer at {path}; pass --tokenizer PATH (a tokenizers JSON file)")
    return Tokenizer.from_file(str(path))


def check_tokenizer_size(tokenizer, vocab_size: int, path: str | None) -> None:
    """The tokenizer must have the model's vocabulary (its ids index the embedding); ConfigError
    naming both sizes otherwise, as ``ptdp train --load ... --tokenizer-model`` does."""
    size = tokenizer.get_vocab_size()
    if size != vocab_size:
        where = f"--tokenizer {path}" if path else "the checkpoint's tokenizer.json"
        raise ConfigError(
            f"{where} has {size} tokens but the model has a vocabulary of {vocab_size}: they must be equal"
        )


def add_arguments(gen: argparse.ArgumentParser) -> None:
    from ptdp.config.train_flags import HelpFormatter

    gen.formatter_class = HelpFormatter
    gen.add_argument("--load", required=True, metavar="DIR", help="checkpoint root or iteration folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    gen.add_argument(
        "--top-k", type=int, default=None, help="with --temperature > 0: sample among the K most likely tokens"
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: the checkpoint's)")
    gen.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="recompute the whole sequence for every new token instead of reading the prompt once "
        "into a key/value cache (same tokens; slower)",
    )


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
    model, _meta, folder = load_for_inference(args.load)
    tokenizer = load_tokenizer(folder, args.tokenizer)
    check_tokenizer_size(tokenizer, model.cfg.vocab_size, args.tokenizer)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens")
    note = context_note(len(prompt), args.max_new_tokens, model.cfg.seq_length)
    if note:
        print(note, file=sys.stderr, flush=True)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        kv_cache=args.kv_cache,
    )
    print(tokenizer.decode(out), flush=True)
    return 0
