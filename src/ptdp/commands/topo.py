"""``ptdp topo``: show a node's topology (this machine's, or a saved ``nvidia-smi topo -m`` output)
and, given the parallel sizes, which GPU each local rank should use and what tensor parallelism costs.

Examples::

    ptdp topo                                   # this machine
    ptdp topo --file topo.txt --tp 4 --pp 2     # dp fills the node: 8 GPUs / (4*2) = 1
    ptdp topo --file topo.txt --tp 16 --dp 1 --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ptdp.errors import ConfigError
from ptdp.topology.node import Topology, format_cpu_list
from ptdp.topology.placement import Placement, PlacementError, launch_env, place

DESCRIPTION = """\
Show a node's GPUs, their links (NVLink, PCIe), NICs and NUMA nodes, read from this machine
(nvidia-smi topo -m, else sysfs, else its CPUs) or from a saved `nvidia-smi topo -m` output; with
parallel sizes, map each local rank to a GPU so tensor-parallel groups sit on the fastest links,
and warn where they cannot. Examples:
  ptdp topo
  ptdp topo --file topo.txt --tp 4 --pp 2          (dp fills one node's GPUs)
  ptdp topo --file topo.txt --tp 16 --dp 1 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = DESCRIPTION, argparse.RawDescriptionHelpFormatter
    add_topo_arguments(parser)


def add_topo_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ptdp topo`` (``--debug`` is added by the caller, as for every command)."""
    parser.add_argument("--file", metavar="FILE", help="a saved `nvidia-smi topo -m` output (default: this machine)")
    parser.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, metavar="N", help="pipeline-parallel size (default 1)")
    parser.add_argument(
        "--dp", type=int, metavar="N", help="data-parallel size (default: fill one node, --nproc-per-node or its GPUs)"
    )
    parser.add_argument("--nproc-per-node", type=int, metavar="N", help="processes per node (default: the node's GPUs)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def load_topology(path: str | None) -> Topology:
    """The topology in ``path`` (``nvidia-smi topo -m`` text), or this machine's when ``None``.

    Raises :class:`ConfigError` for an unreadable file and
    :class:`~ptdp.topology.node.TopologyError` for one that does not parse."""
    if path is None:
        from ptdp.topology.sysfs import local_topology

        return local_topology()
    from ptdp.topology.nvsmi import parse_nvidia_smi_topo

    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"--file {path}: {e.strerror or e}") from None
    return parse_nvidia_smi_topo(text, source=path)


def placement_from_args(args: argparse.Namespace, topology: Topology) -> Placement | None:
    """The placement asked for by ``--tp/--pp/--dp/--nproc-per-node``, or ``None`` when none is given.

    ``tp`` and ``pp`` default to 1; ``dp`` to what fills one node (``--nproc-per-node`` or the
    node's GPUs) when ``tp*pp`` divides it. Raises :class:`ConfigError` naming the flag and numbers."""
    flags = {"tp": args.tp, "pp": args.pp, "dp": args.dp, "nproc-per-node": args.nproc_per_node}
    if all(value is None for value in flags.values()):
        return None
    for flag, value in flags.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{flag}={value} must be a positive integer")
    tp, pp, dp = args.tp or 1, args.pp or 1, args.dp
    if dp is None:
        capacity = args.nproc_per_node or topology.num_gpus
        what = "processes per node" if args.nproc_per_node else "GPUs of one node"
        if not capacity:
            raise ConfigError("give --dp (or --nproc-per-node): this topology has no GPUs to fill")
        if capacity % (tp * pp):
            raise ConfigError(f"give --dp: tp*pp = {tp}*{pp} = {tp * pp} does not divide the {capacity} {what}")
        dp = capacity // (tp * pp)
    try:
        return place(topology, tp, pp, dp, args.nproc_per_node)
    except PlacementError as e:
        raise ConfigError(str(e)) from None


def topology_to_dict(topology: Topology) -> dict:
    """JSON-ready description: source, gpus (index, numa_node or None, cpus), links, nics,
    numa_nodes (NUMA node as a string key -> CPUs), cpus."""
    return {
        "source": topology.source,
        "gpus": [{"index": g.index, "numa_node": g.numa_node, "cpus": list(g.cpus)} for g in topology.gpus],
        "links": [list(row) for row in topology.links],
        "nics": [{"name": n.name, "device": n.device, "links": list(n.links)} for n in topology.nics],
        "numa_nodes": {str(node): list(cpus) for node, cpus in sorted(topology.numa_cpus.items())},
        "cpus": list(topology.cpus),
    }


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_topology(topology: Topology) -> str:
    """Text description: a summary line, the link matrix with NIC, NUMA and CPU columns, NUMA nodes."""
    n = topology.num_gpus
    nodes = sorted(topology.numa_cpus)
    nics = f", {len(topology.nics)} NIC{'s' if len(topology.nics) != 1 else ''}" if topology.nics else ""
    lines = [
        f"topology: {topology.source}",
        f"{n or 'no'} GPU{'s' if n != 1 else ''}{nics}, {len(nodes)} NUMA node{'s' if len(nodes) != 1 else ''}"
        f", {len(topology.cpus)} CPUs known",
    ]
    if n:
        names = [f"GPU{g.index}" for g in topology.gpus]
        nic_names = [nic.name if not nic.device else f"{nic.name}({nic.device})" for nic in topology.nics]
        rows = [[""] + names + nic_names + ["NUMA", "CPUs"]]
        for g in topology.gpus:
            rows.append(
                [
                    names[g.index],
                    *topology.links[g.index],
                    *(nic.links[g.index] for nic in topology.nics),
                    "-" if g.numa_node is None else str(g.numa_node),
                    format_cpu_list(g.cpus) or "-",
                ]
            )
        lines += [""] + _table(rows)
    lines += [""] + [f"NUMA node {node}: CPUs {format_cpu_list(topology.numa_cpus[node]) or '-'}" for node in nodes]
    return "\n".join(lines)


def format_placement(p: Placement) -> str:
    """Text description: sizes, the local rank -> GPU / NUMA map, the tp groups, cost, warnings, notes."""
    nodes = f"{p.num_nodes} node{'s' if p.num_nodes != 1 else ''}"
    lines = [f"placement: tp={p.tp} pp={p.pp} dp={p.dp} on {nodes} of {p.nproc_per_node} processes"]
    rows = [["local rank", *map(str, range(p.nproc_per_node))]]
    if p.gpu_of_local_rank:
        rows.append(["GPU", *map(str, p.gpu_of_local_rank)])
    rows.append(["NUMA node", *("-" if n is None else str(n) for n in p.numa_of_local_rank)])
    lines += ["  " + line for line in _table(rows)]
    lines.append("tp groups (node 0):")
    for g in p.tp_groups:
        parts = [f"  local ranks {list(g.local_ranks)}"]
        if g.gpus:
            parts.append(f"GPUs {', '.join(map(str, g.gpus))}")
        if g.numa_nodes:
            parts.append(f"NUMA {', '.join(map(str, g.numa_nodes))}")
        if g.worst_link:
            parts.append(f"worst link {g.worst_link}")
        if g.crosses_nodes:
            parts.append("continues on other nodes")
        lines.append(": ".join(parts[:1]) + (": " + ", ".join(parts[1:]) if parts[1:] else ""))
    lines.append(f"cost: {p.cost}")
    env = launch_env(p)
    if env:
        lines.append(
            "launch each node's workers with: "
            + " ".join(f"{k}={v}" for k, v in env.items())
            + " (ptdp train sets this itself)"
        )
    elif p.gpu_of_local_rank:
        lines.append("the default order (local rank r on GPU r) is this placement")
    lines += [f"warning: {w}" for w in p.warnings] + [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``ptdp topo`` with parsed ``args``; prints to stdout and returns 0.

    Raises :class:`ConfigError` (bad flags, unreadable file, impossible sizes) and
    :class:`~ptdp.topology.node.TopologyError` (unparsable topology); ``ptdp`` turns both into one
    line on stderr and exit status 2."""
    topology = load_topology(args.file)
    placement = placement_from_args(args, topology)
    if args.json:
        out = topology_to_dict(topology)
        out["placement"] = {**placement.to_dict(), "launch_env": launch_env(placement)} if placement else None
        print(json.dumps(out))
        return 0
    print(format_topology(topology))
    if placement:
        print("\n" + format_placement(placement))
    return 0
