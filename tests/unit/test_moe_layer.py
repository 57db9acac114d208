"""The MoE layer's parts against plain per-token references in float64: router scores and top-k
(softmax, pre-softmax, sigmoid, scaling, expert bias, group-limited, forced balance), the capacity
decision, the balancing losses and their shares, the experts (grouped GEMM against the loop), and
the layer's output and gradients against ``(loss + aux + z).backward()`` of a plain model."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.moe.capacity import expert_capacity, keep_mask
from ptdp.engine.moe.experts import ExpertParam, expert_linear, grouped_supported, init_expert_shard
from ptdp.engine.moe.layer import MoELayer
from ptdp.engine.moe.losses import expert_counts, switch_aux_share, z_loss_share
from ptdp.engine.moe.router import balanced_assignment, route
from ptdp.engine.tensor_parallel.sharding import GlobalParam

D = torch.float64


def _logits(t: int, e: int, seed: int = 0) -> torch.Tensor:
    """Logits whose sorted values per token differ by at least 0.05 (no near-ties in the top-k)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).to(D) * 0.1
    return base + 0.01 * torch.rand(t, e, generator=g, dtype=D)


def _topk_ref(choice: list[float], k: int) -> list[int]:
    return sorted(range(len(choice)), key=lambda i: -choice[i])[:k]


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_softmax_routing_matches_a_per_token_reference(pre_softmax):
    logits = _logits(7, 6)
    r = route(logits, topk=2, pre_softmax=pre_softmax, scaling_factor=1.5)
    for t in range(7):
        row = logits[t].tolist()
        top = _topk_ref(row, 2)
        assert r.experts[t].tolist() == top
        if pre_softmax:
            full = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
            want = [1.5 * full[i] for i in top]
        else:
            want = [1.5 * math.exp(row[i]) / sum(math.exp(row[j]) for j in top) for i in top]
        torch.testing.assert_close(r.weights[t], torch.tensor(want, dtype=D), rtol=1e-12, atol=0)
    torch.testing.assert_close(r.scores, torch.softmax(logits, -1))


def test_sigmoid_routing_normalises_the_chosen_scores_and_the_bias_only_chooses():
    logits = _logits(6, 8, seed=1)
    bias = torch.zeros(8, dtype=D)
    bias[0] = 10.0  # expert 0 always chosen, its weight still its own sigmoid score
    r = route(logits, topk=3, score_function="sigmoid", expert_bias=bias)
    sig = torch.sigmoid(logits)
    for t in range(6):
        choice = (sig[t] + bias).tolist()
        top = _topk_ref(choice, 3)
        assert r.experts[t].tolist() == top and top[0] == 0
        chosen = sig[t, top]
        torch.testing.assert_close(r.weights[t], chosen / chosen.sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(r.scores, sig / sig.sum(-1, keepdim=True))


def test_group_limited_routing_picks_from_the_best_groups():
    logits = _logits(9, 8, seed=2)
    r = route(logits, topk=4, num_groups=4, group_topk=2)
    for t in range(9):
        row = logits[t].tolist()
        groups = [row[2 * g : 2 * g + 2] for g in range(4)]
        group_score = [sum(sorted(v, reverse=True)[:2]) for v in groups]
        allowed = {2 * g + i for g in _topk_ref(group_score, 2) for i in range(2)}
        top = _topk_ref([v if i in allowed else -math.inf for i, v in enumerate(row)], 4)
        assert r.experts[t].tolist() == top


def test_forced_balance_routes_round_robin_with_the_routers_weights():
    forced = balanced_assignment(torch.arange(5), 2, 4)
    assert forced.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    logits = _logits(5, 4, seed=3)
    r = route(logits, topk=2, forced=forced)
    assert torch.equal(r.experts, forced)
    torch.testing.assert_close(r.weights, torch.softmax(logits.gather(1, forced), -1))


def _keep_ref(experts, weights, ids, capacity, policy):
    n, k = experts.shape
    keep = torch.zeros(n, k, dtype=torch.bool)
    for e in set(experts.reshape(-1).tolist()):
        slots = [(t, j) for t in range(n) for j in range(k) if experts[t, j] == e]
        key = (
            (lambda tj: (-weights[tj].item(), ids[tj[0]].item(), tj[1]))
            if policy == "probs"
            else (lambda tj: (ids[tj[0]].item(), tj[1]))
        )
        for tj in sorted(slots, key=key)[:capacity]:
            keep[tj] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_what_a_per_expert_sort_keeps(policy):
    g = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=g, dtype=D).round(decimals=1)  # ties on purpose
    ids = torch.randperm(12, generator=g)
    cap = expert_capacity(12, 2, 4, 0.75)
    assert cap == 5
    keep = keep_mask(experts, weights, ids, 4, cap, policy)
    assert torch.equal(keep, _keep_ref(experts, weights, ids, cap, policy))
    assert all(int(((experts == e) & keep).sum()) <= cap for e in range(4))
    with pytest.raises(ValueError, match="policy"):
        keep_mask(experts, weights, ids, 4, cap, "random")


