"""Generation speed: ``ptdp generate``'s key/value cache against recomputing the whole sequence
for every new token (``--no-kv-cache``), side by side in one process (tp = 1), greedy.

A randomly initialised model of the given shape (std 0.2, so the tokens vary) continues a random
prompt by ``--new-tokens`` tokens; prompt + new tokens must fit in ``--seq-length`` (past it both
paths read the whole sliding window every step). The two paths alternate ``--reps`` times; each
line gives the median tokens/s (new tokens over the wall time of one ``generate`` call, prefill
included) and checks that both produced the same tokens.

    python benchmarks/bench_generate.py [--num-layers 4] [--hidden-size 128] [--num-attention-heads 4]
        [--num-query-groups G] [--rope] [--seq-length 256] [--vocab-size 4096] [--prompt-tokens 16]
        [--new-tokens 128] [--dtype float32] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ptdp.commands.generate import generate
from ptdp.config.model import ModelConfig
from ptdp.engine.comm import AxisGroup
from ptdp.engine.model.gpt import GPTModel
from ptdp.engine.tensor_parallel.sharding import initialize_parameters


def build(args: argparse.Namespace) -> GPTModel:
    """The model of the command line, initialised with seed 0."""
    llama = (
        {
            "normalization": "RMSNorm",
            "swiglu": True,
            "position_embedding_type": "rope",
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": True,
        }
        if args.rope
        else {}
    )
    cfg = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=4 * args.hidden_size,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        params_dtype=args.dtype,
        **llama,
    )
    model = GPTModel(cfg, AxisGroup.single("tp"), layer_ids=range(args.num_layers), pre_process=True, post_process=True)
    initialize_parameters(model, seed=0, std=0.2, num_layers=args.num_layers, tp_rank=0, tp_size=1)
    return model.eval()


def timed(model: GPTModel, prompt: list[int], new: int, kv_cache: bool) -> tuple[float, list[int]]:
    """Seconds of one greedy ``generate`` call and its tokens."""
    start = time.perf_counter()
    tokens = generate(model, prompt, new, kv_cache=kv_cache)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, default=None)
    parser.add_argument("--rope", action="store_true", help="the Llama-like model (RMSNorm, SwiGLU, rotary)")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.prompt_tokens + args.new_tokens > args.seq_length:
        parser.error(
            f"--prompt-tokens={args.prompt_tokens} + --new-tokens={args.new_tokens} must be <= "
            f"--seq-length={args.seq_length}"
        )
    torch.set_num_threads(args.threads)
    model = build(args)
    prompt = torch.randint(0, args.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    timed(model, prompt, 4, True), timed(model, prompt, 4, False)  # warm-up
    seconds: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[int]] = {}
    for _ in range(args.reps):
        for kv_cache in (True, False):
            t, outputs[kv_cache] = timed(model, prompt, args.new_tokens, kv_cache)
            seconds[kv_cache].append(t)
    if outputs[True] != outputs[False]:
        raise SystemExit("the cached and the recomputed generation differ")
    cached, plain = (args.new_tokens / statistics.median(seconds[k]) for k in (True, False))
    print(
        f"load average {os.getloadavg()[0]:.1f}; {args.num_layers} layers, h={args.hidden_size}, "
        f"{args.num_attention_heads} heads, V={args.vocab_size}, {args.dtype}, prompt {args.prompt_tokens}, "
        f"{args.new_tokens} new tokens, {args.threads} thread(s), median of {args.reps}"
    )
    print(
        f"kv cache: {cached:.1f} tokens/s   recompute: {plain:.1f} tokens/s   speed-up {cached / plain:.2f}x "
        f"(same tokens)"
    )


if __name__ == "__main__":
    main()
