"""Rank placement: tensor-parallel groups on NVLink, on one NUMA node, near each other; warnings with
the numbers; input checks; an exact search (checked against brute force on small random nodes)."""

from __future__ import annotations

import math
import random
from itertools import combinations, permutations
from pathlib import Path

import pytest

from ptdp.layout.grid import ParallelLayout
from ptdp.topology.node import GPU, NIC, Topology
from ptdp.topology.nvsmi import parse_nvidia_smi_topo
from ptdp.topology.placement import PlacementError, _block_cost, _nearest_nics, place

DATA = Path(__file__).parents[1] / "data" / "topo"
FILES = {p.stem: p for p in sorted(DATA.glob("*.txt"))}


def load(stem: str) -> Topology:
    return parse_nvidia_smi_topo(FILES[stem].read_text(), source=stem)


HGX, NV4, PCIE = (load(s) for s in ("hgx_a100_8gpu_nvswitch", "nvlink_4gpu_nv4_4nic", "pcie_8x4090_no_nvlink"))


def synthetic(numa: list[int | None], link, nics: tuple[NIC, ...] = ()) -> Topology:
    """A node whose GPU i is on NUMA node numa[i] and whose link(i, j) is given by a function."""
    n = len(numa)
    return Topology(
        gpus=tuple(GPU(i, numa[i], ()) for i in range(n)),
        links=tuple(tuple("X" if i == j else link(min(i, j), max(i, j)) for j in range(n)) for i in range(n)),
        nics=nics,
        source="synthetic",
    )


def test_hgx_tp2_groups_share_a_numa_node():
    p = place(HGX, tp=2, pp=2, dp=2)
    assert p.nproc_per_node == 8 and p.num_nodes == 1
    assert p.gpu_of_local_rank == (0, 1, 2, 3, 4, 5, 6, 7)
    assert p.numa_of_local_rank == (3, 3, 1, 1, 7, 7, 5, 5)
    assert [(g.local_ranks, g.gpus, g.numa_nodes, g.worst_link) for g in p.tp_groups] == [
        ((0, 1), (0, 1), (3,), "NV12"),
        ((2, 3), (2, 3), (1,), "NV12"),
        ((4, 5), (4, 5), (7,), "NV12"),
        ((6, 7), (6, 7), (5,), "NV12"),
    ]
    assert p.tp_link_kind == "NVLink" and p.worst_link == "NV12" and p.warnings == () and p.notes == ()
    assert p.cost == "tensor-parallel groups communicate over NVLink (worst link NV12)"


def test_hgx_tp8_spans_the_node_on_nvlink_with_a_note_only():
    p = place(HGX, tp=8, pp=1, dp=1)
    (group,) = p.tp_groups
    assert group.gpus == tuple(range(8)) and group.numa_nodes == (1, 3, 5, 7) and group.worst_link == "NV12"
    assert p.tp_link_kind == "NVLink" and p.warnings == ()
    assert p.notes == (
        "tp group [0, 1, 2, 3, 4, 5, 6, 7] (GPUs 0, 1, 2, 3, 4, 5, 6, 7) spans NUMA nodes "
        "1, 3, 5 and 7; its GPUs are all NVLink-connected, so only host-side work crosses sockets",
    )


def test_pcie_only_tp4_stays_on_one_socket_and_warns():
    p = place(PCIE, tp=4, pp=1, dp=2)
    assert [set(g.gpus) for g in p.tp_groups] == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert [g.numa_nodes for g in p.tp_groups] == [(0,), (1,)]
    assert "no NVLink on this node (PCIe only): tp=4 groups communicate over PCIe (worst link SYS)" in p.warnings
    assert not any("spans NUMA" in w for w in p.warnings)
    assert p.tp_link_kind == "PCIe, same socket" and p.worst_link == "SYS"
    assert any("SYS links inside tp groups whose GPUs share one NUMA node" in n for n in p.notes)
    crossing = place(PCIE, tp=8, pp=1, dp=1)
    assert crossing.tp_link_kind == "PCIe, across sockets"
    assert (
        "tp group [0, 1, 2, 3, 4, 5, 6, 7] (GPUs 0, 1, 2, 3, 4, 5, 6, 7) spans NUMA nodes 0 and 1" in crossing.warnings
    )


