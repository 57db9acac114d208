"""Which GPU (or NUMA node) each local rank of a node uses, so tensor-parallel groups sit close.

Pure: no torch.distributed, no I/O. With ranks ordered ``tp-dp-pp`` (:mod:`ptdp.layout.grid`) and
``local_rank = rank % nproc``, a tp group is a block of consecutive local ranks; its four
all-reduces per layer and microbatch (Narayanan et al. SC21, arXiv:2104.04473, §3.2) are a step's
most frequent, largest messages. Blocks of ``gcd(tp, nproc)`` local ranks are placed by, in order:

1. every GPU pair in a block joined by NVLink;
2. each block on one NUMA node where the GPUs allow;
3. the nearest PCIe links (``PIX`` < ... < ``SYS``), more bonded NVLinks, a shared nearest NIC.

Exact search over partitions (nodes above 16 GPUs keep index order); the same map on every node.
Without GPUs, local ranks spread over NUMA nodes by CPU count, whole blocks at a time.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import combinations

from ptdp.topology.node import PCIE_LINKS, Topology, nvlink_count

MAX_SEARCH_GPUS = 16
"""Nodes with more GPUs than this keep the index order (the exact search grows too large)."""


class PlacementError(ValueError):
    """Sizes that cannot be placed on the topology; the message names the numbers and the rule."""


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
    """The part of one tensor-parallel group that lies on one node (node 0 when groups straddle nodes).

    ``local_ranks``; ``gpus`` (empty without GPUs); ``numa_nodes``: the known NUMA nodes it spans,
    ascending; ``worst_link``: the farthest GPU link inside it (``None`` for one GPU or no GPUs);
    ``crosses_nodes``: whether the rest of the group is on other nodes.
    """

    local_ranks: tuple[int, ...]
    gpus: tuple[int, ...]
    numa_nodes: tuple[int, ...]
    worst_link: str | None
    crosses_nodes: bool


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the local ranks of each node run, and what it costs tensor parallelism.

    ``gpu_of_local_rank[r]`` / ``numa_of_local_rank[r]``: local rank ``r``'s GPU (empty without GPUs) /
    NUMA node (None if unknown); ``tp_groups``: node 0's; ``worst_link``: the farthest inside a group;
    ``tp_link_kind``: ``"none"``, ``"NVLink"``, ``"PCIe, same socket"``, ``"PCIe, across sockets"``,
    ``"network"`` or ``"host memory"``; ``cost``: one sentence; ``warnings``, ``notes``.
    """

    tp: int
    pp: int
    dp: int
    nproc_per_node: int
    num_nodes: int
    gpu_of_local_rank: tuple[int, ...]
    numa_of_local_rank: tuple[int | None, ...]
    tp_groups: tuple[GroupPlacement, ...]
    worst_link: str | None
    tp_link_kind: str
    cost: str
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field (tuples become lists)."""
        return dataclasses.asdict(self)


def launch_env(placement: Placement) -> dict[str, str]:
    """Environment that makes local rank ``r`` use GPU ``placement.gpu_of_local_rank[r]``: CUDA
    numbers the visible GPUs in the order listed, and ptdp's workers use ``cuda:LOCAL_RANK``.
    Empty when the placement is the default order (local rank r on GPU r) or has no GPUs.

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes CUDA's GPU numbers those of ``nvidia-smi`` (which lists
    GPUs by PCI bus id; CUDA's default order puts the fastest first)."""
    gpus = placement.gpu_of_local_rank
    if not gpus or gpus == tuple(range(len(gpus))):
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


def link_key(link: str) -> tuple[int, int]:
    """Sort key of a link name, nearest first: NVLink (more bonded links first), then PCIe kinds."""
    if nvlink_count(link):
        return (0, -nvlink_count(link))
    return (1 + PCIE_LINKS.index(link), 0)


def link_kind(link: str) -> str:
    """``"NVLink"``, ``"PCIe, same socket"`` (PIX, PXB, PHB, NODE) or ``"PCIe, across sockets"`` (SYS)."""
    if nvlink_count(link):
        return "NVLink"
    return "PCIe, across sockets" if link == "SYS" else "PCIe, same socket"


