"""Executes one pipeline rank's program (:func:`ptdp.layout.pipeline.program.build_programs`): its
computes, and its point-to-point groups exactly as the program lists them.

Each :class:`~ptdp.layout.pipeline.program.P2PGroup` is posted as one ``batch_isend_irecv`` on the
pp axis, in program order, and waited for only when a compute needs what it received (then with
every group posted before it, as NCCL completes them in order), or at the end: the groups keep
NCCL's posting order, under which :mod:`ptdp.layout.pipeline.nccl_model` proves every program
deadlock-free even when each is waited for at once, and no rank is held in a group by a peer still
computing (:func:`~ptdp.layout.pipeline.nccl_model.program_makespan` is the time of waiting at
once). gloo runs the same program. A sent activation's storage is released once its group is
waited for (its backward then runs through the autograd engine directly). Activations and gradients use
different gloo tags (with pp = 2 both neighbours are one process). A hand-over (the V placement's
turn on rank p - 1) moves a tensor between two chunks of the rank, detached as a received one
would be, and posts nothing. Each step sets the phase of
:mod:`ptdp.engine.activity`. Communication per microbatch, chunk and stage boundary (Narayanan et
al. SC21, §3.2): one send of the activation forward and one of its gradient backward, each of
``hidden_shape`` (``[s, b, h]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import _engine_run_backward

from ptdp.engine.activity import PIPELINE, set_phase
from ptdp.engine.comm import P2P, AxisGroup, post
from ptdp.engine.moe.layer import MoELayer
from ptdp.engine.tensor_parallel.linear import WgradQueue
from ptdp.layout.pipeline.placement import virtual_stage
from ptdp.layout.pipeline.program import P2PGroup, Step
from ptdp.layout.pipeline.schedule import COMPUTE, HANDOVER, Action

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [b, s], labels [b, s])
TAGS = {"forward": 0, "backward": 1}
#: grad_fn types whose backward does not read the forward's output, so the output's storage can go
#: once it is sent (a stage ends with the residual addition)
_FREEABLE = ("AddBackward0",)


@dataclass
class _Pending:
    """A posted group: its work handles, what it sent (kept alive until it completes) and the keys
    of the activations it sent, to release once waited for."""

    works: list
    sent: list[torch.Tensor]
    released: list[tuple[int, int]]
    received: list[tuple[str, int, int]]


@dataclass
class _State:
    chunks: list[torch.nn.Module]
    microbatches: list[Microbatch]
    pp: AxisGroup
    device: torch.device
    forward_only: bool
    placement: str = "looped"
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_factor: float | torch.Tensor = 1.0
    wgrads: dict[tuple[int, int], list] = field(default_factory=dict)
    """The weight-gradient closures a B left for its W, by (microbatch, chunk)."""
    pending: list[_Pending] = field(default_factory=list)
    """Groups posted and not waited for yet, in posting order."""
    arriving: dict[tuple[str, int, int], _Pending] = field(default_factory=dict)
    """What a pending group receives: ("forward" | "backward", microbatch, chunk) -> its group."""
    final: dict[Action, list[int]] = field(default_factory=dict)
    """Split backward: the action after which the chunks ``final[action]``'s gradients are complete."""

    def is_first(self, chunk: int) -> bool:
        return virtual_stage(self.pp.rank, chunk, self.pp.size, self.placement) == 0

    def is_last(self, chunk: int) -> bool:
        return virtual_stage(self.pp.rank, chunk, self.pp.size, self.placement) == self.pp.size * len(self.chunks) - 1


