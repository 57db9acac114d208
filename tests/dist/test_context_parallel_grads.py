"""Gradients over dp x cp (gloo, world 4): every cp rank backpropagates its share of each
microbatch's loss (its tokens' losses over the whole microbatch's token count), the gradient
buffer sums them over cp and averages over dp on the ``dp_cp`` group; the global norm counts each
parameter once, clipping and AdamW (plain or ZeRO-1 sharded over dp x cp) then give the parameters
of one float64 process over the whole batch, at 1e-9, for cp 2 x dp 2 and cp 4, prescaled (1/dp
in the loss) or averaging (float16's path), overlapped or not; the traffic is counted on the dp
axis (nothing on cp). Every gradient codec (exact, fp16, bf16, 1-bit) sums over the 4 dp x cp ranks
and divides by dp only. All layouts run in one job of the world-4 pool."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from helpers.dist_helpers import PG_TIMEOUT, run_in_pool
from ptdp.config.schema import TrainConfig
from ptdp.engine.data_parallel.buffer import GradBuffer
from ptdp.engine.data_parallel.compression import ONE_BIT_BLOCK, start_reduction
from ptdp.engine.data_parallel.grads import clip_grads, finalize_grads, global_grad_norm
from ptdp.engine.groups import ParallelGroups
from ptdp.engine.optim.adamw import step_unless
from ptdp.engine.optim.factory import build_optimizer
from ptdp.engine.tensor_parallel.sharding import GlobalParam
from ptdp.layout.grid import ParallelLayout

WORLD, M, TOKENS, STEPS, CLIP = 4, 2, 24, 2, 0.05
LAYOUTS = ((1, 2), (4, 1), (2, 2), (2, 2), (2, 2))  # (cp, dp), one per case of CASES; tp fills the world
CASES = (  # (prescaled, shard, overlap), one per layout of LAYOUTS
    (True, False, False),
    (True, True, True),
    (True, True, False),
    (False, False, True),
    (False, True, False),
)
TRAIN = TrainConfig(lr=0.05, min_lr=0.05, lr_warmup_iters=0, weight_decay=0.1, train_iters=STEPS)


class Toy(nn.Module):
    """``[T, 6]`` features -> ``[T]`` per-token losses; parameters replicated (no tp split)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(10, 6, generator=g, dtype=torch.float64) / 3)
        self.b1 = nn.Parameter(torch.randn(10, generator=g, dtype=torch.float64) / 3)
        self.w2 = nn.Parameter(torch.randn(3, 10, generator=g, dtype=torch.float64) / 3)
        for p in self.parameters():
            p.ptdp_global = GlobalParam(tuple(p.shape))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x @ self.w1.T + self.b1) @ self.w2.T
        return (out - y).pow(2).sum(-1)