def test_tp_larger_than_a_node_crosses_nodes():
    p = place(HGX, tp=16, pp=1, dp=1)
    assert p.num_nodes == 2 and p.tp_link_kind == "network"
    assert p.warnings[0] == (
        "tp=16 is larger than the 8 GPUs per node: every tensor-parallel all-reduce crosses nodes over the network"
    )
    assert p.tp_groups[0].crosses_nodes and p.cost.startswith("tensor-parallel all-reduces cross nodes")
    uneven = place(HGX, tp=3, pp=1, dp=8)
    assert uneven.num_nodes == 3 and uneven.tp_link_kind == "network"
    assert "tp=3 does not divide the 8 GPUs per node" in uneven.warnings[0]
    assert [g.local_ranks for g in uneven.tp_groups] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [g.crosses_nodes for g in uneven.tp_groups] == [False, False, True]


def test_tp1_has_no_tensor_parallel_traffic():
    p = place(NV4, tp=1, pp=2, dp=2)
    assert p.gpu_of_local_rank == (0, 1, 2, 3) and p.tp_link_kind == "none" and p.worst_link is None
    assert p.cost == "tp=1: no tensor-parallel communication inside a node" and p.warnings == ()


def test_fewer_processes_than_gpus_keep_groups_on_one_socket():
    p = place(PCIE, tp=2, pp=1, dp=2, nproc_per_node=4)
    assert [g.numa_nodes for g in p.tp_groups] == [(0,), (0,)] and len(set(p.gpu_of_local_rank)) == 4
    assert "4 of the 8 GPUs of each node are used" in p.notes
    hgx = place(HGX, tp=4, pp=1, dp=3, nproc_per_node=6)
    assert hgx.num_nodes == 2 and "tp=4 does not divide the 6 processes per node" in hgx.warnings[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0, pp=1, dp=1), "tp must be a positive integer, got 0"),
        (dict(tp=2, pp=-1, dp=1), "pp must be a positive integer, got -1"),
        (dict(tp=1, pp=1, dp=9, nproc_per_node=9), "9 processes per node but the node has only 8 GPUs"),
        (dict(tp=2, pp=1, dp=3), "world size tp*pp*dp = 2*1*3 = 6 is not a multiple of the 8 processes per node"),
        (dict(tp=2, pp=2, dp=1, nproc_per_node=0), "nproc_per_node must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_are_clear_errors(kwargs, message):
    with pytest.raises(PlacementError) as info:
        place(HGX, **kwargs)
    assert message in str(info.value)


def test_nvlink_pairs_beat_index_order():
    # NVLink only between 0-2 and 1-3 (a PCIe bridge otherwise), all on one NUMA node
    topo = synthetic([0, 0, 0, 0], lambda i, j: "NV2" if (i, j) in {(0, 2), (1, 3)} else "PHB")
    p = place(topo, tp=2, pp=1, dp=2)
    assert p.gpu_of_local_rank == (0, 2, 1, 3) and p.tp_link_kind == "NVLink" and p.warnings == ()
    # more bonded links win: 0-1 NV1, 0-2 NV4, 1-3 NV4, 2-3 NV1
    more = synthetic(
        [0] * 4, lambda i, j: {(0, 2): "NV4", (1, 3): "NV4", (0, 1): "NV1", (2, 3): "NV1"}.get((i, j), "SYS")
    )
    assert place(more, tp=2, pp=1, dp=2).gpu_of_local_rank == (0, 2, 1, 3)


def test_interleaved_numa_nodes_and_partial_nvlink_warning():
    topo = synthetic([0, 1, 0, 1], lambda i, j: "NODE" if i % 2 == j % 2 else "SYS")
    p = place(topo, tp=2, pp=1, dp=2)
    assert p.gpu_of_local_rank == (0, 2, 1, 3) and [g.numa_nodes for g in p.tp_groups] == [(0,), (1,)]
    assert p.worst_link == "NODE" and p.tp_link_kind == "PCIe, same socket"
    partial = synthetic([0, 0, 1, 1], lambda i, j: "NV1" if j == i + 1 and i % 2 == 0 else "SYS")
    q = place(partial, tp=4, pp=1, dp=1)
    assert q.warnings == (
        "tp group [0, 1, 2, 3] (GPUs 0, 1, 2, 3) is not fully NVLink-connected: worst link SYS",
        "tp group [0, 1, 2, 3] (GPUs 0, 1, 2, 3) spans NUMA nodes 0 and 1",
    )


def test_gpus_sharing_a_nic_go_together():
    nics = (NIC("mlx5_0", ("PIX", "NODE", "NODE", "PIX")), NIC("mlx5_1", ("NODE", "PIX", "PIX", "NODE")))
    topo = synthetic([0] * 4, lambda i, j: "NODE", nics)
    assert place(topo, tp=2, pp=1, dp=2).gpu_of_local_rank == (0, 3, 1, 2)


def test_unknown_numa_nodes_are_noted():
    topo = synthetic([None, None], lambda i, j: "SYS")
    p = place(topo, tp=2, pp=1, dp=1)
    assert p.numa_of_local_rank == (None, None) and p.tp_link_kind == "PCIe, across sockets"
    assert "NUMA node unknown for GPUs 0 and 1" in p.notes


def test_cpu_only_nodes_get_whole_groups_by_cpu_count():
    even = Topology(gpus=(), links=(), numa_cpus={0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, cpus=tuple(range(8)))
    p = place(even, tp=2, pp=2, dp=2)
    assert p.nproc_per_node == 8 and p.gpu_of_local_rank == () and p.tp_link_kind == "host memory"
    assert p.numa_of_local_rank == (0, 0, 0, 0, 1, 1, 1, 1)
    assert all(len(g.numa_nodes) == 1 and g.worst_link is None for g in p.tp_groups) and p.warnings == ()
    uneven = Topology(gpus=(), links=(), numa_cpus={0: tuple(range(6)), 1: (6, 7)}, cpus=tuple(range(8)))
    assert place(uneven, tp=2, pp=1, dp=4).numa_of_local_rank == (0, 0, 0, 0, 0, 0, 1, 1)
    small = Topology(gpus=(), links=(), numa_cpus={0: (0, 1)}, cpus=(0, 1))
    assert "8 processes share 2 CPUs" in place(small, tp=2, pp=2, dp=2).notes
    none = Topology(gpus=(), links=())
    assert place(none, tp=1, pp=1, dp=2).numa_of_local_rank == (None, None)


def _blocks(gpu_of: tuple[int, ...], unit: int) -> list[tuple[int, ...]]:
    return [gpu_of[i : i + unit] for i in range(0, len(gpu_of), unit)]


def _numa_feasible(topo: Topology, nproc: int, unit: int) -> bool:
    """Whether nproc/unit blocks of unit GPUs can each sit on one NUMA node."""
    counts: dict = {}
    for g in topo.gpus:
        if g.numa_node is None:
            return False
        counts[g.numa_node] = counts.get(g.numa_node, 0) + 1
    return sum(c // unit for c in counts.values()) >= nproc // unit


@pytest.mark.parametrize("stem", sorted(FILES))
def test_random_sizes_use_each_gpu_once_and_keep_groups_on_one_numa_node(stem):
    topo = load(stem)
    rng = random.Random(stem)
    checked = 0
    while checked < 60:
        tp, pp, dp = rng.choice([1, 2, 3, 4, 8, 16]), rng.randint(1, 4), rng.randint(1, 8)
        nproc = rng.choice([None, rng.randint(1, topo.num_gpus)])
        n = nproc or topo.num_gpus
        if (tp * pp * dp) % n:
            with pytest.raises(PlacementError):
                place(topo, tp, pp, dp, nproc)
            continue
        checked += 1
        p = place(topo, tp, pp, dp, nproc)
        assert p.nproc_per_node == n and p.num_nodes * n == tp * pp * dp
        assert len(p.gpu_of_local_rank) == n and len(set(p.gpu_of_local_rank)) == n
        assert all(0 <= g < topo.num_gpus for g in p.gpu_of_local_rank)
        # node 0's tp groups are the layout's tp groups restricted to ranks 0..n-1
        layout_groups = [[r for r in grp if r < n] for grp in ParallelLayout(tp, pp, dp).group_ranks("tp")]
        assert [list(g.local_ranks) for g in p.tp_groups] == [grp for grp in layout_groups if grp]
        unit = math.gcd(tp, n)
        if _numa_feasible(topo, n, unit):
            for block in _blocks(p.gpu_of_local_rank, unit):
                assert len({topo.gpus[g].numa_node for g in block}) == 1, (tp, pp, dp, nproc, block)


def _best_cost_by_brute_force(topo: Topology, nproc: int, unit: int) -> tuple:
    nearest = _nearest_nics(topo)
    best = None
    for chosen in combinations(range(topo.num_gpus), nproc):
        for order in permutations(chosen):
            cost = [0] * 6
            for block in _blocks(order, unit):
                cost = [a + b for a, b in zip(cost, _block_cost(topo, tuple(sorted(block)), nearest))]
            best = tuple(cost) if best is None or tuple(cost) < best else best
    return best


@pytest.mark.parametrize("seed", range(6))
def test_search_is_exact_on_small_random_nodes(seed):
    rng = random.Random(seed)
    n = 6
    numa = [rng.choice([0, 1]) for _ in range(n)]
    kinds = {(i, j): rng.choice(["NV1", "NV2", "PIX", "PHB", "NODE", "SYS"]) for i, j in combinations(range(n), 2)}
    topo = synthetic(numa, lambda i, j: kinds[(i, j)])
    nearest = _nearest_nics(topo)
    for tp, nproc in [(2, 6), (3, 6), (2, 4), (4, 4)]:
        p = place(topo, tp, 1, nproc // tp, nproc)
        got = [0] * 6
        for block in _blocks(p.gpu_of_local_rank, tp):
            got = [a + b for a, b in zip(got, _block_cost(topo, tuple(sorted(block)), nearest))]
        assert tuple(got) == _best_cost_by_brute_force(topo, nproc, tp), (seed, tp, nproc)


def test_sixteen_gpus_are_placed_quickly_and_larger_nodes_keep_index_order():
    import time

    topo = synthetic([i // 4 for i in range(16)], lambda i, j: "NODE" if i // 4 == j // 4 else "SYS")
    start = time.perf_counter()
    p = place(topo, tp=4, pp=1, dp=4)
    assert time.perf_counter() - start < 5
    assert [g.numa_nodes for g in p.tp_groups] == [(0,), (1,), (2,), (3,)]
    big = synthetic([0] * 20, lambda i, j: "SYS")
    assert place(big, tp=2, pp=1, dp=10).gpu_of_local_rank == tuple(range(20))


def test_launch_env_is_empty_for_the_default_order_and_lists_gpus_otherwise():
    from ptdp.topology.placement import launch_env

    assert launch_env(place(HGX, tp=2, pp=2, dp=2)) == {}
    # GPU pairs (0,2) and (1,3) NVLinked, the others PCIe: tp=2 groups must be {0,2} and {1,3}
    bridged = synthetic([0, 0, 0, 0], lambda i, j: "NV4" if (i, j) in ((0, 2), (1, 3)) else "PHB")
    p = place(bridged, tp=2, pp=1, dp=2)
    env = launch_env(p)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    order = [int(g) for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert sorted(order) == [0, 1, 2, 3] and {frozenset(order[:2]), frozenset(order[2:])} == {
        frozenset({0, 2}),
        frozenset({1, 3}),
    }


def test_gpu_order_for_ptdp_train():
    from ptdp.topology.gpu_order import gpu_order
    from ptdp.topology.node import TopologyError

    bridged = synthetic([0, 0, 0, 0], lambda i, j: "NV4" if (i, j) in ((0, 2), (1, 3)) else "PHB")
    env, lines = gpu_order(2, 1, 2, 4, read_topology=lambda: bridged, environ={})
    assert set(env) == {"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"} and "NVLink" in lines[0]
    env, lines = gpu_order(2, 1, 2, 4, read_topology=lambda: bridged, environ={"CUDA_VISIBLE_DEVICES": "3,2,1,0"})
    assert env == {} and "left as is" in lines[0]
    assert gpu_order(2, 2, 2, 8, read_topology=lambda: HGX, environ={})[0] == {}

    def broken():
        raise TopologyError("line 3: unknown link 'NVX'")

    env, lines = gpu_order(2, 1, 2, 4, read_topology=broken, environ={})
    assert env == {} and "unknown link 'NVX'" in lines[0]
    cpu_only = Topology(gpus=(), links=(), source="cpu")
    assert gpu_order(2, 2, 2, 8, read_topology=lambda: cpu_only, environ={}) == ({}, [])
