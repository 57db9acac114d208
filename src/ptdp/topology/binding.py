"""CPU binding of a node's worker processes (``--bind-cpus {none,numa,exclusive}``).

Pure functions of the CPUs this process may use (``os.sched_getaffinity``: cgroups, Slurm,
``taskset``), the NUMA nodes' CPUs and physical cores (:class:`CpuLayout`) and, with GPUs, each
GPU's nearby CPUs from ``/sys/bus/pci/devices/<PCI address>`` (:class:`GpuCpus`):

- GPU, ``numa``: the allowed CPUs of ``cuda:r``'s NUMA node (else its ``local_cpulist``);
  ``exclusive``: workers sharing a NUMA node split its CPUs into even shares of whole cores.
- CPU only, ``numa``: worker ``r`` on node ``r * nodes // n`` (contiguous blocks, so a tp group
  stays on one node), bound to all its CPUs; ``exclusive``: CPUs ordered by node then core, split
  into ``n`` contiguous shares (:func:`exclusive_shares`).
- ``none`` (default): affinity left alone. Threads per worker: its CPUs / workers bound to the same set.

Each worker binds itself at start-up (``os.sched_setaffinity``, :func:`apply_binding`), under
``ptdp train`` and ``torchrun`` alike, one launcher per machine (``LOCAL_WORLD_SIZE``). torch 2.13's
``torchrun --numa-binding`` is not used (GPU-only, needs ``numactl``, launcher-side); on GPU
clusters ``--numa-binding node`` with ``--bind-cpus none`` is a fine alternative.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ptdp.config.fields import BIND_POLICIES
from ptdp.errors import ConfigError
from ptdp.topology.node import TopologyError, format_cpu_list, parse_cpu_list
from ptdp.topology.sysfs import numa_nodes


class BindingError(ConfigError):
    """CPU binding cannot be done as asked; the message names the CPUs involved."""


@dataclasses.dataclass(frozen=True)
class CpuLayout:
    """The CPUs of one node as the workers see them.

    ``allowed``: CPUs this process may use (``os.sched_getaffinity(0)``), ascending;
    ``numa_cpus``: NUMA node -> all its CPUs (allowed or not); empty where unknown;
    ``core_of``: CPU -> key of its physical core (its smallest hyperthread sibling); a CPU missing
    here is a core of its own.
    """

    allowed: tuple[int, ...]
    numa_cpus: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    core_of: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GpuCpus:
    """Where one GPU sits: ``numa_node`` (None where sysfs says -1 or nothing) and ``local_cpus``
    (its ``local_cpulist``; empty where unknown)."""

    numa_node: int | None
    local_cpus: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Binding:
    """One worker's binding: ``cpus`` (ascending; None: leave the affinity alone), ``threads``
    (for torch and OpenMP; None when ``cpus`` is None), ``where`` (what the CPUs are, for messages)."""

    cpus: tuple[int, ...] | None
    threads: int | None
    where: str


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """Every local worker's :class:`Binding` (index = local rank) and warnings for the node."""

    policy: str
    bindings: tuple[Binding, ...]
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line per local rank: ``local rank 1: CPUs 8-15 (8 threads, NUMA node 0)``."""
        lines = []
        for rank, b in enumerate(self.bindings):
            if b.cpus is None:
                lines.append(f"local rank {rank}: not bound ({b.where})")
            else:
                cpus = f"CPU{'s' if len(b.cpus) > 1 else ''} {format_cpu_list(b.cpus)}"
                lines.append(
                    f"local rank {rank}: {cpus} ({b.threads} thread{'s' if b.threads != 1 else ''}, {b.where})"
                )
        return "\n".join(lines)


def allowed_numa_nodes(layout: CpuLayout) -> dict[int, tuple[int, ...]]:
    """NUMA node -> its allowed CPUs, for the nodes that have any; ``{0: allowed}`` when the layout
    knows no node holding an allowed CPU (no sysfs, or a container hiding it)."""
    allowed = set(layout.allowed)
    nodes = {node: tuple(c for c in cpus if c in allowed) for node, cpus in sorted(layout.numa_cpus.items())}
    nodes = {node: cpus for node, cpus in nodes.items() if cpus}
    return nodes or {0: tuple(layout.allowed)}


def exclusive_shares(
    cpus: Sequence[int], n: int, core_of: dict[int, int] | None = None
) -> tuple[list[tuple[int, ...]], str | None]:
    """Split ``cpus`` (ordered so cores and NUMA nodes stay together) into ``n`` contiguous shares;
    return the shares (each ascending) and a note when they are not whole cores of their own.

    ``n <= cores``: whole physical cores (same ``core_of`` key), ``cores // n`` each, one more for the
    first ``cores % n``; ``n <= len(cpus)``: the same over logical CPUs (siblings may be split);
    otherwise share ``i`` is CPU ``i * len(cpus) // n``, shared by consecutive workers.
    Raises BindingError: ``cpus`` empty or ``n < 1``.
    """
    cpus = list(dict.fromkeys(cpus))
    if not cpus:
        raise BindingError("no CPUs to split between the workers")
    if n < 1:
        raise BindingError(f"cannot split CPUs between {n} workers")
    core_of = core_of or {}
    cores: dict[int, list[int]] = {}
    for c in cpus:
        cores.setdefault(core_of.get(c, -1 - c), []).append(c)
    units = list(cores.values())
    if n <= len(units):
        return [tuple(sorted(c for unit in share for c in unit)) for share in _even_split(units, n)], None
    ordered = [c for unit in units for c in unit]
    if n <= len(ordered):
        note = (
            f"{n} workers but {len(units)} physical cores ({len(ordered)} logical CPUs): "
            f"hyperthread siblings are given to different workers"
        )
        return [tuple(sorted(share)) for share in _even_split(ordered, n)], note
    lo, hi = n // len(ordered), -(-n // len(ordered))
    per_cpu = str(lo) if lo == hi else f"{lo} or {hi}"
    note = (
        f"{n} workers but only {len(ordered)} CPUs ({format_cpu_list(ordered)}): each worker is bound to one "
        f"CPU, shared by {per_cpu} consecutive local ranks; expect them to slow each other down"
    )
    return [(ordered[i * len(ordered) // n],) for i in range(n)], note


def _even_split(items: list, n: int) -> list[list]:
    """``items`` cut into ``n`` contiguous runs whose lengths differ by at most one (longer first)."""
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def _check(policy: str, layout: CpuLayout, local_world: int) -> None:
    if policy not in BIND_POLICIES:
        raise BindingError(f"bind_cpus={policy!r} must be one of {BIND_POLICIES}")
    if local_world < 1:
        raise BindingError(f"local world size {local_world} must be >= 1")
    if not layout.allowed:
        raise BindingError(
            "CPU binding was asked for but this process is allowed no CPU (os.sched_getaffinity is empty)"
        )


def plan_cpu_only(policy: str, local_world: int, layout: CpuLayout) -> NodePlan:
    """The binding of every one of ``local_world`` workers on a machine without GPUs (see the
    module docstring for the policies).

    Raises:
        BindingError: unknown policy, ``local_world < 1`` or no allowed CPU.
    """
    _check(policy, layout, local_world)
    if policy == "none":
        return NodePlan(policy, tuple(Binding(None, None, "--bind-cpus none") for _ in range(local_world)))
    nodes = allowed_numa_nodes(layout)
    if policy == "numa":
        ids = list(nodes)
        node_of = [ids[r * len(ids) // local_world] for r in range(local_world)]
        bindings = tuple(
            Binding(nodes[node], max(1, len(nodes[node]) // node_of.count(node)), f"NUMA node {node}")
            for node in node_of
        )
        return NodePlan(policy, bindings)
    node_of_cpu = {c: node for node, cpus in nodes.items() for c in cpus}
    pool = [c for cpus in nodes.values() for c in cpus]
    pool += [c for c in layout.allowed if c not in node_of_cpu]
    shares, note = exclusive_shares(pool, local_world, layout.core_of)
    bindings = tuple(Binding(s, _threads(s, shares), _nodes_of(s, node_of_cpu)) for s in shares)
    return NodePlan(policy, bindings, (note,) if note else ())


def plan_gpus(policy: str, gpus: Sequence[GpuCpus | None], layout: CpuLayout) -> NodePlan:
    """The binding of every local worker of a GPU machine; worker ``r`` drives GPU ``gpus[r]``
    (None: where it sits is unknown, so it is left unbound with a warning).

    Raises:
        BindingError: unknown policy, no allowed CPU, or a GPU none of whose CPUs is allowed
            (e.g. a Slurm allocation on the other socket): use ``--bind-cpus none`` there.
    """
    _check(policy, layout, len(gpus))
    if policy == "none":
        return NodePlan(policy, tuple(Binding(None, None, "--bind-cpus none") for _ in gpus))
    pools = [_gpu_pool(rank, gpu, layout) if gpu is not None else None for rank, gpu in enumerate(gpus)]
    groups: dict[tuple, list[int]] = {}
    for rank, pool in enumerate(pools):
        if pool is not None:
            groups.setdefault(pool[0], []).append(rank)
    bindings: list[Binding] = []
    notes = [
        f"local rank {r}: where GPU {r} sits is unknown (no PCI address from torch, or no sysfs entry "
        f"with its NUMA node or local CPUs); not bound"
        for r, pool in enumerate(pools)
        if pool is None
    ]
    for rank, pool in enumerate(pools):
        if pool is None:
            bindings.append(Binding(None, None, "GPU position unknown"))
            continue
        key, cpus, where = pool
        peers = groups[key]
        if policy == "numa":
            bindings.append(Binding(cpus, max(1, len(cpus) // len(peers)), where))
            continue
        shares, note = exclusive_shares(cpus, len(peers), layout.core_of)
        if note and rank == peers[0]:
            notes.append(f"{where}, GPUs {peers}: {note}")
        share = shares[peers.index(rank)]
        bindings.append(Binding(share, _threads(share, shares), f"share of {where}"))
    return NodePlan(policy, tuple(bindings), tuple(notes))


def _gpu_pool(rank: int, gpu: GpuCpus, layout: CpuLayout) -> tuple[tuple, tuple[int, ...], str] | None:
    """(group key, allowed CPUs, description) of the CPUs near GPU ``rank``; None if unknown."""
    key: tuple[str, object]
    if gpu.numa_node is not None and gpu.numa_node in layout.numa_cpus:
        key, near, where = ("node", gpu.numa_node), layout.numa_cpus[gpu.numa_node], f"NUMA node {gpu.numa_node}"
    elif gpu.local_cpus:
        key, near, where = ("cpus", gpu.local_cpus), gpu.local_cpus, f"CPUs local to GPU {rank}"
    else:
        return None
    allowed = set(layout.allowed)
    cpus = tuple(c for c in near if c in allowed)
    if not cpus:
        raise BindingError(
            f"GPU {rank} sits on {where} (CPUs {format_cpu_list(near)}) but this process may only use CPUs "
            f"{format_cpu_list(layout.allowed)}; ask the scheduler for CPUs near the GPUs or use --bind-cpus none"
        )
    return key, cpus, where


def _threads(share: tuple[int, ...], shares: list[tuple[int, ...]]) -> int:
    return max(1, len(share) // shares.count(share))


def _nodes_of(cpus: tuple[int, ...], node_of_cpu: dict[int, int]) -> str:
    nodes = sorted({node_of_cpu[c] for c in cpus if c in node_of_cpu})
    return "NUMA node " + ",".join(map(str, nodes)) if nodes else "allowed CPUs"


# ---- reading the machine and binding (the only impure part) ----


def read_cpu_layout(sysfs: str | os.PathLike[str] = "/sys") -> CpuLayout:
    """This process's :class:`CpuLayout`: ``os.sched_getaffinity(0)``, the NUMA nodes'
    ``cpulist`` and each allowed CPU's ``thread_siblings_list`` under ``sysfs`` (missing files:
    unknown). Raises :class:`TopologyError` naming a malformed file."""
    root = Path(sysfs)
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    core_of = {}
    for cpu in allowed:
        siblings = _read_cpus(root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if siblings:
            core_of[cpu] = siblings[0]
    return CpuLayout(allowed, numa_nodes(root), core_of)


def read_gpu_cpus(pci_addresses: Sequence[str | None], sysfs: str | os.PathLike[str] = "/sys") -> list[GpuCpus | None]:
    """Each GPU's ``numa_node`` and ``local_cpulist`` from ``sysfs/bus/pci/devices/<address>``;
    None for an unknown address or a missing folder."""
    out: list[GpuCpus | None] = []
    for address in pci_addresses:
        folder = Path(sysfs) / "bus/pci/devices" / address if address else None
        if folder is None or not folder.is_dir():
            out.append(None)
            continue
        node = _read(folder / "numa_node")
        numa_node = int(node) if node is not None and node.lstrip("-").isdigit() and int(node) >= 0 else None
        out.append(GpuCpus(numa_node, _read_cpus(folder / "local_cpulist")))
    return out


def cuda_pci_addresses(count: int) -> list[str | None]:
    """The sysfs PCI address (``"0000:1b:00.0"``) of CUDA devices ``0..count-1``, None for a device
    that does not exist or whose properties carry no PCI ids (older PyTorch builds)."""
    import torch

    out: list[str | None] = []
    for index in range(count):
        if index >= torch.cuda.device_count():
            out.append(None)
            continue
        props = torch.cuda.get_device_properties(index)
        ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        out.append(None if None in ids else f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0")
    return out


def read_node_plan(
    policy: str, local_world: int, *, use_gpus: bool, sysfs: str | os.PathLike[str] = "/sys"
) -> NodePlan:
    """:func:`plan_gpus` or :func:`plan_cpu_only` for this machine as it is now.

    Raises:
        BindingError: see those functions, or a sysfs file that cannot be parsed.
    """
    try:
        layout = read_cpu_layout(sysfs)
        if policy != "none" and use_gpus:
            return plan_gpus(policy, read_gpu_cpus(cuda_pci_addresses(local_world), sysfs), layout)
    except TopologyError as e:
        raise BindingError(f"cannot bind CPUs: {e}") from None
    return plan_cpu_only(policy, local_world, layout)


def bind_this_worker(policy: str, local_rank: int, local_world: int, *, use_gpus: bool) -> Binding | None:
    """Bind the calling worker (local rank ``local_rank`` of ``local_world``) as ``policy`` says;
    return its binding (None for ``none``). Local rank 0 prints the node's warnings to stderr.

    Raises:
        BindingError: see :func:`plan_gpus` and :func:`plan_cpu_only`.
    """
    if policy == "none":
        return None
    plan = read_node_plan(policy, local_world, use_gpus=use_gpus)
    if local_rank == 0:
        for message in plan.warnings:
            print(f"warning: --bind-cpus {policy}: {message}", file=sys.stderr, flush=True)
    binding = plan.bindings[local_rank]
    if binding.cpus is not None:
        apply_binding(binding.cpus)
    return binding


def apply_binding(cpus: Sequence[int]) -> None:
    """Bind this process to ``cpus`` with ``os.sched_setaffinity``: the calling thread, and every
    other thread of the process that still has the calling thread's former affinity (threads
    started later inherit it). Raises ``OSError`` if the kernel refuses (e.g. a CPU not allowed)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == before:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_cpus(path: Path) -> tuple[int, ...]:
    text = _read(path)
    try:
        return parse_cpu_list(text) if text else ()
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None
