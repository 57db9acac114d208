"""Executes one pipeline rank's schedule (a list of :class:`~ptdp.pipeline.schedule.Action`).

The runtime owns the per-(microbatch, chunk) state: the input it received (or the tokens on the
first virtual stage), the output it produced, and the gradient it received. Runs of consecutive
transfers are posted together with ``batch_isend_irecv`` on the pp axis; the runtime waits for the
receives at once and for the sends at the end of the schedule, so a send never blocks its rank
(the condition under which :mod:`ptdp.pipeline.verify` proves the schedules deadlock-free).
Activations and gradients use different message tags, so with pp = 2 (where the next and the
previous rank are the same process) a forward activation is never paired with a gradient.
A microbatch's forward and backward see the same weights: the optimizer runs after the schedule.

Communication per microbatch, chunk and stage boundary (Narayanan et al. SC21, §3.2): one send of
the ``[b, s, h]`` activation forward and one of its gradient backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ptdp.comm import P2P, AxisGroup, exchange
from ptdp.pipeline.schedule import Action, peer, transfer_batches

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s])
TAGS = {"forward": 0, "backward": 1}


@dataclass
class _State:
    chunks: list[torch.nn.Module]
    microbatches: list[Microbatch]
    pp: AxisGroup
    device: torch.device
    forward_only: bool
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    pending_sends: list = field(default_factory=list)

    def is_first(self, chunk: int) -> bool:
        return self.pp.rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.pp.rank == self.pp.size - 1 and chunk == len(self.chunks) - 1


def run_schedule(
    actions: list[Action],
    model: torch.nn.Module | list[torch.nn.Module],
    microbatches: list[Microbatch],
    *,
    pp: AxisGroup,
    hidden_shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
    tracer=None,
) -> list[torch.Tensor]:
    """Run this rank's ``actions`` over ``microbatches``; returns the last stage's losses.

    Args:
        actions: this pp rank's schedule.
        model: the stage (``GPTModel``), or its ``v`` model chunks in chunk order.
        microbatches: ``m`` pairs ``(tokens, labels)`` of shape ``[b, s]``.
        pp: the pipeline axis; peers are the previous and next rank (wrapping between chunks).
        hidden_shape: ``(b, s, h)`` of the activations passed between stages.
        forward_only: no autograd graph (evaluation).
        tracer: optional :class:`ptdp.trace.Tracer` recording each action's start and end.

    Returns:
        On the rank holding the last virtual stage, the ``m`` detached per-microbatch mean losses
        in microbatch order; elsewhere ``[]``. In training each loss is backpropagated scaled by
        1/m, so gradients are those of the mean loss over the ``m`` microbatches.

    Raises:
        ValueError: a microbatch whose tokens or labels are not ``[b, s]``.
    """
    b, s, _ = hidden_shape
    for i, (tokens, labels) in enumerate(microbatches):
        if tuple(tokens.shape) != (b, s) or tuple(labels.shape) != (b, s):
            raise ValueError(
                f"microbatch {i} has tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)}; "
                f"expected [micro_batch_size, seq_length] = [{b}, {s}]"
            )
    chunks = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    state = _State(chunks, microbatches, pp, device, forward_only)
    for step in transfer_batches(actions):
        kind = step[0].kind
        span = tracer.span(step) if tracer is not None else None
        if kind == "forward":
            _forward(step[0], state)
        elif kind == "backward":
            _backward(step[0], state)
        else:
            _transfer(step, state, hidden_shape, dtype)
        if span is not None:
            span.end()
    for work in state.pending_sends:
        work.wait()
    return [state.losses[i] for i in sorted(state.losses)]


def _forward(a: Action, state: _State) -> None:
    key, c = (a.microbatch, a.chunk), a.chunk
    tokens, labels = state.microbatches[a.microbatch]
    x = tokens.to(state.device) if state.is_first(c) else state.inputs[key]
    if not state.is_first(c) and not state.forward_only:
        x.requires_grad_()
    last = state.is_last(c)
    with torch.set_grad_enabled(not state.forward_only):
        out = state.chunks[c](x, labels.to(state.device) if last else None)
    if last:
        state.losses[a.microbatch] = out.detach()
        if not state.forward_only:
            state.outputs[key] = out / len(state.microbatches)
    else:
        state.outputs[key] = out
    if state.forward_only and not state.is_first(c):
        del state.inputs[key]


def _backward(a: Action, state: _State) -> None:
    key = (a.microbatch, a.chunk)
    out = state.outputs.pop(key)
    if state.is_last(a.chunk):
        torch.autograd.backward(out)
    else:
        torch.autograd.backward(out, grad_tensors=state.grads.pop(key))
    if not state.is_first(a.chunk):
        state.grads[key] = state.inputs.pop(key).grad


def _transfer(step: list[Action], state: _State, shape, dtype) -> None:
    transfers, received = [], []
    for a in step:
        key = (a.microbatch, a.chunk)
        direction = "forward" if a.kind.endswith("forward") else "backward"
        other = peer(a, state.pp.rank, state.pp.size)
        if a.kind == "send_forward":
            out = state.outputs[key]
            transfers.append(P2P("send", out.detach(), other, TAGS[direction]))
            if state.forward_only:  # nothing to backpropagate later
                del state.outputs[key]
        elif a.kind == "send_backward":
            transfers.append(P2P("send", state.grads.pop(key), other, TAGS[direction]))
        else:
            buf = torch.empty(shape, dtype=dtype, device=state.device)
            transfers.append(P2P("recv", buf, other, TAGS[direction]))
            received.append((a.kind, key, buf))
    state.pending_sends += exchange(transfers, state.pp, tag="pipeline")
    for kind, key, buf in received:
        (state.inputs if kind == "recv_forward" else state.grads)[key] = buf
