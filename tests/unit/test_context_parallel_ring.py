"""The ring's point-to-point batches as data (what ``RingAttention`` posts, checked against the
real posts in ``tests/dist/test_context_parallel_attention.py``): deadlock-free under NCCL's rules
(ordered groups per communicator, rendezvous sends, matching by order with the labels checked) for
cp sizes 2 to 16, and the per-step block structure of the 2-chunk layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ptdp.engine.context_parallel.load_balance import chunk_ids
from ptdp.engine.context_parallel.ring import ring_block, ring_groups
from ptdp.layout.pipeline.nccl_model import Op, ScheduleError, simulate_nccl


def _programs(size: int, phase: str) -> list[list]:
    return [
        [
            SimpleNamespace(communicator="cp", ops=[Op(kind, peer, label) for kind, peer, label in group])
            for group in ring_groups(rank, size, phase)
        ]
        for rank in range(size)
    ]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_ring_is_deadlock_free_under_nccl_rules(size, phase):
    programs = _programs(size, phase)
    assert all(len(p) == (size - 1 if phase == "forward" else size + 1) for p in programs)
    simulate_nccl(programs)


def test_the_model_rejects_a_ring_whose_order_pairs_the_wrong_messages():
    """The check is real: swapping a rank's two sends of one batch pairs a key/value block with a
    gradient buffer on its neighbour (NCCL matches by order)."""
    programs = _programs(3, "backward")
    ops = programs[1][1].ops
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(ScheduleError, match="carries"):
        simulate_nccl(programs)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_every_key_block_of_every_query_is_computed_once(size):
    """Over the C steps, rank r's blocks cover exactly the (query chunk, key chunk) pairs with key
    chunk <= query chunk, each once, causal on the diagonal only (the first step's causal mask on
    local indices masks the pair (r, 2C - 1 - r)); every rank does the same work."""
    c = 5
    work = set()
    for rank in range(size):
        seen, cost = {}, 0
        for step in range(size):
            src = (rank - step) % size
            rows, cols, causal = ring_block(rank, src, c)
            q_chunks = chunk_ids(rank, size)[rows.start // c : rows.stop // c]
            k_chunks = chunk_ids(src, size)[cols.start // c : cols.stop // c]
            for qc in q_chunks:
                for kc in k_chunks:
                    if causal and kc > qc:  # masked by the causal mask on local indices
                        continue
                    assert (qc, kc) not in seen
                    seen[(qc, kc)] = causal and qc == kc
            cost += (rows.stop - rows.start) * (cols.stop - cols.start) // (2 if causal else 1)
        mine = chunk_ids(rank, size)
        want = {(qc, kc) for qc in mine for kc in range(2 * size) if kc <= qc}
        assert set(seen) == want
        assert {pair for pair, diag in seen.items() if diag} == {(qc, qc) for qc in mine}
        work.add(cost)
    assert len(work) == 1


def test_each_transfer_is_posted_before_the_attention_it_overlaps(monkeypatch):
    """Forward and backward post step i's batch, then compute step i's block, then wait: the order
    in which the ring overlaps communication with attention (recorded with the transfers and the
    block kernels replaced by recorders on a ring of 3 ranks seen from rank 1)."""
    import torch

    from ptdp.engine.comm import AxisGroup, CommStats
    from ptdp.engine.context_parallel import ring

    events = []

    class Work:
        def __init__(self, n):
            self.n = n

        def wait(self):
            events.append(("wait", self.n))

    def fake_post(transfers, axis, *, tag, defer):
        assert defer
        events.append(("post", [t.label for t in transfers]))
        return [Work(len([e for e in events if e[0] == "post"]))]

    def recorder(name, real):
        def fn(*args, **kwargs):
            events.append((name,))
            return real(*args, **kwargs)

        return fn

    monkeypatch.setattr(ring, "post", fake_post)
    monkeypatch.setattr(ring, "block_forward", recorder("attend", ring.block_forward))
    monkeypatch.setattr(ring, "block_backward", recorder("attend", ring.block_backward))
    axis = AxisGroup("cp", (0, 1, 2), 1, None, CommStats())
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = ring.RingAttention.apply(q, k, v, axis, 0.5, "math")
    assert events == [
        ("post", ["kv1", "kv0"]),
        ("attend",),
        ("wait", 1),
        ("post", ["kv0", "kv2"]),
        ("attend",),
        ("wait", 2),
        ("attend",),
    ]
    events.clear()
    out.backward(torch.ones_like(out))
    assert events == [
        ("post", ["kv1", "kv0"]),
        ("attend",),
        ("wait", 1),
        ("post", ["kv0", "dkv1", "kv2", "dkv0"]),
        ("attend",),
        ("wait", 2),
        ("post", ["dkv0", "dkv2"]),
        ("attend",),
        ("wait", 3),
        ("post", ["dkv2", "dkv1"]),
        ("wait", 4),
    ]
    assert [[label for _, _, label in group] for group in ring_groups(1, 3, "backward")] == [
        e[1] for e in events if e[0] == "post"
    ]
