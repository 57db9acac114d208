"""The tensor-parallel hot path in one process, through shims of the communication functions on a
tp axis of size 2 whose peer holds the same tensors: the column-parallel backward starts the
input-gradient all-reduce before the weight-gradient GEMM and waits after it, the sequence-parallel
one overlaps its re-gather and reduce-scatter with the two GEMMs, the sequence-parallel gather and
scatter on ``[s, b, h]`` (dim 0) hand the collective their tensors and buffers as they are (no
copy), and the row-parallel forward sums its output in place (no copy). The numbers are checked
against plain float64 autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ptdp.engine.comm import AxisGroup, CommStats
from ptdp.engine.tensor_parallel import linear as linear_module
from ptdp.engine.tensor_parallel import mappings, sequence
from ptdp.engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ptdp.engine.tensor_parallel.linear import LinearPlan, linear

TOL = dict(rtol=1e-12, atol=1e-12)


def _pair() -> AxisGroup:
    """Rank 0 of a tp axis of size 2 (no process group: every call is shimmed)."""
    return AxisGroup("tp", (0, 1), 0, None, CommStats())


class _Events(TorchDispatchMode):
    """Records the matrix products run while active, into a shared list of events."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.events.append("gemm")
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_):
            self.events.append("copy")
        return func(*args, **(kwargs or {}))


class _Handle:
    def __init__(self, events: list, name: str, done=None) -> None:
        self.events, self.name, self.done = events, name, done

    def wait(self) -> bool:
        if self.done is not None:
            self.done()
        self.events.append(f"wait {self.name}")
        return True


def test_column_parallel_backward_overlaps_the_input_gradient_all_reduce(monkeypatch):
    """Backward events: input-gradient GEMM, all-reduce started, weight-gradient GEMM, wait; the
    peer's identical gradient doubles the input gradient (the sum over tp)."""
    events: list = []

    def fake_all_reduce_async(tensor, axis, *, tag=""):
        events.append(f"start all_reduce {tag}")
        return _Handle(events, "all_reduce", done=lambda: tensor.mul_(2))

    monkeypatch.setattr(linear_module, "all_reduce_async", fake_all_reduce_async)  # the column-parallel linear's f
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    col = ColumnParallelLinear(4, 6, tp=_pair(), dtype=torch.float64, tag="mlp_fc1")
    with torch.no_grad():
        col.weight.normal_(generator=g)
        col.bias.normal_(generator=g)
    y = col(x)
    grad = torch.randn(y.shape, dtype=torch.float64, generator=g)
    with _Events(events):
        y.backward(grad)
    assert events == ["gemm", "start all_reduce mlp_fc1", "gemm", "wait all_reduce"]
    torch.testing.assert_close(x.grad, 2 * grad @ col.weight, **TOL)
    torch.testing.assert_close(col.weight.grad, grad.flatten(0, 1).t() @ x.detach().flatten(0, 1), **TOL)
    torch.testing.assert_close(col.bias.grad, grad.sum((0, 1)), **TOL)


def test_sequence_parallel_backward_overlaps_gather_and_reduce_scatter(monkeypatch):
    """Backward events: re-gather started, input-gradient GEMM, reduce-scatter started (after
    waiting for nothing), weight-gradient GEMM after the gather's wait, then the reduce-scatter's
    wait. The peer holds the same shard and the same gradient."""
    events: list = []

    def fake_gather(out, tensor, axis, *, tag=""):
        events.append(f"start all_gather {tag}")
        return _Handle(events, "all_gather", done=lambda: out.copy_(torch.cat([tensor, tensor])))

    def fake_reduce_scatter(out, tensor, axis, *, tag=""):
        events.append(f"start reduce_scatter {tag}")
        return _Handle(events, "reduce_scatter", done=lambda: out.copy_(2 * tensor[: out.shape[0]]))

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)  # [s/t, b, h]
    weight = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    monkeypatch.setattr(sequence, "all_gather_async", fake_gather)
    monkeypatch.setattr(sequence, "reduce_scatter_async", fake_reduce_scatter)
    y = linear(x, weight, bias, LinearPlan("sequence", _pair(), "attn_qkv"))  # [s, b, 6]
    events.clear()
    grad = torch.randn(y.shape, dtype=torch.float64, generator=g)
    with _Events(events):
        y.backward(grad)
    gemms_and_comm = [e for e in events if e != "copy"]
    assert gemms_and_comm == [
        "start all_gather attn_qkv_regather",
        "gemm",
        "start reduce_scatter attn_qkv",
        "wait all_gather",
        "gemm",
        "wait reduce_scatter",
    ]
    full = torch.cat([x.detach(), x.detach()], dim=0)
    torch.testing.assert_close(weight.grad, grad.flatten(0, 1).t() @ full.flatten(0, 1), **TOL)
    torch.testing.assert_close(x.grad, 2 * (grad @ weight.detach())[:3], **TOL)
    torch.testing.assert_close(bias.grad, grad.sum((0, 1)), **TOL)