def worst_link(topology: Topology, gpus: tuple[int, ...] | list[int]) -> str | None:
    """The farthest link between any two of ``gpus``; ``None`` for fewer than two."""
    links = [topology.link(i, j) for i, j in combinations(gpus, 2)]
    return max(links, key=link_key) if links else None


def place(topology: Topology, tp: int, pp: int, dp: int, nproc_per_node: int | None = None) -> Placement:
    """Map each local rank of a node to a GPU (or a NUMA node) for a ``tp x pp x dp`` run.

    ``nproc_per_node`` defaults to the node's GPU count (to ``tp*pp*dp``, one node, without GPUs).
    Returns a :class:`Placement`. Raises :class:`PlacementError` when a size is not a positive
    integer, when there are more processes per node than GPUs, or when ``tp*pp*dp`` is not a
    multiple of ``nproc_per_node``.
    """
    for name, size in (("tp", tp), ("pp", pp), ("dp", dp), ("nproc_per_node", nproc_per_node)):
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise PlacementError(f"{name} must be a positive integer, got {size!r}")
    world, num_gpus = tp * pp * dp, topology.num_gpus
    nproc = nproc_per_node or num_gpus or world
    if num_gpus and nproc > num_gpus:
        raise PlacementError(
            f"{nproc} processes per node but the node has only {num_gpus} GPUs "
            f"({topology.source}): one process per GPU at most"
        )
    if world % nproc:
        raise PlacementError(
            f"world size tp*pp*dp = {tp}*{pp}*{dp} = {world} is not a multiple of the "
            f"{nproc} processes per node: nodes must be full"
        )
    unit = math.gcd(tp, nproc)
    if num_gpus:
        gpu_of = _place_gpus(topology, nproc, unit)
        numa_of = tuple(topology.gpus[g].numa_node for g in gpu_of)
    else:
        gpu_of, numa_of = (), _place_on_numa(topology, nproc, unit)
    groups = _groups(topology, tp, nproc, gpu_of, numa_of)
    crosses = any(g.crosses_nodes for g in groups)
    worst = max((g.worst_link for g in groups if g.worst_link), key=link_key, default=None)
    kind = (
        "none"
        if tp == 1
        else "network"
        if crosses
        else "host memory"
        if not num_gpus
        else _pcie_or_nvlink(topology, groups, worst)
        if worst
        else "none"
    )
    return Placement(
        tp=tp,
        pp=pp,
        dp=dp,
        nproc_per_node=nproc,
        num_nodes=world // nproc,
        gpu_of_local_rank=gpu_of,
        numa_of_local_rank=numa_of,
        tp_groups=groups,
        worst_link=worst,
        tp_link_kind=kind,
        cost=_cost_sentence(tp, kind, worst),
        warnings=tuple(_warnings(topology, tp, nproc, groups)),
        notes=tuple(_notes(topology, nproc, groups)),
    )


def _pcie_or_nvlink(topology: Topology, groups: tuple[GroupPlacement, ...], worst: str) -> str:
    """Link kind of the groups: NVLink, or PCIe within/across sockets, by NUMA node where every GPU's
    is known (nvidia-smi may print SYS between GPUs it places on one NUMA node), else by link name."""
    if nvlink_count(worst) or any(g.numa_node is None for g in topology.gpus):
        return link_kind(worst)
    spans = any(len(g.numa_nodes) > 1 for g in groups if len(g.gpus) > 1)
    return "PCIe, across sockets" if spans else "PCIe, same socket"


def _nearest_nics(topology: Topology) -> list[frozenset[str]]:
    """Per GPU, the NICs at its nearest link when that link is nearer than SYS (else empty)."""
    out = []
    for g in range(topology.num_gpus):
        keys = {nic.name: link_key(nic.links[g]) for nic in topology.nics}
        best = min(keys.values(), default=None)
        near = best is not None and best < link_key("SYS")
        out.append(frozenset(name for name, key in keys.items() if near and key == best))
    return out