def test_switch_loss_matches_its_formula_and_shares_add_up():
    scores = torch.softmax(_logits(10, 4, seed=5), -1)
    experts = scores.topk(2, -1).indices
    unit = torch.zeros(10, dtype=torch.long)
    counts = expert_counts(experts, unit, 1, 4)
    whole = switch_aux_share(scores, unit, counts, 10, 2, 0.1)
    f = counts[0].to(D) / (10 * 2)
    p = scores.mean(0)
    torch.testing.assert_close(whole, 0.1 * 4 * (f * p).sum(), rtol=1e-12, atol=0)
    halves = [switch_aux_share(scores[i : i + 5], unit[:5], counts, 10, 2, 0.1) for i in (0, 5)]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-12, atol=0)
    seq = torch.arange(10) // 5  # two sequences of 5
    per = expert_counts(experts, seq, 2, 4)
    mean_of_seqs = (
        sum(
            switch_aux_share(scores[seq == u], torch.zeros(5, dtype=torch.long), per[u : u + 1], 5, 2, 0.1)
            for u in range(2)
        )
        / 2
    )
    torch.testing.assert_close(switch_aux_share(scores, seq, per, 5, 2, 0.1), mean_of_seqs, rtol=1e-12, atol=0)
    logits = _logits(10, 4, seed=6)
    torch.testing.assert_close(
        z_loss_share(logits, 10, 0.01), 0.01 * torch.logsumexp(logits, -1).square().mean(), rtol=1e-12, atol=0
    )


def test_grouped_gemm_matches_the_loop_including_empty_experts():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, 16, generator=g)
    w = torch.randn(4, 8, 16, generator=g)
    counts = torch.tensor([3, 0, 8, 0])
    loop = expert_linear(x, w, counts, None, grouped=False)
    assert grouped_supported(x, w)
    torch.testing.assert_close(expert_linear(x, w, counts, None, grouped=True), loop, rtol=1e-5, atol=1e-5)
    assert not grouped_supported(x.to(D), w.to(D))  # float64 runs the loop
    ref = torch.cat([x[:3] @ w[0].t(), x[3:11] @ w[2].t()])
    torch.testing.assert_close(loop, ref)
    empty = expert_linear(x[:0], w, torch.zeros(4, dtype=torch.long), None, grouped=True)
    assert empty.shape == (0, 8)


def test_expert_initialisation_is_the_same_on_every_split():
    spec = ExpertParam(GlobalParam((8, 4), tp_dim=0, tp_groups=2), 4)
    whole = init_expert_shard(spec, name="w", seed=1, std=0.02, num_layers=2, ep_rank=0, ep=1, etp_rank=0, etp=1)
    parts = [
        init_expert_shard(spec, name="w", seed=1, std=0.02, num_layers=2, ep_rank=r, ep=2, etp_rank=q, etp=2)
        for r in range(2)
        for q in range(2)
    ]
    assert whole.shape == (4, 8, 4) and parts[0].shape == (2, 4, 4)
    gate, up = whole[2:].chunk(2, dim=1)  # ep rank 1's experts, etp rank 1's halves of gate and up
    torch.testing.assert_close(parts[3], torch.cat([gate[:, 2:], up[:, 2:]], dim=1), rtol=0, atol=0)


def _layer(moe: MoEConfig, swiglu: bool = True, bias: bool = False) -> MoELayer:
    cfg = ModelConfig(
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=12,
        params_dtype="float64",
        swiglu=swiglu,
        add_bias_linear=bias,
    )
    layer = MoELayer(cfg, moe, D)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D) * 0.3)
    return layer


