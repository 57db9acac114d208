"""Which GPU each local worker of ``ptdp train`` uses: the placement of this machine's topology.

ptdp's workers use ``cuda:LOCAL_RANK``; :func:`gpu_order` returns the environment
(``CUDA_DEVICE_ORDER``, ``CUDA_VISIBLE_DEVICES``) under which local rank ``r`` lands on the GPU
:func:`ptdp.topology.placement.place` chose for it, plus lines to print (the cost and warnings).
A ``CUDA_VISIBLE_DEVICES`` the user set is respected: nothing is changed then.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ptdp.topology.node import Topology, TopologyError
from ptdp.topology.placement import PlacementError, launch_env, place


def gpu_order(
    tp: int,
    pp: int,
    dp: int,
    nproc: int,
    *,
    read_topology: Callable[[], Topology] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """(environment to add for the workers, lines to print) for ``nproc`` local workers of a
    ``tp x pp x dp`` run. ``read_topology`` defaults to
    :func:`ptdp.topology.sysfs.local_topology`; a topology that cannot be read or placed leaves the
    default order and says why (it never stops the run)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return {}, [f"GPU placement: CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} is set; left as is"]
    if read_topology is None:
        from ptdp.topology.sysfs import local_topology

        read_topology = local_topology
    try:
        topology = read_topology()
        if not topology.num_gpus:
            return {}, []
        placement = place(topology, tp, pp, dp, min(nproc, topology.num_gpus))
    except (TopologyError, PlacementError, OSError) as e:
        return {}, [f"GPU placement: default order (local rank r on GPU r); topology not usable: {e}"]
    env = launch_env(placement)
    order = ", ".join(f"{r}->{g}" for r, g in enumerate(placement.gpu_of_local_rank))
    lines = [f"GPU placement (local rank -> GPU): {order}; {placement.cost}"]
    lines += [f"warning: {w}" for w in placement.warnings]
    return env, lines
