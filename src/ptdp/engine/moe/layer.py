"""The MoE layer in place of a transformer layer's MLP: route, keep within capacity, run the
experts, combine the k outputs in slot order, add the shared expert; its balancing losses join
the backward through :class:`AttachLoss`.

Per-rank shapes: input ``[s', b, h]``, the tokens this rank holds (``s' = s / (cp t)`` with
sequence parallelism over ``t`` tp ranks and cp,
:func:`~ptdp.engine.context_parallel.load_balance.rank_positions`), ``T = s' b`` tokens in that
order; the router ``[E, h]`` replicated. The ranks sharing a micro-batch (tp with sequence
parallelism, cp) all-reduce the ``[E]`` counts (``[b, E]`` per sequence) and, with a capacity,
all-gather the routing (``T k`` experts and weights, ``T`` ids) so that each takes the same drop
decision over the whole micro-batch. At ep = etp = 1 the rank runs every expert on its own tokens;
otherwise :meth:`MoELayer._expert_parallel` exchanges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.engine.activity import is_recomputing
from ptdp.engine.comm import AxisGroup, all_gather_along, all_reduce, all_to_all
from ptdp.engine.context_parallel.load_balance import rank_positions
from ptdp.engine.groups import ExpertGroups
from ptdp.engine.moe.capacity import expert_capacity, keep_mask
from ptdp.engine.moe.dispatch import exchange
from ptdp.engine.moe.experts import Experts
from ptdp.engine.moe.losses import counts_of, expert_counts, switch_aux_share, z_loss_share
from ptdp.engine.moe.router import ROUTER_DTYPES, Routing, balanced_assignment, route, router_logits
from ptdp.engine.tensor_parallel.linear import FP8Settings, WgradQueue
from ptdp.engine.tensor_parallel.sharding import GlobalParam, make_parameter


def placed(rows: torch.Tensor, index: torch.Tensor, n: int, *, gather: bool = False) -> torch.Tensor:
    """``[n, w]``: row ``i`` of ``rows`` ``[N, w]`` at ``index[i]`` (distinct), zeros elsewhere; with
    ``gather``, row ``index[j]`` of ``rows`` at ``j``, zeros where ``index[j] == N``. One gather from
    ``rows`` and a zero row (what backward keeps is ``index``, not ``rows``, unlike ``index_copy``)."""
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    if gather:
        return padded[index]
    where = torch.full((n,), rows.shape[0], dtype=index.dtype, device=index.device)
    where[index] = torch.arange(index.shape[0], device=index.device)
    return padded[where]


class AttachLoss(torch.autograd.Function):
    """``x`` unchanged; in backward the 0-dim ``loss`` receives gradient ``scale``, so a loss computed
    inside a pipeline stage joins the backward that reaches ``x`` (Megatron-Core's
    ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale, None


@dataclass
class MoEStats:
    """What one forward of an MoE layer measured (device tensors, no host synchronisation).

    ``counts``: ``[E]`` assignments per expert of the micro-batch (before drops); ``dropped``:
    assignments dropped by the capacity; ``aux`` and ``z``: the losses (0 when off), this rank's
    shares."""

    counts: torch.Tensor
    dropped: torch.Tensor
    aux: torch.Tensor
    z: torch.Tensor


class MoELayer(nn.Module):
    """Routed experts (and ``shared``, a dense MLP every token also passes through) of one layer;
    ``forward(x)`` ``[s, b, h]`` -> ``[s, b, h]``. ``loss_scale``: the gradient its balancing losses
    receive (the engine sets it per step); ``stats``: the last forward's :class:`MoEStats`."""

    def __init__(
        self,
        cfg: ModelConfig,
        moe: MoEConfig,
        dtype: torch.dtype,
        *,
        shared: nn.Module | None = None,
        layer_id: int = 0,
        tp: AxisGroup | None = None,
        cp: AxisGroup | None = None,
        sequence_parallel: bool = False,
        experts: ExpertGroups | None = None,
        fp8: FP8Settings | None = None,
        wgrad_queue: WgradQueue | None = None,
    ) -> None:
        super().__init__()
        if moe.num_experts is None:
            raise ValueError("an MoE layer needs moe.num_experts")
        self.moe, self.layer_id = moe, layer_id
        self.seq_length = cfg.seq_length
        self.tp = tp if tp is not None and sequence_parallel else AxisGroup.single("tp")
        self.cp = cp if cp is not None else AxisGroup.single("cp")
        groups = experts if experts is not None else ExpertGroups.single()
        self.ep, self.etp, self.ep_etp = groups.ep, groups.etp, groups.ep_etp
        self.dispatcher = groups.dispatcher
        self.num_experts = moe.num_experts
        self.router_dtype = ROUTER_DTYPES[moe.router_dtype(str(cfg.params_dtype))]
        h = cfg.hidden_size
        self.router = make_parameter(GlobalParam((self.num_experts, h)), 1, dtype)
        self.expert_bias: torch.Tensor | None
        if moe.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=self.router_dtype))
        else:
            self.expert_bias = None
        self.global_counts: torch.Tensor | None
        if moe.moe_router_load_balancing_type == "global_aux_loss":
            # the previous step's assignments per expert over the global batch (0: none yet)
            self.register_buffer("global_counts", torch.zeros(self.num_experts, dtype=torch.float64))
        else:
            self.global_counts = None
        approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.experts = Experts(
            num_experts=self.num_experts,
            hidden=h,
            ffn=moe.expert_ffn(cfg.ffn),
            swiglu=cfg.swiglu,
            bias=cfg.add_bias_linear,
            approximate=approximate,
            dtype=dtype,
            grouped=moe.moe_grouped_gemm,
            ep=self.ep.size,
            ep_rank=self.ep.rank,
            etp=self.etp.size,
            etp_rank=self.etp.rank,
            fp8=fp8,
            etp_group=self.etp,
            wgrad_queue=wgrad_queue,
        )
        self.shared = shared  # the shared expert (a dense MLP of width moe.shared_ffn), built by the caller
        self.loss_scale: float | torch.Tensor = 1.0
        self.stats: MoEStats | None = None
        self.step_counts: torch.Tensor | None = None
        """``[E]`` assignments per expert over this step's micro-batches (summed over the ranks
        sharing each), counted once per micro-batch (not again by a recompute); reset by the step."""
        self.step_sums: torch.Tensor | None = None
        """``[3]`` float64 over this step's micro-batches, counted as :attr:`step_counts`: this rank's
        shares of the balancing and z losses, and the assignments dropped (of the whole micro-batch)."""

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        s_local, b, h = x.shape
        s = self.seq_length if self.tp.size * self.cp.size > 1 else s_local
        tokens = x.reshape(s_local * b, h)
        if token_ids is None:  # id = sample x s + position, over the whole micro-batch
            positions = rank_positions(
                s, self.cp.rank, self.cp.size, tp_rank=self.tp.rank, tp_size=self.tp.size, device=x.device
            )
            token_ids = (torch.arange(b, device=x.device) * s + positions.unsqueeze(1)).reshape(-1)
        moe, k = self.moe, self.moe.moe_router_topk
        logits = router_logits(tokens, self.router, self.router_dtype)
        forced = balanced_assignment(token_ids, k, self.num_experts) if moe.moe_router_force_load_balancing else None
        routing = route(
            logits,
            topk=k,
            score_function=moe.moe_router_score_function,
            pre_softmax=moe.moe_router_pre_softmax,
            scaling_factor=moe.moe_router_topk_scaling_factor,
            num_groups=moe.moe_router_num_groups,
            group_topk=moe.moe_router_group_topk,
            expert_bias=self.expert_bias,
            forced=forced,
        )
        n = s * b
        keep = capacity = None
        if moe.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(n, k, self.num_experts, moe.moe_expert_capacity_factor)
            keep = self._keep(routing, token_ids, capacity)
        weights = routing.weights.to(x.dtype)
        if keep is not None and capacity is not None and moe.moe_pad_expert_input_to_capacity:
            out = self._padded_experts(tokens, routing.experts, weights, keep, capacity)
        else:
            out = self._experts(tokens, routing.experts, weights, keep)
        out = out.view(s_local, b, h)
        if self.shared is not None:
            out = out + self.shared(x)
        loss = self._losses(routing, n, b, s, keep, token_ids)
        return AttachLoss.apply(out, loss, self.loss_scale) if loss.requires_grad else out

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every rank sharing the micro-batch along dim 0 (tp blocks inside cp blocks)."""
        return all_gather_along(all_gather_along(t, self.tp, dim=0, tag="moe_route"), self.cp, dim=0, tag="moe_route")

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks sharing the micro-batch (in place)."""
        return all_reduce(all_reduce(t, self.tp, tag="moe_counts"), self.cp, tag="moe_counts")

    def _keep(self, routing: Routing, token_ids: torch.Tensor, capacity: int) -> torch.Tensor:
        """This rank's rows of the capacity decision, taken over the whole micro-batch."""
        policy = self.moe.moe_token_drop_policy
        if self.tp.size * self.cp.size == 1:
            return keep_mask(routing.experts, routing.weights, token_ids, self.num_experts, capacity, policy)
        keep = keep_mask(
            self._gather(routing.experts),
            self._gather(routing.weights.detach()),
            self._gather(token_ids),
            self.num_experts,
            capacity,
            policy,
        )
        t = token_ids.shape[0]
        start = (self.cp.rank * self.tp.size + self.tp.rank) * t
        return keep[start : start + t]

    def _experts(
        self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Every kept assignment's expert output, weighted and summed per token in slot order. With
        drops, selecting the kept assignments reads their number to the host (``nonzero``)."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        kept = torch.arange(t * k, device=tokens.device) if keep is None else keep.reshape(-1).nonzero().squeeze(1)
        order = kept[torch.sort(flat[kept], stable=True).indices]
        counts = counts_of(flat[kept], self.num_experts)
        y = self._run(tokens[order // k], counts)
        full = placed(y, order, t * k)
        return (full.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _padded_experts(
        self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, capacity: int
    ) -> torch.Tensor:
        """:meth:`_experts` with every expert's input padded to ``capacity`` rows (zeros after the
        rank's kept assignments, in token order): all shapes and splits fixed, no host
        synchronisation. Dropped assignments go to a scratch row past the ``E C`` slots."""
        t, k = experts.shape
        e, c = self.num_experts, capacity
        key = torch.where(keep.reshape(-1), experts.reshape(-1), e)  # e: dropped
        order = torch.sort(key, stable=True).indices
        counts = counts_of(key, e + 1)
        sorted_key = key[order]
        place = torch.arange(t * k, device=tokens.device) - (torch.cumsum(counts, 0) - counts)[sorted_key]
        slot_sorted = torch.where(sorted_key < e, sorted_key * c + place, e * c)
        slot = torch.empty_like(slot_sorted).index_copy(0, order, slot_sorted)
        # each slot's assignment (t k where none; the scratch slot's unused), then its token
        filled = torch.full((e * c + 1,), t * k, dtype=slot.dtype, device=slot.device)
        filled[slot] = torch.arange(t * k, device=slot.device)
        rows = placed(tokens, (filled // k)[: e * c], t, gather=True)
        y = self._run(rows, torch.full((e,), c, dtype=torch.int64, device=tokens.device), capacity=c)
        full = torch.cat([y, y.new_zeros(1, y.shape[1])])[slot]
        return (full.view(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _run(self, rows: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """The experts' outputs for ``rows`` sorted by global expert, ``counts[e]`` of expert ``e``
        (each ``capacity`` when padded: splits known without reading ``counts``), on this rank or
        through the dispatcher."""
        if self.ep_etp.size == 1:
            splits = [capacity] * self.num_experts if capacity is not None else None
            return self.experts(rows, counts, splits)
        if self.dispatcher == "allgather":
            return self._all_gathered(rows, counts, capacity)
        return self._expert_parallel(rows, counts, capacity)

    def _expert_parallel(self, rows: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """The experts' outputs for ``rows`` (sorted by global expert, ``counts[e]`` for expert ``e``)
        computed on the ep x etp ranks holding them: counts, then rows, exchanged over ep; with
        etp > 1 the etp ranks gather what each received (all rows to every shard of an expert),
        each runs its ``E / ep`` expert shards on all of them (grouped by local expert, sources in
        order), and the partial outputs are summed back to the rank that received each row (a
        reduce-scatter); the outputs return by the reverse ep exchange. The etp gather and
        reduce-scatter are ``all_to_all`` with uneven splits (a rank's rows sent to each etp peer).
        One host synchronisation (the splits); none when padded to ``capacity`` rows per expert."""
        ep, etp, local = self.ep, self.etp, self.num_experts // self.ep.size
        if capacity is not None:  # every source sends `capacity` rows per expert
            by_source = torch.full((etp.size * ep.size, local), capacity, dtype=counts.dtype, device=counts.device)
            send = recv = [local * capacity] * ep.size
            each = [capacity] * (etp.size * ep.size * local)
        else:
            received = all_to_all(
                counts, ep, in_splits=[local] * ep.size, out_splits=[local] * ep.size, tag="moe_counts"
            )
            # [etp x ep, local]: rows per local expert that each source sent to each etp peer
            by_source = all_gather_along(received, etp, dim=0, tag="moe_counts").view(etp.size * ep.size, local)
            splits = torch.cat(
                [counts.view(ep.size, local).sum(1), received.view(ep.size, local).sum(1), by_source.view(-1)]
            )
            host = splits.tolist()
            send, recv, each = host[: ep.size], host[ep.size : 2 * ep.size], host[2 * ep.size :]
        per_peer = ep.size * local  # entries of `each` per etp peer
        peers = [sum(each[j * per_peer : (j + 1) * per_peer]) for j in range(etp.size)]
        per_expert = [sum(each[j * local + e] for j in range(etp.size * ep.size)) for e in range(local)]
        got = exchange(rows, ep, send, recv, tag="moe_dispatch")
        mine = sum(recv)
        if etp.size > 1:  # every etp peer's rows, in peer order
            got = exchange(got.repeat(etp.size, 1), etp, [mine] * etp.size, peers, tag="moe_etp_gather")
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(etp.size * ep.size),
            by_source.reshape(-1),
            output_size=sum(peers),
        )
        perm = torch.sort(expert_of_row, stable=True).indices
        out = self.experts(got[perm], by_source.sum(0), per_expert)
        back = placed(out, perm, out.shape[0])
        if etp.size > 1:  # each peer's rows back to it, the etp shards' partial outputs summed
            back = exchange(back, etp, peers, [mine] * etp.size, tag="moe_etp_scatter")
            back = back.view(etp.size, mine, rows.shape[1]).sum(0)
        return exchange(back, ep, recv, send, tag="moe_combine")

    def _all_gathered(self, rows: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """The allgather dispatcher: every rank of the ep x etp group gathers all of the group's
        ``rows`` (and ``[E]`` counts), runs its shards of its ``E / ep`` experts on the rows routed to
        them (grouped by local expert, sources in group order) and the group reduce-scatters the
        outputs (zero where a rank holds no shard of the row's expert) back to each row's rank. The
        gather and the reduce-scatter are ``all_to_all`` with uneven splits, tags
        ``moe_allgather`` and ``moe_reduce_scatter``. One host synchronisation (the counts); none
        when padded to ``capacity`` rows per expert."""
        group, local = self.ep_etp, self.num_experts // self.ep.size
        lo = self.ep.rank * local
        if capacity is not None:
            every = torch.full((group.size, self.num_experts), capacity, dtype=counts.dtype, device=counts.device)
            host = [[capacity] * self.num_experts for _ in range(group.size)]
        else:
            every = all_gather_along(counts, group, dim=0, tag="moe_counts").view(group.size, self.num_experts)
            host = every.tolist()
        sizes = [sum(row) for row in host]
        mine = sizes[group.rank]
        gathered = exchange(rows.repeat(group.size, 1), group, [mine] * group.size, sizes, tag="moe_allgather")
        # this rank's experts' rows: in each source's block (sorted by global expert) one run
        starts = [sum(sizes[:j]) + sum(host[j][:lo]) for j in range(group.size)]
        lengths = [sum(host[j][lo : lo + local]) for j in range(group.size)]
        total = sum(lengths)
        device = rows.device
        first = torch.tensor(starts, device=device) - torch.tensor(
            [sum(lengths[:j]) for j in range(group.size)], device=device
        )
        take = torch.repeat_interleave(first, torch.tensor(lengths, device=device), output_size=total)
        take = take + torch.arange(total, device=device)
        by_source = every[:, lo : lo + local]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=device).repeat(group.size), by_source.reshape(-1), output_size=total
        )
        perm = torch.sort(expert_of_row, stable=True).indices
        per_expert = [sum(host[j][lo + e] for j in range(group.size)) for e in range(local)]
        out = self.experts(gathered[take][perm], by_source.sum(0), per_expert)
        full = placed(out, take[perm], sum(sizes))
        back = exchange(full, group, sizes, [mine] * group.size, tag="moe_reduce_scatter")
        return back.view(group.size, mine, rows.shape[1]).sum(0)

    def _losses(
        self, routing: Routing, n: int, b: int, s: int, keep: torch.Tensor | None, token_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's share of the balancing losses (:mod:`ptdp.engine.moe.losses`); records :attr:`stats`."""
        moe, k, e = self.moe, self.moe.moe_router_topk, self.num_experts
        zero = routing.logits.new_zeros(())
        aux, z = zero, zero
        whole = torch.zeros_like(token_ids)
        counts = self._sum(expert_counts(routing.experts, whole, 1, e))
        coeff = moe.moe_aux_loss_coeff
        if coeff > 0 and moe.moe_router_load_balancing_type == "aux_loss":
            aux = switch_aux_share(routing.scores, whole, counts, n, k, coeff)
        elif coeff > 0 and moe.moe_router_load_balancing_type == "global_aux_loss" and self.global_counts is not None:
            aux = switch_aux_share(routing.scores, whole, self._global_counts(counts, n), n, k, coeff)
        elif coeff > 0 and moe.moe_router_load_balancing_type == "seq_aux_loss":
            sample = token_ids // s
            per_seq = self._sum(expert_counts(routing.experts, sample, b, e))
            aux = switch_aux_share(routing.scores, sample, per_seq, s, k, coeff)
        if moe.moe_z_loss_coeff:
            z = z_loss_share(routing.logits, n, moe.moe_z_loss_coeff)
        dropped = zero if keep is None else self._sum((~keep).sum().to(zero.dtype))
        self.stats = MoEStats(counts=counts[0], dropped=dropped, aux=aux.detach(), z=z.detach())
        if self.training and torch.is_grad_enabled() and not is_recomputing():
            self.step_counts = counts[0] if self.step_counts is None else self.step_counts + counts[0]
            sums = torch.stack([aux.detach(), z.detach(), dropped]).to(torch.float64)
            self.step_sums = sums if self.step_sums is None else self.step_sums + sums
        return aux + z

    def _global_counts(self, counts: torch.Tensor, n: int) -> torch.Tensor:
        """``global_aux_loss``'s counts for a unit of ``n`` tokens: the previous step's global-batch
        counts scaled to ``n`` tokens (``C n / N``, ``N = sum C / k``), or before any step the
        micro-batch's own ``counts`` ``[1, E]``; ``[1, E]`` float64, chosen on the device."""
        assert self.global_counts is not None
        history = self.global_counts
        total = history.sum()
        scaled = history * (n * self.moe.moe_router_topk / total.clamp(min=1.0))
        return torch.where(total > 0, scaled, counts[0].to(history.dtype)).unsqueeze(0)

    @torch.no_grad()
    def step_done(self, counts: torch.Tensor, skip: torch.Tensor) -> None:
        """After an optimizer step, with ``counts`` ``[E]`` its assignments per expert over the
        global batch; nothing where ``skip`` (a 0-dim bool on the device: the step was skipped).
        Aux-loss-free balancing (arXiv:2408.15664, §2.2) moves each expert's bias by ``rate x
        sign(mean load - load)``; ``global_aux_loss`` keeps the counts for the next step."""
        if self.expert_bias is not None:
            loads = counts.to(self.expert_bias.dtype)
            step = self.moe.moe_router_bias_update_rate * torch.sign(loads.mean() - loads)
            self.expert_bias.add_(torch.where(skip, torch.zeros_like(step), step))
        if self.global_counts is not None:
            self.global_counts.copy_(torch.where(skip, self.global_counts, counts.to(self.global_counts.dtype)))
