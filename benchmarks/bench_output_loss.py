"""The output layer + cross entropy: ptdp's chunked loss on the padded vocabulary against the plain
``F.linear`` (real rows) + float32 ``F.cross_entropy``, one process (tp = 1).

For each: median seconds of forward + backward, the bytes autograd keeps for backward (what a
pipeline stage holds per microbatch in flight, :mod:`ptdp.engine.activation_meter`) and the
largest tensor any operator makes (the peak temporary). The chunked loss runs one GEMM more (the
logits are recomputed in backward) and never holds the logits of the whole microbatch.

    python benchmarks/bench_output_loss.py [--tokens 1024] [--hidden 256] [--vocab 50257]
                                           [--chunk 256] [--dtype float32] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ptdp.engine.activation_meter import SavedActivationMeter
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from ptdp.layout.vocab import padded_vocab_size


class LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor an operator produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    v_pad = padded_vocab_size(args.vocab, 128, 1)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, args.tokens, args.hidden, generator=g).to(dtype)
    weight = torch.zeros(v_pad, args.hidden, dtype=dtype)
    weight[: args.vocab] = (0.02 * torch.randn(args.vocab, args.hidden, generator=g)).to(dtype)
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    tp = ParallelGroups.single_process().tp

    def plain(x):
        logits = F.linear(x, weight[: args.vocab]).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def chunked(x):
        losses = linear_cross_entropy(
            x, weight, labels, vocab_start=0, vocab_size=args.vocab, axis=tp, chunk_tokens=args.chunk
        )
        return losses.mean()

    print(
        f"tokens {args.tokens}, h {args.hidden}, V {args.vocab} (padded {v_pad}), {args.dtype}, "
        f"chunk {args.chunk} tokens, 1 thread"
    )
    print(f"{'':10} {'s fwd+bwd':>10} {'kept for backward':>18} {'largest tensor':>15}")
    for name, fn in (("plain", plain), ("chunked", chunked)):
        times = []
        for _ in range(args.reps):
            x = x0.clone().requires_grad_()
            weight.grad = None
            start = time.perf_counter()
            fn(x).backward()
            times.append(time.perf_counter() - start)
        x = x0.clone().requires_grad_()
        meter, largest = SavedActivationMeter({weight.untyped_storage().data_ptr()}), LargestTensor()
        with meter.hooks(), largest:
            fn(x).backward()
        print(
            f"{name:10} {statistics.median(times):10.3f} {meter.peak / 2**20:14.1f} MiB "
            f"{largest.largest / 2**20:11.1f} MiB"
        )


if __name__ == "__main__":
    main()