def _block_cost(topology: Topology, block: tuple[int, ...], nearest: list[frozenset[str]]) -> tuple:
    """Cost of putting one block on ``block``'s GPUs, compared lexicographically (see the rules)."""
    pairs = list(combinations(block, 2))
    keys = [link_key(topology.link(i, j)) for i, j in pairs]
    numa = {topology.gpus[g].numa_node for g in block} - {None}
    nics = {nearest[g] for g in block if nearest[g]}
    return (
        sum(1 for i, j in pairs if not topology.nvlinked(i, j)),
        max(len(numa) - 1, 0),
        max((k[0] for k in keys), default=0),
        sum(k[0] for k in keys),
        sum(k[1] for k in keys),
        max(len(nics) - 1, 0),
    )


def _place_gpus(topology: Topology, nproc: int, unit: int) -> tuple[int, ...]:
    """GPU of each local rank: the best partition of ``nproc`` of the GPUs into blocks of ``unit``."""
    num_gpus = topology.num_gpus
    if num_gpus > MAX_SEARCH_GPUS:
        return tuple(range(nproc))
    nearest = _nearest_nics(topology)
    spare = num_gpus - nproc
    costs: dict[tuple[int, ...], tuple] = {}
    memo: dict[tuple[int, int], tuple | None] = {}

    def solve(mask: int, skipped: int):
        """Best (cost, blocks) for the GPUs not in ``mask``; blocks start at the lowest free GPU."""
        key = (mask, skipped)
        if key not in memo:
            free = [g for g in range(num_gpus) if not mask >> g & 1]
            if len(free) + skipped == spare:
                memo[key] = ((0,) * 6, ())
                return memo[key]
            best = None
            for rest in combinations(free[1:], unit - 1):
                block = (free[0], *rest)
                sub = solve(mask | sum(1 << g for g in block), skipped)
                if sub is None:
                    continue
                if block not in costs:
                    costs[block] = _block_cost(topology, block, nearest)
                total = tuple(a + b for a, b in zip(costs[block], sub[0]))
                if best is None or total < best[0]:
                    best = (total, (block, *sub[1]))
            if skipped < spare:
                sub = solve(mask | 1 << free[0], skipped + 1)
                if sub is not None and (best is None or sub[0] < best[0]):
                    best = sub
            memo[key] = best
        return memo[key]

    _, blocks = solve(0, 0)
    return tuple(g for block in blocks for g in block)