def batch(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global microbatch ``microbatch`` (of ``dp * M``) of ``step``: ``TOKENS`` tokens."""
    g = torch.Generator().manual_seed(1000 * step + microbatch)
    return (
        torch.randn(TOKENS, 6, generator=g, dtype=torch.float64),
        torch.randn(TOKENS, 3, generator=g, dtype=torch.float64),
    )


def train(groups: ParallelGroups, cp: int, dp: int, m: int, prescaled: bool, shard: bool, overlap: bool) -> dict:
    """``STEPS`` steps of ``m`` microbatches; this rank's are ``dp_rank * m + i``, its tokens the
    ``cp_rank``-th of ``cp`` equal parts. Returns the parameters, norms and counted traffic."""
    model = Toy()
    buffer = GradBuffer(
        [list(model.parameters())],
        dp=groups.dp_cp,
        bucket_size=50,
        overlap=overlap,
        shard=shard,
        prescaled=prescaled,
        average_over=groups.dp.size,
    )
    optimizer = build_optimizer(model, TRAIN, buffer)
    cp_rank, dp_rank = groups.cp.rank, groups.dp.rank
    norms = []
    for step in range(STEPS):
        buffer.zero()
        groups.stats.reset()
        buffer.grad_scale = 1.0 / dp if prescaled else 1.0
        for i in range(m):
            x, y = batch(step, dp_rank * m + i)
            mine = torch.arange(TOKENS).view(cp, -1)[cp_rank]
            loss = model(x[mine], y[mine]).sum() / TOKENS / m * buffer.grad_scale  # share of the microbatch
            if i < m - 1:
                with buffer.no_sync():
                    loss.backward()
            else:
                loss.backward()
        finalize_grads(model, buffer, groups)
        norm = global_grad_norm(model, buffer, groups)
        clip_grads(buffer, norm, CLIP)
        skip = torch.zeros((), dtype=torch.bool)
        if shard:
            optimizer.step(skip)
        else:
            step_unless(optimizer, skip)
        norms.append(norm)
    if shard:
        optimizer.wait_for_params()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "norms": torch.stack(norms),
        "comm": groups.stats.as_dict(),
        "buffer_numel": buffer.data.numel(),
    }


CODECS = ("none", "fp16", "bf16", "1bit")


def codec_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s bucket for the codec check: 130 elements (3 blocks of the 1-bit scales)."""
    return torch.linspace(-1.0, 2.0, 130) * (rank + 1)


def grads_worker(rank: int, world: int) -> dict:
    out = {"layouts": []}
    for (cp, dp), case in zip(LAYOUTS, CASES):
        # tp ranks hold the same replicated toy parameters: the norm counts them on tp rank 0 only
        groups = ParallelGroups.build(ParallelLayout(tp=world // (cp * dp), pp=1, dp=dp, cp=cp), PG_TIMEOUT)
        out["layouts"].append(train(groups, cp, dp, M, *case))
    groups = ParallelGroups.build(ParallelLayout(tp=1, pp=1, dp=2, cp=2), PG_TIMEOUT)
    for codec in CODECS:
        grad = codec_input(rank)
        residual = torch.zeros_like(grad) if codec == "1bit" else None
        start_reduction(codec, grad, groups.dp_cp, residual=residual, divisor=groups.dp.size)()
        out[codec] = grad
    return out


@functools.cache
def results() -> list[dict]:
    return run_in_pool(grads_worker, WORLD)


@functools.cache
def reference(dp: int) -> dict:
    """One process over the whole batch: ``dp * M`` microbatches, each loss over ``dp * M``."""
    return train(ParallelGroups.single_process(), 1, 1, dp * M, prescaled=True, shard=False, overlap=False)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gradients_sum_over_cp_and_average_over_dp(case):
    (cp, dp), (_, shard, _) = LAYOUTS[case], CASES[case]
    want = reference(dp)
    for rank, res in enumerate(results()):
        got = res["layouts"][case]
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-9, atol=0)
        assert float(got["norms"][0]) > CLIP, "clipping must be active for the test to check it"
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-9, atol=1e-12, msg=f"rank {rank} {name}")
        grads = {k: v for k, v in got["comm"].items() if k.endswith("/grads")}
        assert set(grads) == {"dp/reduce_scatter/grads" if shard else "dp/all_reduce/grads"}, got["comm"]
        assert sum(v["numel"] for v in grads.values()) == got["buffer_numel"]
        assert not any(k.startswith("cp/") for k in got["comm"]), got["comm"]
        if shard:  # ZeRO-1 over all dp x cp ranks: the parameters come back in an all-gather of the same size
            assert got["comm"]["dp/all_gather/params"]["numel"] * cp * dp == got["buffer_numel"]


def one_bit_sent(grad: torch.Tensor) -> torch.Tensor:
    """What the 1-bit codec sends for ``grad``: its sign times its block's mean absolute value."""
    blocks = grad.split(ONE_BIT_BLOCK)
    return torch.cat([torch.where(b >= 0, 1.0, -1.0) * b.abs().mean() for b in blocks])


@pytest.mark.parametrize("codec", CODECS)
def test_codecs_sum_over_cp_and_average_over_dp(codec):
    """4 ranks (cp 2 x dp 2) each put in their bucket: every rank gets the sum over the 4 of what
    the codec sends, divided by dp = 2 (not 4)."""
    inputs = [codec_input(r) for r in range(WORLD)]
    if codec == "1bit":
        want, tol = sum(one_bit_sent(g) for g in inputs) / 2, dict(rtol=1e-6, atol=1e-6)
    else:
        want, tol = sum(inputs) / 2, dict(rtol=1e-6, atol=1e-6) if codec == "none" else dict(rtol=1e-2, atol=1e-2)
    for res in results():
        torch.testing.assert_close(res[codec], want, **tol)