def _reference(layer: MoELayer, x: torch.Tensor, keep=None):
    """Per token: sum over its k slots of weight x expert(x_t), plus the plain losses."""
    moe, k = layer.moe, layer.moe.moe_router_topk
    s, b, h = x.shape
    tokens = x.reshape(-1, h)
    logits = tokens @ layer.router.t()
    r = route(logits, topk=k, score_function=moe.moe_router_score_function, pre_softmax=moe.moe_router_pre_softmax)
    ex = layer.experts
    rows = []
    for t in range(s * b):
        out = torch.zeros(h, dtype=D)
        for j in range(k):
            if keep is not None and not keep[t, j]:
                continue
            e = int(r.experts[t, j])
            y = ex.fc1_weight[e] @ tokens[t] + (ex.fc1_bias[e] if ex.fc1_bias is not None else 0)
            gate, up = y.chunk(2) if ex.swiglu else (y, None)
            act = F.silu(gate) * up if ex.swiglu else F.gelu(gate)
            out = out + r.weights[t, j] * (ex.fc2_weight[e] @ act + (ex.fc2_bias[e] if ex.fc2_bias is not None else 0))
        rows.append(out)
    n, e = s * b, layer.num_experts
    counts = torch.bincount(r.experts.reshape(-1), minlength=e).to(D)
    aux = moe.moe_aux_loss_coeff * e / (k * n * n) * (counts * r.scores.sum(0)).sum()
    z = (moe.moe_z_loss_coeff or 0.0) * torch.logsumexp(logits, -1).square().mean()
    return torch.stack(rows).view(s, b, h), aux + z


@pytest.mark.parametrize(
    ("moe", "swiglu", "bias"),
    [
        (MoEConfig(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), True, False),
        (MoEConfig(num_experts=3, moe_router_topk=1, moe_aux_loss_coeff=0.05), False, True),
        (MoEConfig(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True, moe_z_loss_coeff=0.01), True, True),
    ],
)
def test_layer_output_and_gradients_match_a_plain_model(moe, swiglu, bias):
    layer = _layer(moe, swiglu, bias)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 2, 8, generator=g, dtype=D, requires_grad=True)
    upstream = torch.randn(5, 2, 8, generator=g, dtype=D)
    y = layer(x)
    (y * upstream).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    ref, losses = _reference(layer, x2)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    ((ref * upstream).sum() + losses).backward()
    for got, want in zip(grads, [p.grad for p in layer.parameters()] + [x2.grad]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.stats.aux + layer.stats.z, losses.detach(), rtol=1e-12, atol=1e-15)


def test_capacity_drops_contribute_nothing_and_a_large_capacity_drops_none():
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_expert_capacity_factor=0.5)
    layer = _layer(moe)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(10), dtype=D)
    y = layer(x)
    tokens = x.reshape(-1, 8)
    r = route(tokens @ layer.router.t(), topk=2)
    ids = (torch.arange(2) * 6 + torch.arange(6).unsqueeze(1)).reshape(-1)
    keep = keep_mask(r.experts, r.weights, ids, 4, expert_capacity(12, 2, 4, 0.5), "probs")
    assert int((~keep).sum()) > 0 and layer.stats.dropped == (~keep).sum()
    torch.testing.assert_close(y, _reference(layer, x, keep)[0], rtol=1e-12, atol=1e-12)
    wide = _layer(MoEConfig(num_experts=4, moe_router_topk=2, moe_expert_capacity_factor=4.0))
    dropless = _layer(MoEConfig(num_experts=4, moe_router_topk=2))
    torch.testing.assert_close(wide(x), dropless(x), rtol=0, atol=0)
    assert wide.stats.dropped == 0


def test_the_layer_runs_its_experts_as_one_grouped_gemm_in_float32():
    cfg = ModelConfig(hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, params_dtype="float32", swiglu=True)
    loop = MoELayer(cfg, MoEConfig(num_experts=4, moe_router_topk=2), torch.float32)
    grouped = MoELayer(cfg, MoEConfig(num_experts=4, moe_router_topk=2, moe_grouped_gemm=True), torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p, q in zip(loop.parameters(), grouped.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            q.copy_(p)
    x = torch.randn(8, 2, 16, generator=g)
    torch.testing.assert_close(grouped(x), loop(x), rtol=1e-5, atol=1e-5)
    assert list(itertools.chain(*[[n] for n, _ in grouped.named_parameters()])) == [
        n for n, _ in loop.named_parameters()
    ]
