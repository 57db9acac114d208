"""Executes one pipeline rank's schedule (a list of :class:`~ptdp.pipeline.schedule.Action`).

The runtime owns the per-microbatch state: the input it received (or the tokens on the first
stage), the output it produced, and the gradient it received. Runs of consecutive transfers are
posted together with ``batch_isend_irecv`` on the pp axis. A microbatch's forward and backward see
the same weights: the optimizer only runs after the whole schedule.

Communication per microbatch and stage boundary (Narayanan et al. SC21, §3.2): one send of the
``[b, s, h]`` activation forward and one of its gradient backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ptdp.comm import P2P, AxisGroup, exchange
from ptdp.pipeline.schedule import Action, transfer_batches

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s])


@dataclass
class _State:
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    forward_only: bool = False


def run_schedule(
    actions: list[Action],
    model: torch.nn.Module,
    microbatches: list[Microbatch],
    *,
    pp: AxisGroup,
    hidden_shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
) -> list[torch.Tensor]:
    """Run this rank's ``actions`` over ``microbatches``; returns the last stage's losses.

    Args:
        actions: this pp rank's schedule.
        model: the stage (``GPTModel``); the last stage returns a scalar loss per microbatch.
        microbatches: ``m`` pairs ``(tokens, labels)`` of shape ``[b, s]`` (used on the first
            stage for tokens and the last stage for labels).
        pp: the pipeline axis; peers are the previous and next stage.
        hidden_shape: ``(b, s, h)`` of the activations passed between stages.
        forward_only: no autograd graph (evaluation).

    Returns:
        On the last stage, the ``m`` detached per-microbatch mean losses; elsewhere ``[]``.
        In training, each microbatch's loss is backpropagated scaled by 1/m, so gradients are those
        of the mean loss over the ``m`` microbatches.

    Raises:
        ValueError: a microbatch whose shape is not ``hidden_shape[:2]``.
    """
    m = len(microbatches)
    b, s, _ = hidden_shape
    for i, (tokens, labels) in enumerate(microbatches):
        if tuple(tokens.shape) != (b, s) or tuple(labels.shape) != (b, s):
            raise ValueError(
                f"microbatch {i} has tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)}; "
                f"expected [micro_batch_size, seq_length] = [{b}, {s}]"
            )
    first, last = pp.rank == 0, pp.rank == pp.size - 1
    state = _State(forward_only=forward_only)
    for step in transfer_batches(actions):
        if step[0].kind == "forward":
            _forward(step[0].microbatch, model, microbatches, state, first, last, m, device)
        elif step[0].kind == "backward":
            _backward(step[0].microbatch, state, first, last)
        else:
            _transfer(step, state, pp, hidden_shape, dtype, device)
    return state.losses


def _forward(i, model, microbatches, state: _State, first, last, m, device) -> None:
    forward_only = state.forward_only
    tokens, labels = microbatches[i]
    x = tokens.to(device) if first else state.inputs[i]
    if not first and not forward_only:
        x.requires_grad_()
    with torch.set_grad_enabled(not forward_only):
        out = model(x, labels.to(device) if last else None)
    if last:
        state.losses.append(out.detach())
        if not forward_only:
            state.outputs[i] = out / m
    else:
        state.outputs[i] = out
    if forward_only and not first:
        del state.inputs[i]


def _backward(i, state, first, last) -> None:
    out = state.outputs.pop(i)
    if last:
        torch.autograd.backward(out)
    else:
        torch.autograd.backward(out, grad_tensors=state.grads.pop(i))
    if not first:
        state.grads[i] = state.inputs.pop(i).grad


def _transfer(step: list[Action], state: _State, pp: AxisGroup, shape, dtype, device) -> None:
    transfers, received = [], []
    for a in step:
        i = a.microbatch
        if a.kind == "send_forward":
            out = state.outputs[i]
            transfers.append(P2P("send", out.detach(), pp.rank + 1))
            if state.forward_only:  # nothing to backpropagate later
                del state.outputs[i]
        elif a.kind == "send_backward":
            transfers.append(P2P("send", state.grads.pop(i), pp.rank - 1))
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
            peer = pp.rank - 1 if a.kind == "recv_forward" else pp.rank + 1
            transfers.append(P2P("recv", buf, peer))
            received.append((a.kind, i, buf))
    exchange(transfers, pp, tag="pipeline")
    for kind, i, buf in received:
        (state.inputs if kind == "recv_forward" else state.grads)[i] = buf
