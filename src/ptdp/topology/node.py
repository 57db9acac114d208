"""What ptdp knows of one node's hardware: GPUs, their pairwise links, NUMA nodes, CPUs, NICs.
Pure data (no torch.distributed, no I/O), built by :mod:`ptdp.topology.nvsmi` and
:mod:`ptdp.topology.sysfs`.

Link names are ``nvidia-smi topo -m``'s, nearest first: ``X`` (self), ``NV#`` (# bonded NVLinks),
``PIX`` (at most one PCIe bridge), ``PXB`` (several bridges, no host bridge), ``PHB`` (a PCIe host
bridge), ``NODE`` (between host bridges inside a NUMA node), ``SYS`` (across NUMA nodes, QPI/UPI).
"""

from __future__ import annotations

import dataclasses
import re

PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")
"""PCIe link kinds, nearest first."""

_NVLINK = re.compile(r"^NV(\d+)$")
_CPU_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class TopologyError(ValueError):
    """A topology source that cannot be read: the message names the source (file, command), the line
    number and content where there is one, and what was wrong."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Expand a Linux CPU list (``"0-55,112-167"``, ``"3"``, ``""``) to ascending CPU numbers.

    Raises :class:`TopologyError` naming the bad part (``"0-"``, ``"5-3"``, ``"a"``); the caller
    adds where the text came from.
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        match = _CPU_RANGE.match(part.strip())
        if not match:
            raise TopologyError(f'bad CPU list "{text}": "{part}" is not a number N or a range N-M')
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise TopologyError(f'bad CPU list "{text}": range "{part}" ends before it starts')
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``(0, 1, 2, 5)`` -> ``"0-2,5"``; ``""`` for none."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = prev = None
    for cpu in ordered + [None]:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def nvlink_count(link: str) -> int:
    """Number of bonded NVLinks in a link name (``"NV12"`` -> 12); 0 for a PCIe link or ``"X"``."""
    match = _NVLINK.match(link)
    return int(match.group(1)) if match else 0


def is_known_link(link: str) -> bool:
    """Whether ``link`` is one of the names ``nvidia-smi topo -m`` uses (``X``, ``NV#``, PCIe kinds)."""
    return link == "X" or link in PCIE_LINKS or nvlink_count(link) > 0


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU of a node.

    ``index``: its number on the node (CUDA device order, ``GPU<index>`` in nvidia-smi);
    ``numa_node``: the NUMA node it is attached to, ``None`` where unknown;
    ``cpus``: the CPU (logical core) numbers local to it, ascending; empty where unknown.
    """

    index: int
    numa_node: int | None
    cpus: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class NIC:
    """One network interface (``mlx5_0``, ``NIC0``...); ``links``: its link to each GPU, in GPU order;
    ``device``: the device name it stands for where a legend says so (``NIC0`` -> ``mlx5_0``), else None."""

    name: str
    links: tuple[str, ...]
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
    """One node: ``gpus`` (ordered by index), ``links[i][j]`` the link name between GPU i and GPU j
    (``"X"`` on the diagonal; a square matrix of ``len(gpus)``), ``nics``, ``numa_cpus`` (NUMA
    node -> its CPUs, where known), ``cpus`` (every CPU of the node known to the source, ascending)
    and ``source`` (where it was read from, for messages)."""

    gpus: tuple[GPU, ...]
    links: tuple[tuple[str, ...], ...]
    nics: tuple[NIC, ...] = ()
    numa_cpus: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    source: str = ""

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def link(self, i: int, j: int) -> str:
        """The link name between GPU ``i`` and GPU ``j``."""
        return self.links[i][j]

    def nvlinked(self, i: int, j: int) -> bool:
        """Whether GPUs ``i`` and ``j`` are joined by NVLink (``i == j`` counts as joined)."""
        return i == j or nvlink_count(self.links[i][j]) > 0
