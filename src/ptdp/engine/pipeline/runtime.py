"""Executes one pipeline rank's schedule (a list of :class:`~ptdp.engine.pipeline.schedule.Action`).

The runtime owns the per-(microbatch, chunk) state: the input it received (or the tokens on the
first virtual stage), the output it produced, and the gradient it received. Runs of consecutive
transfers are posted together with ``batch_isend_irecv`` on the pp axis. A send never blocks its
rank where it is posted (the condition under which :mod:`ptdp.engine.pipeline.verify` proves the
schedules deadlock-free). A sent activation is waited for right after this rank's backward of the
same microbatch and chunk, when it has certainly arrived (the gradient that came back was
computed from it), which frees its buffer then; sent gradients are waited for at the end of the
schedule (gloo reports a send complete only once waited for). Each receive is posted one transfer step
ahead of the step that waits for it (the next receive of each direction, in schedule order), so
the message usually lands in a posted buffer instead of waiting for one.
Activations and gradients use different message tags, so with pp = 2 (where the next and the
previous rank are the same process) a forward activation is never paired with a gradient.
A microbatch's forward and backward see the same weights: the optimizer runs after the schedule.
In training, each action sets the phase of :mod:`ptdp.engine.activity` (forward, backward, pipeline
send/recv) that a failed transfer or collective reports.

Communication per microbatch, chunk and stage boundary (Narayanan et al. SC21, §3.2): one send of
the ``[b, s, h]`` activation forward and one of its gradient backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ptdp.engine.activity import PIPELINE, set_phase
from ptdp.engine.comm import P2P, AxisGroup, post
from ptdp.engine.pipeline.schedule import Action, peer, transfer_batches

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
    activation_sends: dict[tuple[int, int], object] = field(default_factory=dict)
    prefetched: dict[Action, tuple[torch.Tensor, object]] = field(default_factory=dict)
    prefetch: bool = True
    loss_factor: float = 1.0

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
    grad_sync=None,
    loss_scale: float | None = None,
    seq_length: int | None = None,
) -> list[torch.Tensor]:
    """Run this rank's ``actions`` over ``microbatches``; returns the last stage's losses.

    Args:
        actions: this pp rank's schedule.
        model: the stage (``GPTModel``), or its ``v`` model chunks in chunk order.
        microbatches: ``m`` pairs ``(tokens, labels)`` of shape ``[b, s]``.
        pp: the pipeline axis; peers are the previous and next rank (wrapping between chunks).
        hidden_shape: ``(b, s, h)`` of the activations passed between stages (``(b, s/t, h)``
            with sequence parallelism over t tp ranks).
        forward_only: no autograd graph (evaluation).
        tracer: optional :class:`ptdp.run.trace.Tracer` recording each action's start and end.
        grad_sync: optional object with a ``no_sync()`` context (the gradient buffer): every
            backward but the last of each chunk runs under it, so data-parallel reductions start
            only in the last microbatch's backward (on every stage, the last one included).
        loss_scale: multiply each loss by this before backward (float16 loss scaling).
        seq_length: tokens per sample, when the stages pass a part of the sequence (sequence
            parallelism); None: ``hidden_shape[1]``.

    Returns:
        On the rank holding the last virtual stage, the ``m`` detached per-microbatch mean losses
        in microbatch order; elsewhere ``[]``. In training each loss is backpropagated scaled by
        1/m, so gradients are those of the mean loss over the ``m`` microbatches.

    Raises:
        ValueError: a microbatch whose tokens or labels are not ``[b, s]``.
    """
    _check_microbatches(microbatches, hidden_shape[0], seq_length or hidden_shape[1])
    chunks = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    # prefetching needs one handle per receive; coalescing backends (NCCL) wait a batch as a whole
    prefetch = pp.size > 1 and torch.distributed.get_backend(pp.group) == "gloo"
    state = _State(chunks, microbatches, pp, device, forward_only, prefetch=prefetch,
                   loss_factor=(loss_scale or 1.0) / len(microbatches))
    steps = transfer_batches(actions)
    last_backward = {a.chunk: a for a in actions if a.kind == "backward"}  # the last one per chunk wins
    _prefetch(steps, 0, state, hidden_shape, dtype)
    track = not forward_only  # evaluation keeps the caller's phase
    for index, step in enumerate(steps):
        kind = step[0].kind
        if kind in ("forward", "backward"):
            if track:
                set_phase(kind)
            span = tracer.span(step) if tracer is not None else None
            _compute(step[0], state, grad_sync is None or last_backward[step[0].chunk] == step[0], grad_sync)
            if span is not None:
                span.end()
        else:
            if track:
                set_phase(PIPELINE)
            _transfer(step, state, hidden_shape, dtype, tracer)
            _prefetch(steps, index + 1, state, hidden_shape, dtype)
    if track:
        set_phase(PIPELINE)
    for work in state.pending_sends + list(state.activation_sends.values()):
        work.wait()
    return [state.losses[i] for i in sorted(state.losses)]


def _check_microbatches(microbatches: list[Microbatch], b: int, s: int) -> None:
    for i, (tokens, labels) in enumerate(microbatches):
        if tuple(tokens.shape) != (b, s) or tuple(labels.shape) != (b, s):
            raise ValueError(
                f"microbatch {i} has tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)}; "
                f"expected [micro_batch_size, seq_length] = [{b}, {s}]"
            )


def _compute(a: Action, state: _State, reduce: bool, grad_sync) -> None:
    """A forward, or a backward (under ``grad_sync.no_sync()`` unless ``reduce``: the last
    backward of its chunk starts the data-parallel reductions)."""
    if a.kind == "forward":
        _forward(a, state)
    elif reduce:
        _backward(a, state)
    else:
        with grad_sync.no_sync():
            _backward(a, state)


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
            state.outputs[key] = out * state.loss_factor
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
    sent = state.activation_sends.pop(key, None)
    if sent is not None:  # the next stage used this activation for the gradient we just consumed
        sent.wait()


def _recv(a: Action, state: _State, shape, dtype) -> P2P:
    direction = "forward" if a.kind == "recv_forward" else "backward"
    buf = torch.empty(shape, dtype=dtype, device=state.device)
    return P2P("recv", buf, peer(a, state.pp.rank, state.pp.size), TAGS[direction])


def _prefetch(steps: list[list[Action]], start: int, state: _State, shape, dtype) -> None:
    """Post the next not-yet-posted receive of each direction found from ``steps[start]`` on.

    Receives of one direction come from one peer with one tag, and are posted in schedule order,
    so they pair with the peer's sends exactly as without prefetching.
    """
    if not state.prefetch:
        return
    wanted: dict[str, Action] = {}
    for step in steps[start:]:
        for a in step:
            if a.kind.startswith("recv") and a.kind not in wanted:
                wanted[a.kind] = a
        if len(wanted) == 2:
            break
    todo = [a for a in wanted.values() if a not in state.prefetched]
    transfers = [_recv(a, state, shape, dtype) for a in todo]
    works = post(transfers, state.pp, tag="pipeline")
    for a, t, work in zip(todo, transfers, works):
        state.prefetched[a] = (t.tensor, work)


def _transfer(step: list[Action], state: _State, shape, dtype, tracer=None) -> None:
    """Post this step's sends (and any receive not posted yet) together, then wait for its receives.
    With a tracer, the posting and the waiting are two spans ("transfer", "wait")."""
    span = tracer.span(step) if tracer is not None else None
    transfers, new_recvs = [], []
    for a in step:
        key = (a.microbatch, a.chunk)
        if a.kind == "send_forward":
            out = state.outputs[key]
            transfers.append(P2P("send", out.detach(), peer(a, state.pp.rank, state.pp.size), TAGS["forward"]))
            if state.forward_only:  # nothing to backpropagate later
                del state.outputs[key]
        elif a.kind == "send_backward":
            transfers.append(P2P("send", state.grads.pop(key), peer(a, state.pp.rank, state.pp.size),
                                 TAGS["backward"]))
        elif a not in state.prefetched:
            transfers.append(_recv(a, state, shape, dtype))
            new_recvs.append(a)
    works = post(transfers, state.pp, tag="pipeline")
    if works is None:  # a coalescing backend (NCCL) has waited for the whole batch
        works = [None] * len(transfers)
    recv_index, send_keys = 0, [(a.kind, (a.microbatch, a.chunk)) for a in step if a.kind.startswith("send")]
    for t, work in zip(transfers, works):
        if t.kind == "send":
            kind, key = send_keys.pop(0)
            if work is None:
                continue
            if kind == "send_forward" and not state.forward_only:
                state.activation_sends[key] = work
            else:
                state.pending_sends.append(work)
        else:
            state.prefetched[new_recvs[recv_index]] = (t.tensor, work)
            recv_index += 1
    if span is not None:
        span.end()
        span = tracer.span("wait " + ", ".join(f"{a.kind[5:]} {a.microbatch}.{a.chunk}" for a in step
                                                 if a.kind.startswith("recv")), "wait")
    for a in step:
        if a.kind.startswith("recv"):
            buf, work = state.prefetched.pop(a)
            if work is not None:
                work.wait()
            (state.inputs if a.kind == "recv_forward" else state.grads)[(a.microbatch, a.chunk)] = buf
    if span is not None:
        span.end()