def _apportion(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` into integer shares proportional to ``weights`` (largest remainders)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _place_on_numa(topology: Topology, nproc: int, unit: int) -> tuple[int | None, ...]:
    """NUMA node of each local rank without GPUs: whole blocks, in proportion to the nodes' CPUs."""
    nodes = [node for node, cpus in sorted(topology.numa_cpus.items()) if cpus]
    if not nodes:
        return (None,) * nproc
    shares = _apportion(nproc // unit, [len(topology.numa_cpus[n]) for n in nodes])
    return tuple(node for node, share in zip(nodes, shares) for _ in range(share * unit))


def _groups(
    topology: Topology, tp: int, nproc: int, gpu_of: tuple[int, ...], numa_of: tuple[int | None, ...]
) -> tuple[GroupPlacement, ...]:
    """Node 0's tensor-parallel groups (local rank = global rank there)."""
    groups = []
    for start in range(0, nproc, tp):
        local = tuple(range(start, min(start + tp, nproc)))
        gpus = tuple(gpu_of[r] for r in local) if gpu_of else ()
        numa = tuple(sorted({n for n in (numa_of[r] for r in local) if n is not None}))
        groups.append(
            GroupPlacement(
                local_ranks=local,
                gpus=gpus,
                numa_nodes=numa,
                worst_link=worst_link(topology, gpus),
                crosses_nodes=len(local) < tp,
            )
        )
    return tuple(groups)


def _cost_sentence(tp: int, kind: str, worst: str | None) -> str:
    if kind == "none":
        return f"tp={tp}: no tensor-parallel communication inside a node"
    if kind == "host memory":
        return "no GPUs: tensor-parallel all-reduces go through host memory (gloo)"
    if kind == "network":
        inside = f"; inside a node they use {link_kind(worst)} (worst link {worst})" if worst else ""
        return f"tensor-parallel all-reduces cross nodes over the network, the slowest link{inside}"
    return f"tensor-parallel groups communicate over {kind} (worst link {worst})"


def _and(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _describe(group: GroupPlacement) -> str:
    gpus = f" (GPUs {', '.join(map(str, group.gpus))})" if group.gpus else ""
    return f"tp group {list(group.local_ranks)}{gpus}"


def _fully_nvlinked(topology: Topology, gpus: tuple[int, ...]) -> bool:
    return all(topology.nvlinked(i, j) for i, j in combinations(gpus, 2))


def _warnings(topology: Topology, tp: int, nproc: int, groups: tuple[GroupPlacement, ...]) -> list[str]:
    out = []
    per_node = "GPUs" if nproc == topology.num_gpus else "processes"
    if tp > nproc:
        out.append(
            f"tp={tp} is larger than the {nproc} {per_node} per node: every tensor-parallel "
            f"all-reduce crosses nodes over the network"
        )
    elif nproc % tp:
        out.append(
            f"tp={tp} does not divide the {nproc} {per_node} per node: some tensor-parallel groups "
            f"span two nodes and their all-reduces cross the network (groups shown for node 0)"
        )
    multi = [g for g in groups if len(g.gpus) > 1]
    any_nvlink = any(topology.nvlinked(i, j) for i, j in combinations(range(topology.num_gpus), 2))
    if multi and not any_nvlink:
        worst = max((g.worst_link for g in multi if g.worst_link is not None), key=link_key)
        out.append(f"no NVLink on this node (PCIe only): tp={tp} groups communicate over PCIe (worst link {worst})")
    elif multi:
        for g in multi:
            if not _fully_nvlinked(topology, g.gpus):
                out.append(f"{_describe(g)} is not fully NVLink-connected: worst link {g.worst_link}")
    for g in groups:
        if len(g.numa_nodes) > 1 and not (g.gpus and _fully_nvlinked(topology, g.gpus)):
            out.append(f"{_describe(g)} spans NUMA nodes {_and(g.numa_nodes)}")
    return out


def _notes(topology: Topology, nproc: int, groups: tuple[GroupPlacement, ...]) -> list[str]:
    out = []
    num_gpus = topology.num_gpus
    if num_gpus and nproc < num_gpus:
        out.append(f"{nproc} of the {num_gpus} GPUs of each node are used")
    unknown = [g.index for g in topology.gpus if g.numa_node is None]
    if unknown:
        out.append(f"NUMA node unknown for GPU{'s' if len(unknown) > 1 else ''} {_and(unknown)}")
    odd = [
        g
        for g in groups
        if g.worst_link == "SYS"
        and len(g.numa_nodes) == 1
        and all(topology.gpus[i].numa_node is not None for i in g.gpus)
    ]
    if odd:
        out.append(
            f"the source reports SYS links inside tp groups whose GPUs share one NUMA node "
            f"(e.g. {_describe(odd[0])} on NUMA node {odd[0].numa_nodes[0]}); they count as "
            f"same-socket PCIe"
        )
    for g in groups:
        if len(g.numa_nodes) > 1 and g.gpus and _fully_nvlinked(topology, g.gpus):
            out.append(
                f"{_describe(g)} spans NUMA nodes {_and(g.numa_nodes)}; its GPUs are all "
                f"NVLink-connected, so only host-side work crosses sockets"
            )
    if not num_gpus:
        out.append(
            "no GPUs: local ranks are spread over NUMA nodes in proportion to their CPUs, "
            "whole tensor-parallel groups at a time where the shares allow"
        )
        if topology.cpus and nproc > len(topology.cpus):
            out.append(f"{nproc} processes share {len(topology.cpus)} CPUs")
    return out
