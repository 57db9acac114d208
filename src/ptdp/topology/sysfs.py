"""This machine's topology, best source first (:func:`local_topology`):

1. ``nvidia-smi topo -m`` (:mod:`ptdp.topology.nvsmi`): the only one that sees NVLink, PCIe
   switches and NICs.
2. sysfs (:func:`from_sysfs`): NVIDIA GPUs under ``/sys/bus/pci/devices``, their NUMA node and
   CPUs; no NVLink, so GPU pairs are ``NODE`` or ``SYS`` (PCIe-only to placement).
3. The CPUs alone (:func:`cpu_topology`): NUMA nodes restricted to this process's affinity mask.

No torch.distributed here; file reads and one subprocess only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ptdp.topology.node import GPU, Topology, TopologyError, parse_cpu_list
from ptdp.topology.nvsmi import parse_nvidia_smi_topo

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03  # PCI base class "display controller" (VGA 0x0300, 3D 0x0302)
_PCI_ADDRESS = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$")
_NODE_DIR = re.compile(r"^node(\d+)$")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_hex(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        raise TopologyError(f"{path}: expected a hexadecimal number, found {text!r}") from None


def _read_cpus(path: Path) -> tuple[int, ...]:
    text = _read(path)
    if text is None:
        return ()
    try:
        return parse_cpu_list(text)
    except TopologyError as e:
        raise TopologyError(f"{path}: {e}") from None


def _read_numa(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        node = int(text)
    except ValueError:
        raise TopologyError(f"{path}: expected a NUMA node number (or -1), found {text!r}") from None
    return node if node >= 0 else None


def _bus_order(path: Path) -> tuple:
    """Sort key of a PCI device folder (``0000:17:00.0``): domain, bus, device, function."""
    match = _PCI_ADDRESS.match(path.name)
    return (0, tuple(int(g, 16) for g in match.groups())) if match else (1, path.name)


def numa_nodes(root: str | os.PathLike = "/sys") -> dict[int, tuple[int, ...]]:
    """NUMA node -> its CPUs, from ``{root}/devices/system/node/node*/cpulist`` (empty if none).

    Raises :class:`TopologyError` naming the file for an unreadable CPU list."""
    base = Path(root) / "devices" / "system" / "node"
    nodes: dict[int, tuple[int, ...]] = {}
    if base.is_dir():
        for entry in base.iterdir():
            match = _NODE_DIR.match(entry.name)
            if match and entry.is_dir():
                nodes[int(match.group(1))] = _read_cpus(entry / "cpulist")
    return dict(sorted(nodes.items()))


def from_sysfs(root: str | os.PathLike = "/sys") -> Topology:
    """NVIDIA GPUs (vendor 0x10de, base class 0x03) and NUMA nodes as Linux sysfs under ``root`` has them.

    GPUs in PCI bus id order (CUDA's ``PCI_BUS_ID``); ``numa_node`` -1 becomes None. Links: ``NODE`` on
    the same known NUMA node, else ``SYS`` (sysfs cannot see NVLink). No NICs. ``cpus``: the nodes'
    CPUs (or the GPUs' without node folders). Raises :class:`TopologyError` naming the file for a
    malformed ``vendor``, ``class``, ``numa_node`` or CPU list.
    """
    root = Path(root)
    devices = root / "bus" / "pci" / "devices"
    gpus: list[GPU] = []
    entries = sorted(devices.iterdir(), key=_bus_order) if devices.is_dir() else []
    for dev in entries:
        vendor, pci_class = _read_hex(dev / "vendor"), _read_hex(dev / "class")
        if vendor != NVIDIA_VENDOR or pci_class is None or pci_class >> 16 != DISPLAY_CLASS:
            continue
        gpus.append(
            GPU(index=len(gpus), numa_node=_read_numa(dev / "numa_node"), cpus=_read_cpus(dev / "local_cpulist"))
        )
    links = tuple(
        tuple(
            "X" if a.index == b.index else "NODE" if a.numa_node is not None and a.numa_node == b.numa_node else "SYS"
            for b in gpus
        )
        for a in gpus
    )
    numa_cpus = {node: cpus for node, cpus in numa_nodes(root).items() if cpus}
    cpus = set().union(*numa_cpus.values()) if numa_cpus else set().union(*(g.cpus for g in gpus))
    return Topology(
        gpus=tuple(gpus), links=links, numa_cpus=numa_cpus, cpus=tuple(sorted(cpus)), source=f"sysfs {root}"
    )


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask: cgroups, Slurm, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_topology(root: str | os.PathLike = "/sys", allowed: set[int] | None = None) -> Topology:
    """This machine without GPUs: its NUMA nodes, each restricted to the ``allowed`` CPUs.

    ``allowed`` defaults to :func:`allowed_cpus`. NUMA nodes with no allowed CPU are left out; when
    sysfs has no node folder (or none holds an allowed CPU) all allowed CPUs form NUMA node 0.
    ``cpus`` is the allowed set. Raises :class:`TopologyError` for a malformed ``cpulist`` file.
    """
    allowed = allowed_cpus() if allowed is None else set(allowed)
    numa_cpus = {}
    for node, cpus in numa_nodes(root).items():
        mine = tuple(c for c in cpus if c in allowed)
        if mine:
            numa_cpus[node] = mine
    if not numa_cpus and allowed:
        numa_cpus = {0: tuple(sorted(allowed))}
    return Topology(
        gpus=(),
        links=(),
        numa_cpus=numa_cpus,
        cpus=tuple(sorted(allowed)),
        source=f"CPUs of this machine (sysfs {root})",
    )


def local_topology(root: str | os.PathLike = "/sys", timeout: float = 15.0) -> Topology:
    """This machine's topology from the best source available.

    ``nvidia-smi topo -m`` when the ``nvidia-smi`` binary is on ``PATH`` and exits 0 within
    ``timeout`` seconds; else :func:`from_sysfs` when it finds NVIDIA GPUs; else :func:`cpu_topology`.
    Raises :class:`TopologyError` when the chosen source cannot be parsed.
    """
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            proc = None
        if proc is not None and proc.returncode == 0 and "GPU0" in proc.stdout:
            return parse_nvidia_smi_topo(proc.stdout, source="nvidia-smi topo -m")
    topology = from_sysfs(root)
    if topology.num_gpus:
        return topology
    return cpu_topology(root)