class _Buffers(TorchDispatchMode):
    """Records every operator that copies or joins tensors (clone, copy_, cat, contiguous's
    clone) run while active, except those inside the collective stand-ins."""

    COPIES = (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten.cat, torch.ops.aten._to_copy)

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket in self.COPIES:
            self.copies.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_sequence_gather_and_scatter_on_dim_0_copy_nothing(monkeypatch):
    """[s, b, h] activations, sequence parallel over tp = 2 (the peer holds a second, different
    shard; CPU stand-ins for the collectives). The all-gather is handed this rank's
    ``[s/t, b, h]`` itself (its storage, no ``.contiguous()`` copy) and the layer's output is the
    ``[s, b, h]`` buffer the collective wrote into, whole; the reduce-scatter is handed the
    ``[s, b, h]`` partial sums themselves and its output buffer is what comes out. No operator
    outside the collectives copies or concatenates, in forward or in backward (g and ḡ), and
    the numbers equal float64 autograd of the gathered / summed tensors."""
    sent: list[tuple[str, int, int]] = []  # (op, storage of the tensor sent, storage of the output)
    mode = _Buffers()
    g = torch.Generator().manual_seed(4)
    peer_shard = torch.randn(3, 2, 4, dtype=torch.float64, generator=g)
    peer_grad = torch.randn(6, 2, 4, dtype=torch.float64, generator=g)
    peer_grad_shard = torch.randn(3, 2, 4, dtype=torch.float64, generator=g)
    peer_blocks = [peer_shard, peer_grad_shard]  # what the peer contributes to the 1st and 2nd all-gather

    def fake_gather(out, tensor, axis, *, tag=""):
        sent.append(("all_gather", _storage(tensor), _storage(out)))
        assert tensor.is_contiguous() and out.is_contiguous() and out.shape[0] == 2 * tensor.shape[0]
        mode.paused = True
        out[: tensor.shape[0]].copy_(tensor)  # rank 0's block, then the peer's
        out[tensor.shape[0] :].copy_(peer_blocks.pop(0))
        mode.paused = False
        return _Handle([], "all_gather")

    def fake_reduce_scatter(out, tensor, axis, *, tag=""):
        sent.append(("reduce_scatter", _storage(tensor), _storage(out)))
        assert tensor.is_contiguous() and tensor.shape[0] == 2 * out.shape[0]
        mode.paused = True
        out.copy_(tensor[: out.shape[0]] + peer_grad[: out.shape[0]])  # rank 0 keeps rows [0, s/t)
        mode.paused = False
        return _Handle([], "reduce_scatter")

    monkeypatch.setattr(sequence, "all_gather_async", fake_gather)
    monkeypatch.setattr(sequence, "reduce_scatter_async", fake_reduce_scatter)
    x = torch.randn(3, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)  # [s/t, b, h]
    y_partial = torch.randn(6, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)  # [s, b, h]
    with mode:
        gathered = sequence.all_gather_sequence(x, _pair(), "t")
        summed = sequence.reduce_scatter_sequence(y_partial * 1.0, _pair(), "t")
    assert [op for op, _, _ in sent] == ["all_gather", "reduce_scatter"]
    assert sent[0][1] == _storage(x) and _storage(gathered) == sent[0][2]
    assert gathered.shape == (6, 2, 4) and gathered.is_contiguous()
    assert _storage(summed) == sent[1][2] and summed.shape == (3, 2, 4)
    torch.testing.assert_close(gathered, torch.cat([x.detach(), peer_shard]), **TOL)
    torch.testing.assert_close(summed, (y_partial.detach() + peer_grad)[:3], **TOL)
    sent.clear()
    grad_gathered = torch.randn(6, 2, 4, dtype=torch.float64, generator=g)
    grad_summed = torch.randn(3, 2, 4, dtype=torch.float64, generator=g)
    with mode:
        torch.autograd.backward([gathered, summed], [grad_gathered, grad_summed])
    # backward of g: reduce-scatter of the [s, b, h] gradient as it is; of ḡ: all-gather of [s/t, b, h]
    assert sorted(op for op, _, _ in sent) == ["all_gather", "reduce_scatter"]
    for op, given, _ in sent:
        assert given == _storage(grad_gathered if op == "reduce_scatter" else grad_summed), op
    assert mode.copies == [], mode.copies
    torch.testing.assert_close(x.grad, (grad_gathered + peer_grad)[:3], **TOL)
    torch.testing.assert_close(y_partial.grad, torch.cat([grad_summed, peer_grad_shard]), **TOL)


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_forward_sums_in_place(monkeypatch, bias):
    """The forward all-reduce gets the GEMM's own output (no clone, no copy before or after it)
    and the result is that same storage; backward passes the gradient through unchanged."""
    seen: list = []

    def fake_all_reduce(tensor, axis, *, op="sum", tag=""):
        seen.append(tensor.untyped_storage().data_ptr())
        return tensor.mul_(2)

    monkeypatch.setattr(mappings, "all_reduce", fake_all_reduce)
    g = torch.Generator().manual_seed(2)
    row = RowParallelLinear(6, 4, tp=_pair(), dtype=torch.float64, bias=bias)
    with torch.no_grad():
        row.weight.normal_(generator=g)
        if bias:
            row.bias.normal_(generator=g)
    x = torch.randn(2, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)  # in_features / tp
    events: list = []
    with _Events(events):
        y = row(x)
    assert "copy" not in events and len(seen) == 1
    want = 2 * F.linear(x.detach(), row.weight.detach()) + (row.bias.detach() if bias else 0)
    torch.testing.assert_close(y, want, **TOL)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones(2, 3, 4, dtype=torch.float64) @ row.weight.detach(), **TOL)
    if not bias:
        assert y.untyped_storage().data_ptr() == seen[0]


def test_in_place_sum_refuses_a_tensor_another_node_saved(monkeypatch):
    """If the partial sums had been saved by some autograd node, summing them in place would
    corrupt its backward: autograd raises instead."""
    monkeypatch.setattr(mappings, "all_reduce", lambda tensor, axis, *, op="sum", tag="": tensor.mul_(2))
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    partial = x * 1.0
    kept = partial.exp()  # exp saves its output ``kept``, not ``partial``; sin saves its input
    saved = partial.sin()
    out = mappings.reduce_from_tp(partial, _pair(), "t")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved.sum() + out.sum() + kept.sum()).backward()
