"""What the mixture-of-experts benchmarks share (``bench_moe.py`` on the CPU, the GPU check's
``moe`` stage in ``gpu_moe.py``): MoE options with a dense GPT's active parameters per token, and
the routed experts' grouped GEMM timed against the per-expert loop.

Same active parameters per token: a dense MLP of width ``F_d`` applies ``2 h F_d`` weights to a
token; an MoE layer of ``E`` experts of width ``F = F_d / k``, each token routed to ``k`` of them,
applies ``k 2 h F = 2 h F_d`` of its ``E 2 h F`` expert weights (``E / k`` times the dense MLP's),
plus the router's ``E h``.

The experts timed: :class:`ptdp.engine.moe.experts.Experts` (GELU, no biases), forward and
backward on ``T k`` rows sorted by expert, ``T k / E`` rows each (a balanced routing), as the MoE
layer calls it at ep = 1: ``grouped=True`` (one ``torch._grouped_mm`` per linear layer where
:func:`~ptdp.engine.moe.expert_linear.grouped_supported`, else the loop) against ``grouped=False`` (one
GEMM per expert, the split sizes read on the host), alternating. FLOPs: two GEMMs of ``2 T k h F``
forward, twice that backward, ``12 T k h F`` in all.
"""

from __future__ import annotations

import torch
from gpu_report import Budget, alternating_medians

from ptdp.config.moe import MoEConfig
from ptdp.engine.moe.expert_linear import grouped_supported
from ptdp.engine.moe.experts import Experts


def moe_options(
    dense_ffn: int, *, num_experts: int, topk: int, grouped: bool = True, forced: bool = False
) -> MoEConfig:
    """Every layer an MoE layer of ``num_experts`` experts of width ``dense_ffn / topk``, top-``topk``
    routing, the experts as one grouped GEMM (``grouped``); ``forced``: the balanced benchmark
    routing of ``--moe-router-force-load-balancing``."""
    if dense_ffn % topk:
        raise ValueError(
            f"dense ffn {dense_ffn} is not divisible by top-k {topk}: no expert width keeps its active weights"
        )
    return MoEConfig(
        num_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=dense_ffn // topk,
        moe_grouped_gemm=grouped,
        moe_router_force_load_balancing=forced,
    )


def active_weights(hidden: int, dense_ffn: int, moe: MoEConfig) -> dict:
    """The MLP weights a token passes through in one layer, dense and MoE, the MoE layer's expert
    weights in all, and the arithmetic as text (module docstring)."""
    assert moe.num_experts is not None
    e, k, f = moe.num_experts, moe.moe_router_topk, moe.expert_ffn(dense_ffn)
    out = {
        "dense_mlp": 2 * hidden * dense_ffn,
        "moe_active": k * 2 * hidden * f,
        "router": e * hidden,
        "moe_experts": e * 2 * hidden * f,
    }
    out["text"] = (
        f"active MLP weights per token and layer: dense 2 h F_d = 2 x {hidden} x {dense_ffn} = {out['dense_mlp']:,}; "
        f"MoE k 2 h F = {k} x 2 x {hidden} x {f} = {out['moe_active']:,} (F = F_d / k), plus the router's "
        f"E h = {out['router']:,}; the MoE layer holds E 2 h F = {out['moe_experts']:,} expert weights "
        f"(E / k = {e / k:g} x the dense MLP)"
    )
    return out


def time_expert_gemms(
    *,
    num_experts: int,
    hidden: int,
    ffn: int,
    tokens: int,
    topk: int,
    dtype: torch.dtype,
    device: torch.device,
    reps: int,
    budget: Budget,
) -> dict:
    """One row: the experts' forward + backward with the grouped GEMM and with the loop (module
    docstring): medians, grouped / loop, TFLOP/s, whether the grouped GEMM took the operands, and
    the largest difference of the two outputs relative to the loop's largest value."""
    rows = tokens * topk
    if rows % num_experts:
        raise ValueError(f"T k = {tokens} x {topk} rows do not split evenly over {num_experts} experts")
    experts = Experts(
        num_experts=num_experts,
        hidden=hidden,
        ffn=ffn,
        swiglu=False,
        bias=False,
        approximate="none",
        dtype=dtype,
    ).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype).requires_grad_()
    grad = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    counts = torch.full((num_experts,), rows // num_experts, dtype=torch.int64, device=device)

    def forward(grouped: bool) -> torch.Tensor:
        experts.grouped = grouped
        return experts(x, counts)

    def step(grouped: bool) -> None:
        experts.zero_grad(set_to_none=True)
        x.grad = None
        forward(grouped).backward(grad)

    with torch.no_grad():
        loop_out = forward(False).float()
        diff = (forward(True).float() - loop_out).abs().max() / loop_out.abs().max()
    (grouped_s, loop_s), timed = alternating_medians([lambda: step(True), lambda: step(False)], device, reps, budget)
    flops = 12 * rows * hidden * ffn
    return {
        "num_experts": num_experts,
        "hidden": hidden,
        "ffn": ffn,
        "tokens": tokens,
        "topk": topk,
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "grouped_gemm_used": grouped_supported(x, experts.fc1_weight),
        "grouped_s": grouped_s,
        "loop_s": loop_s,
        "grouped_over_loop": grouped_s / loop_s if grouped_s and loop_s else None,
        "grouped_tflops": flops / grouped_s / 1e12 if grouped_s else None,
        "loop_tflops": flops / loop_s / 1e12 if loop_s else None,
        "timed": timed,
        "max_rel_diff_grouped_vs_loop": float(diff),
    }