def run_schedule(
    program: Sequence[Step],
    model: torch.nn.Module | list[torch.nn.Module],
    microbatches: list[Microbatch],
    *,
    pp: AxisGroup,
    hidden_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    forward_only: bool = False,
    tracer=None,
    grad_sync=None,
    loss_scale: float | torch.Tensor | None = None,
    seq_length: int | None = None,
    batch_shape: tuple[int, int] | None = None,
    placement: str = "looped",
) -> list[torch.Tensor]:
    """Run this rank's ``program`` over ``microbatches``; returns the last stage's losses.

    ``program``: ``build_programs(kind, p, m, v)[rank]``; ``model``: the stage or its ``v``
    chunks; ``microbatches``: ``m`` pairs ``(tokens, labels)`` of ``[b, s]``; ``pp``: the pipeline
    axis; ``hidden_shape``: the activations between stages, in ``dtype`` (GPT: ``(s, b, h)``,
    ``(s/t, b, h)`` with sequence parallelism); ``grad_sync``: a
    :class:`~ptdp.engine.data_parallel.buffer.GradBuffer` whose reductions start only in each
    chunk's last backward (``no_sync`` before); ``loss_scale``: a float16 loss scale (0-dim, on
    the device); ``batch_shape``: ``(b, s)`` (default from ``hidden_shape`` and ``seq_length``);
    ``placement``: the program's (:mod:`ptdp.layout.pipeline.placement`).
    Returns the last virtual stage's ``m`` detached mean losses (elsewhere ``[]``); each is
    backpropagated scaled by 1/m, and so are the MoE layers' balancing losses (their
    ``loss_scale``). Raises ValueError for a microbatch not ``[b, s]``, TypeError for a schedule's
    transfer action instead of a program.
    """
    b, s = batch_shape or (hidden_shape[0], seq_length or hidden_shape[1])
    _check_microbatches(microbatches, b, s)
    _check_program(program)
    chunks = list(model) if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    state = _State(
        chunks,
        microbatches,
        pp,
        device,
        forward_only,
        placement,
        loss_factor=(1.0 if loss_scale is None else loss_scale) / len(microbatches),
    )
    for chunk in chunks:  # balancing losses inside the stage join backward as the loss does
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.loss_scale = state.loss_factor
                module.step_counts = module.step_sums = None
    split = any(isinstance(a, Action) and a.kind == "backward_weight" for a in program)
    if grad_sync is not None and not forward_only:
        grad_sync.begin_backwards(len(chunks), len(microbatches), pp.size, split=split)
    by_round = grad_sync is not None and grad_sync.by_chunk and not split

    def group(a: Action) -> tuple[int, int]:  # reduced once per (chunk, round) or per chunk
        return (a.chunk, a.microbatch // pp.size if by_round else 0)

    last_backward = {group(a): a for a in program if isinstance(a, Action) and a.kind == "backward"}
    if split and grad_sync is not None and not forward_only:
        state.final = _final_gradients(program, chunks, grad_sync)
    track = not forward_only  # evaluation keeps the caller's phase
    for step in program:
        if isinstance(step, P2PGroup):
            if track:
                set_phase(PIPELINE)
            _exchange(step, state, hidden_shape, dtype, tracer)
            continue
        if step.kind in HANDOVER:
            _handover(step, state)
            continue
        _wait_for_inputs(step, state, tracer)
        if track:
            set_phase(step.kind)
        span = tracer.span([step]) if tracer is not None else None
        if split:  # B and W: the data-parallel reductions wait for the step's end (grad_sync.finish)
            _compute_split(step, state, grad_sync)
        else:
            _compute(step, state, grad_sync is None or last_backward.get(group(step)) == step, grad_sync)
        if span is not None:
            span.end()
    if track:
        set_phase(PIPELINE)
    _wait_until(state, len(state.pending), tracer)
    return [state.losses[i] for i in sorted(state.losses)]


def _check_program(program: Sequence[Step]) -> None:
    if any(isinstance(step, Action) and step.kind not in COMPUTE + HANDOVER for step in program):
        raise TypeError(
            "run_schedule takes a program (ptdp.layout.pipeline.program.build_programs), whose "
            "transfers are grouped; got a schedule's transfer action"
        )


def _check_microbatches(microbatches: list[Microbatch], b: int, s: int) -> None:
    for i, (tokens, labels) in enumerate(microbatches):
        if tuple(tokens.shape) != (b, s) or tuple(labels.shape) != (b, s):
            raise ValueError(
                f"microbatch {i} has tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)}; "
                f"expected [micro_batch_size, seq_length] = [{b}, {s}]"
            )


def _compute(a: Action, state: _State, reduce: bool, grad_sync) -> None:
    """A forward, or a backward (under ``grad_sync.no_sync()`` unless ``reduce``: the last
    backward of its chunk, or with ``grad_sync.by_chunk`` of its chunk in its round, starts the
    data-parallel reductions, then ``grad_sync.chunk_done``)."""
    if a.kind == "forward":
        _forward(a, state)
    elif reduce:
        _backward(a, state)
        if grad_sync is not None:
            grad_sync.chunk_done(a.chunk)
    else:
        with grad_sync.no_sync():
            _backward(a, state)


def _compute_split(a: Action, state: _State, grad_sync) -> None:
    """A forward, an input-gradient backward (B: the chunk's linear layers defer their weight
    gradients to its :class:`~ptdp.engine.tensor_parallel.linear.WgradQueue`; the other
    parameters' gradients and the stage input's come now), a weight-gradient step (W: the
    closures B left for that microbatch and chunk) or a whole backward. Every backward
    accumulates under ``grad_sync.no_sync()``."""
    if a.kind == "forward":
        _forward(a, state)
        return
    if a in state.final:  # the chunk's gradients complete here: its buckets start reducing
        _last_gradients(a, state, grad_sync, state.final[a])
        return
    sync = grad_sync.no_sync() if grad_sync is not None else contextlib.nullcontext()
    with sync:
        if a.kind == "backward":
            _backward(a, state)
            return
        queue = _queue(state.chunks[a.chunk])
        if a.kind == "backward_weight":
            queue.run(state.wgrads.pop((a.microbatch, a.chunk)))
            return
        with queue.defer():
            _backward(a, state)
        state.wgrads[(a.microbatch, a.chunk)] = queue.take()


def _final_gradients(program: Sequence[Step], chunks: list[torch.nn.Module], grad_sync) -> dict[Action, list[int]]:
    """For each chunk ``c`` of ``grad_sync``, the last backward, B or W of the chunks using its
    parameters (a tied embedding shared by two chunks counts in both): ``{action: [c, ...]}``."""
    backwards = [a for a in program if isinstance(a, Action) and a.kind in COMPUTE and a.kind != "forward"]
    final: dict[Action, list[int]] = {}
    for c in range(len(chunks)):
        mine = {id(p) for p in grad_sync.chunk_params(c)}
        users = {u for u, chunk in enumerate(chunks) if any(id(p) in mine for p in chunk.parameters())}
        last = [a for a in backwards if a.chunk in users]
        if last:
            final.setdefault(last[-1], []).append(c)
    return final


def _last_gradients(a: Action, state: _State, grad_sync, complete: list[int]) -> None:
    """The action completing the gradients of the chunks ``complete``, run with the reductions on:
    a W first marks their gradients it does not touch complete, then each of its weights as its
    closure ends (with overlap a bucket's reduction starts once its gradients are complete, while
    the other closures run); a whole backward marks them through the gradient hooks."""
    if a.kind == "backward":
        _backward(a, state)
        return
    if a.kind != "backward_weight":
        raise ValueError(f"{a} completes chunks {complete}' gradients, but its weight gradients run later")
    jobs = state.wgrads.pop((a.microbatch, a.chunk))
    pending = {id(param) for _, param in jobs}
    mine = [param for c in complete for param in grad_sync.chunk_params(c)]
    for param in mine:
        if id(param) not in pending:
            grad_sync.param_ready(param)
    ids = {id(param) for param in mine}
    _queue(state.chunks[a.chunk]).run(
        jobs, done=lambda param: grad_sync.param_ready(param) if id(param) in ids else None
    )


def _queue(chunk: torch.nn.Module) -> WgradQueue:
    """The chunk's weight-gradient queue (a :class:`~ptdp.engine.model.gpt.GPTModel`'s)."""
    queue = getattr(chunk, "wgrad_queue", None)
    if not isinstance(queue, WgradQueue):
        raise TypeError(f"{type(chunk).__name__} has no wgrad_queue: it cannot run a weight-gradient step")
    return queue


def _forward(a: Action, state: _State) -> None:
    key, c = (a.microbatch, a.chunk), a.chunk
    tokens, labels = state.microbatches[a.microbatch]
    x = tokens.to(state.device, non_blocking=True) if state.is_first(c) else state.inputs[key]
    if not state.is_first(c) and not state.forward_only:
        x.requires_grad_()
    last = state.is_last(c)
    with torch.set_grad_enabled(not state.forward_only):
        out = state.chunks[c](x, labels.to(state.device, non_blocking=True) if last else None)
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
        # the engine checks the gradient against the shape the graph recorded (out's storage may be gone)
        _engine_run_backward((out,), (state.grads.pop(key),), False, False, (), True, True)
    if not state.is_first(a.chunk):
        grad = state.inputs.pop(key).grad
        if grad is None:  # a received input requires grad, so backward always fills it
            raise RuntimeError(f"microbatch {a.microbatch}, chunk {a.chunk}: the stage input got no gradient")
        state.grads[key] = grad


def _handover(a: Action, state: _State) -> None:
    """Chunk ``a.chunk``'s input is chunk ``a.chunk - 1``'s output (``handover_forward``, detached
    as a received activation), or its output gradient is chunk ``a.chunk + 1``'s input gradient
    (``handover_backward``)."""
    mb, c = a.microbatch, a.chunk
    if a.kind == "handover_forward":
        out = state.outputs.pop((mb, c - 1)) if state.forward_only else state.outputs[(mb, c - 1)]
        state.inputs[(mb, c)] = out.detach()
    else:
        state.grads[(mb, c)] = state.grads.pop((mb, c + 1))


def _exchange(group: P2PGroup, state: _State, shape, dtype, tracer=None) -> None:
    """Post ``group`` as one batch (not waited for: :func:`_wait_for_inputs`); its receive buffers
    are the received tensors from then on."""
    span = tracer.span([o.action for o in group.ops]) if tracer is not None else None
    transfers, released, received = [], [], []
    for o in group.ops:
        a, key = o.action, (o.action.microbatch, o.action.chunk)
        if a.kind == "send_forward":
            out = state.outputs[key]
            transfers.append(P2P("send", out.detach(), o.peer, TAGS["forward"], o.tag))
            released.append(key)
        elif a.kind == "send_backward":
            transfers.append(P2P("send", state.grads.pop(key), o.peer, TAGS["backward"], o.tag))
        else:
            direction = "forward" if a.kind == "recv_forward" else "backward"
            buf = torch.empty(shape, dtype=dtype, device=state.device)
            transfers.append(P2P("recv", buf, o.peer, TAGS[direction], o.tag))
            (state.inputs if direction == "forward" else state.grads)[key] = buf
            received.append((direction, *key))
    works = post(transfers, state.pp, tag="pipeline", defer=True)
    pending = _Pending(works or [], [t.tensor for t in transfers if t.kind == "send"], released, received)
    state.pending.append(pending)
    for what in received:
        state.arriving[what] = pending
    if span is not None:
        span.end()


def _wait_for_inputs(a: Action, state: _State, tracer=None) -> None:
    """Before compute ``a``: wait for the group receiving its input (a forward's activation, a
    backward's output gradient), and every group posted before it."""
    key = ("forward" if a.kind == "forward" else "backward", a.microbatch, a.chunk)
    pending = state.arriving.get(key) if a.kind != "backward_weight" else None
    if pending is not None:
        _wait_until(state, state.pending.index(pending) + 1, tracer)


def _wait_until(state: _State, count: int, tracer=None) -> None:
    """Wait for the first ``count`` pending groups, in posting order; release what they sent."""
    if count == 0:
        return
    span = tracer.span("wait for recv", "wait") if tracer is not None else None
    done, state.pending = state.pending[:count], state.pending[count:]
    for pending in done:
        for work in pending.works:
            work.wait()
        for what in pending.received:
            del state.arriving[what]
        for key in pending.released:
            _release(state, key)
    if span is not None:
        span.end()


def _release(state: _State, key: tuple[int, int]) -> None:
    """Free a sent activation's storage when only its autograd graph is needed (or drop it in
    evaluation); nothing once its backward has run."""
    if key not in state.outputs:
        return
    out = state.outputs[key]
    if state.forward_only:
        del state.outputs[key]
    elif out.grad_fn is not None and type(out.grad_fn).__name__ in _FREEABLE and out._base is None:
        out.data = torch.empty(0, dtype=out.dtype, device=out.device)
