"""Use a node's real link types (``nvidia-smi topo -m``) in the planner (``ptdp plan --topology``).

:func:`gpu_for_topology` adapts the catalog entry (one NVLink domain of 8) to a saved topology: GPUs
per node = its GPU count; every pair NVLinked: NVLink bandwidth ``min(catalog, NVLINK_PER_LINK x
min over GPUs of the links to its peers)``; some pair not NVLinked: intra-node tensor-parallel
traffic at ``PCIE_BANDWIDTH`` (conservative for bridged pairs, said in the notes).
"""

from __future__ import annotations

import dataclasses

from ptdp.planner.inputs.hardware import GB, GPUType
from ptdp.topology.node import Topology, nvlink_count

#: Bytes/s per NVLink link per direction: 25 GB/s for NVLink 2, 3 and 4 (V100 datasheet: 6 links,
#: 300 GB/s bidirectional; A100: 12 links, 600 GB/s; H100 SXM: 18 links, 900 GB/s).
NVLINK_PER_LINK = 25 * GB
#: Bytes/s per direction of a PCIe 4.0 x16 link: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s raw
#: (PCI-SIG PCIe 4.0 base specification), about 25 GB/s of payload in practice.
PCIE_BANDWIDTH = 25 * GB


def gpu_for_topology(gpu: GPUType, topology: Topology) -> tuple[GPUType, list[str]]:
    """``gpu`` as installed in ``topology``'s node, and sentences saying what changed.

    Raises ValueError if the topology has no GPU.
    """
    n = topology.num_gpus
    if n == 0:
        raise ValueError(f"{topology.source or 'the topology'} lists no GPU: nothing to plan on")
    notes = [f"topology {topology.source}: {n} GPUs per node"]
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if all(topology.nvlinked(i, j) for i, j in pairs):
        links = (
            min(sum(nvlink_count(topology.link(i, j)) for j in range(n) if j != i) for i in range(n)) if n > 1 else 0
        )
        bandwidth = (
            gpu.nvlink_bandwidth
            if n == 1
            else min(gpu.nvlink_bandwidth or NVLINK_PER_LINK * links, NVLINK_PER_LINK * links)
        )
        kinds = sorted({topology.link(i, j) for i, j in pairs})
        notes.append(
            f"every GPU pair joined by NVLink ({', '.join(kinds) or 'single GPU'}): "
            f"{bandwidth / GB:.0f} GB/s per GPU per direction"
        )
    else:
        bandwidth = PCIE_BANDWIDTH
        worst = sorted({topology.link(i, j) for i, j in pairs if not topology.nvlinked(i, j)})
        notes.append(
            f"not every GPU pair is joined by NVLink ({', '.join(worst)} links): tensor-parallel "
            f"communication inside the node is modelled at PCIe bandwidth, "
            f"{PCIE_BANDWIDTH / GB:.0f} GB/s per GPU per direction"
        )
    return dataclasses.replace(gpu, gpus_per_node=n, nvlink_bandwidth=bandwidth), notes
